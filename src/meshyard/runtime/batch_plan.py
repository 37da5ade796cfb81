"""Global batch, micro-batch and gradient accumulation, derived from one another.

global_batch = micro_batch x grad_accum x data-parallel size. The user gives the global
batch and one of the other two (or neither: then accumulation is 1).

It lives beside ``ParallelDims``: both are derived from the config and the world size,
by the launching process when it validates a run and by each worker for its own job.
"""

from __future__ import annotations

from dataclasses import dataclass


class BatchPlanError(ValueError):
    """The batch settings do not divide over the data-parallel ranks; the message says how."""


@dataclass(frozen=True)
class BatchPlan:
    """Samples per optimizer step (``global_batch``), per forward/backward on one rank
    (``micro_batch``), and how many micro-batches each rank accumulates."""

    global_batch: int
    micro_batch: int
    grad_accum: int
    dp_size: int

    @property
    def per_rank_batch(self) -> int:
        """Samples one data-parallel rank processes per optimizer step."""
        return self.micro_batch * self.grad_accum

    @classmethod
    def derive(cls, global_batch: int, dp_size: int, micro_batch: int = 0, grad_accum: int = 0) -> "BatchPlan":
        """The plan for ``dp_size`` data-parallel ranks; 0 leaves a setting to be derived.
        Raises ``BatchPlanError`` when the numbers do not divide."""
        if global_batch < 1:
            raise BatchPlanError(f"train.global_batch = {global_batch} must be at least 1")
        if global_batch % dp_size:
            raise BatchPlanError(
                f"train.global_batch = {global_batch} is not divisible by the data-parallel size {dp_size}; "
                f"use a multiple of {dp_size}"
            )
        per_rank = global_batch // dp_size
        if micro_batch < 0 or grad_accum < 0:
            raise BatchPlanError("train.micro_batch and train.grad_accum must not be negative")
        if micro_batch and grad_accum:
            if micro_batch * grad_accum != per_rank:
                raise BatchPlanError(
                    f"train.micro_batch = {micro_batch} x train.grad_accum = {grad_accum} x data-parallel size "
                    f"{dp_size} = {micro_batch * grad_accum * dp_size} differs from train.global_batch = "
                    f"{global_batch}; set only one of micro_batch and grad_accum"
                )
        elif micro_batch:
            if per_rank % micro_batch:
                raise BatchPlanError(
                    f"train.global_batch = {global_batch} is not divisible by train.micro_batch = {micro_batch} "
                    f"x data-parallel size {dp_size}; each rank gets {per_rank} samples per step"
                )
            grad_accum = per_rank // micro_batch
        elif grad_accum:
            if per_rank % grad_accum:
                raise BatchPlanError(
                    f"train.grad_accum = {grad_accum} does not divide the {per_rank} samples each rank gets "
                    f"per step (train.global_batch = {global_batch} / data-parallel size {dp_size})"
                )
            micro_batch = per_rank // grad_accum
        else:
            micro_batch, grad_accum = per_rank, 1
        return cls(global_batch=global_batch, micro_batch=micro_batch, grad_accum=grad_accum, dp_size=dp_size)
