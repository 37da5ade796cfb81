"""Deterministic, resumable assignment of samples to data-parallel ranks.

All ranks walk one global stream of sample indices: epoch ``e`` is a permutation of the
training samples drawn from ``(seed, e)``. Optimizer step ``s`` consumes stream
positions ``[s*B, (s+1)*B)`` for the global batch ``B``; data-parallel rank ``r`` takes
the ``r``-th contiguous slice of that range and cuts it into micro-batches. So:

- ranks are disjoint within every step and together cover the global batch exactly;
- the samples of a step do not depend on how many ranks share it, so a single process
  and N ranks train on the same batches (the basis of parity tests), and a position
  saved as a step index maps onto any other world size.
"""

from __future__ import annotations

import numpy as np


class GlobalBatchSampler:
    """Batch sampler yielding this rank's micro-batches of dataset indices, forever."""

    def __init__(
        self,
        num_samples: int,
        global_batch: int,
        micro_batch: int,
        dp_rank: int,
        dp_size: int,
        seed: int,
        shuffle: bool = True,
    ) -> None:
        if global_batch > num_samples:
            raise ValueError(
                f"the training split has {num_samples} samples, fewer than one global batch of {global_batch}; "
                "use more data (data.max_tokens, data.paths) or a smaller train.global_batch / data.seq_len"
            )
        if global_batch % (micro_batch * dp_size):
            raise ValueError(f"global batch {global_batch} is not a multiple of {micro_batch} x {dp_size}")
        self.num_samples = num_samples
        self.global_batch = global_batch
        self.micro_batch = micro_batch
        self.dp_rank = dp_rank
        self.dp_size = dp_size
        self.seed = seed
        self.shuffle = shuffle
        self.steps_per_epoch = num_samples // global_batch  # the last partial batch is dropped
        self.start_step = 0  # where a new iterator begins (set by a resume)
        self.micro_per_step = global_batch // (micro_batch * dp_size)

    def epoch_order(self, epoch: int) -> np.ndarray:
        if not self.shuffle:
            return np.arange(self.num_samples)
        return np.random.default_rng([self.seed, epoch]).permutation(self.num_samples)

    def step_indices(self, step: int) -> list[list[int]]:
        """This rank's micro-batches for global optimizer step ``step``."""
        epoch, step_in_epoch = divmod(step, self.steps_per_epoch)
        order = self.epoch_order(epoch)
        return self._slice(order, step_in_epoch)

    def _slice(self, order: np.ndarray, step_in_epoch: int) -> list[list[int]]:
        per_rank = self.global_batch // self.dp_size
        start = step_in_epoch * self.global_batch + self.dp_rank * per_rank
        mine = order[start : start + per_rank]
        return [mine[i : i + self.micro_batch].tolist() for i in range(0, per_rank, self.micro_batch)]

    def __iter__(self) -> "SamplerIterator":
        return SamplerIterator(self)


class SamplerIterator:
    """Iterator over micro-batches from the sampler's ``start_step`` on."""

    def __init__(self, sampler: GlobalBatchSampler) -> None:
        self.sampler = sampler
        self.step = sampler.start_step
        self.micro = 0
        self._epoch = -1
        self._order: np.ndarray | None = None

    def __iter__(self) -> "SamplerIterator":
        return self

    def __next__(self) -> list[int]:
        s = self.sampler
        epoch, step_in_epoch = divmod(self.step, s.steps_per_epoch)
        if epoch != self._epoch:  # one permutation per epoch, computed once
            self._epoch, self._order = epoch, s.epoch_order(epoch)
        assert self._order is not None
        batch = s._slice(self._order, step_in_epoch)[self.micro]
        self.micro += 1
        if self.micro == s.micro_per_step:
            self.step, self.micro = self.step + 1, 0
        return batch


def eval_indices(num_samples: int, micro_batch: int, batches: int, dp_rank: int, dp_size: int) -> list[list[int]]:
    """Fixed evaluation micro-batches for one rank: the same samples at every evaluation."""
    out = []
    for k in range(batches):
        first = (k * dp_size + dp_rank) * micro_batch
        out.append([(first + j) % num_samples for j in range(micro_batch)])
    return out
