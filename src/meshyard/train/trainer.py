"""The training loop: accumulation, precision, clipping, schedule, evaluation, records.

It receives ready objects (a parallelized model, an optimizer, loaders, sinks) and never
branches on the parallel strategy; the few places where layouts differ (gradient sync
on accumulation steps, norms of sharded gradients) are functions of the model itself.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field
from typing import Any, NamedTuple

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor

from meshyard.checkpoint.checkpointer import Checkpointer
from meshyard.config.sections import TrainConfig
from meshyard.data.loader import DataBundle
from meshyard.fault.preemption import NullWatcher, Preempted, PreemptionWatcher
from meshyard.fault.watchdog import HangWatchdog, NullWatchdog
from meshyard.metrics.meter import StepMeter
from meshyard.metrics.records import Sinks
from meshyard.parallel.parallelize import Parallelized
from meshyard.runtime.batch_plan import BatchPlan
from meshyard.train.precision import Precision
from meshyard.train.state import TrainProgress
from meshyard.train.step import Batch, StepRunner


def clip_grad_norm(parameters: list[nn.Parameter], max_norm: float,
                   stage_group: dist.ProcessGroup | None = None, skip: list[nn.Parameter] | None = None) -> torch.Tensor:
    """Global L2 norm of all gradients (clipped to ``max_norm`` when it is > 0).

    Sharded (DTensor: FSDP, TP) gradients give a partial norm per rank; ``full_tensor``
    reduces it so every rank clips by the norm of the whole model, not of its shard.
    Under pipelining each rank holds some stages: the squared norms are summed over
    ``stage_group``, leaving out ``skip`` (a tied weight's second copy, counted once).
    """
    skipped = {id(p) for p in skip or ()}
    grads = [p.grad for p in parameters if p.grad is not None and id(p) not in skipped]
    total = torch.nn.utils.get_total_norm(grads)
    if isinstance(total, DTensor):
        total = total.full_tensor()
    if stage_group is not None:
        squared = total.detach().double() ** 2
        dist.all_reduce(squared, group=stage_group)
        total = squared.sqrt().to(total.dtype)
    if max_norm > 0:
        torch.nn.utils.clip_grads_with_norm_(parameters, max_norm, total)
    return total


class NonFiniteError(RuntimeError):
    """A NaN or inf loss or gradient norm with ``fault.on_nonfinite = 'stop'``."""


@dataclass(frozen=True)
class Agreed:
    """What all ranks learned from the step's all-reduce."""

    loss: float
    preempt: bool
    save_now: bool
    nonfinite: bool


class _PendingAgreement(NamedTuple):
    """The step's agreement all-reduce in flight (``work`` is None on one rank)."""

    flags: torch.Tensor
    work: dist.Work | None


@dataclass(frozen=True)
class Optimization:
    """How gradients become parameter updates: the optimizer, its LR schedule, and the
    numerics of the step (autocast and loss scaler)."""

    optimizer: torch.optim.Optimizer
    scheduler: torch.optim.lr_scheduler.LRScheduler
    precision: Precision


@dataclass(frozen=True)
class Feed:
    """The data side of a step: the loaders, the batch arithmetic, the tokens per sample
    and this rank's data-parallel index (its evaluation shard)."""

    data: DataBundle
    batch: BatchPlan
    seq_len: int
    dp_rank: int


@dataclass(frozen=True)
class Services:
    """Everything around the step: where records go, how they are measured, checkpoints,
    the preemption signal and the hang watchdog."""

    sinks: Sinks
    meter: StepMeter
    checkpointer: Checkpointer
    preemption: PreemptionWatcher | NullWatcher = field(default_factory=NullWatcher)
    watchdog: HangWatchdog | NullWatchdog = field(default_factory=NullWatchdog)


class Trainer:
    """Runs optimizer steps until ``cfg.steps``, recording each and checkpointing when due.

    Build one with ``meshyard.train.build.build_trainer`` (what every rank of a run does),
    or from parts: a parallelized model, its step runner and the bundles above.
    ``progress`` is shared with the checkpointer, which saves and restores it.
    """

    def __init__(self, parallelized: Parallelized, runner: StepRunner, optimization: Optimization, feed: Feed,
                 cfg: TrainConfig, services: Services, progress: TrainProgress, on_nonfinite: str = "warn",
                 facts: dict[str, Any] | None = None) -> None:
        self.model = parallelized.model
        self.compression = parallelized.compression
        self.layout = parallelized.layout
        self.runner = runner
        self.optimizer, self.scheduler, self.precision = optimization.optimizer, optimization.scheduler, \
            optimization.precision
        self.data, self.batch, self.dp_rank = feed.data, feed.batch, feed.dp_rank
        self.tokens_per_step = feed.batch.global_batch * feed.seq_len
        self.cfg = cfg
        self.device = runner.device
        self.sinks, self.meter = services.sinks, services.meter
        self.checkpoints, self.preemption, self.watchdog = services.checkpointer, services.preemption, \
            services.watchdog
        self.timer = self.meter.timer
        self.on_nonfinite = on_nonfinite
        self.progress = progress
        self.facts: dict[str, Any] = facts if facts is not None else {}
        """What this run is (layout, batch, data, model), as recorded in run.json."""
        self.parameters = [p for p in self.model.parameters() if p.requires_grad]
        self._last_eval_loss: float | None = None
        self._checkpoint_stall: float | None = None
        self._outcomes_seen = 0

    def save_checkpoint(self, blocking: bool = False, eval_loss: float | None = None) -> None:
        facts = {"eval_loss": eval_loss, "tokens_seen": self.progress.tokens_seen,
                 "samples_consumed": self.progress.step * self.batch.global_batch}
        self.checkpoints.save(self.progress.step, facts, blocking=blocking)

    def close(self) -> None:
        """Stop the watchdog, close the sinks and the checkpointer (after ``fit``, also when
        it raised)."""
        self.watchdog.stop()
        self.sinks.close()
        self.checkpoints.close()

    # steps ----------------------------------------------------------------------
    def _start_agreement(self, loss: torch.Tensor) -> "_PendingAgreement":
        """Start the one all-reduce per step that carries the loss and the facts every rank
        must agree on: a preemption signal seen by any rank, rank 0's clock asking for a
        time-based checkpoint, and whether any rank's loss is not finite.

        It is started before the optimizer step and read after it, so it overlaps the
        step instead of adding a blocking collective to it. The flags are built on the
        loss's device without reading the loss, so nothing waits for the backward here.
        """
        value = loss.detach().to(torch.float64).reshape(())
        finite = torch.isfinite(value)
        weight = float(self.runner.holds_loss)
        flags = torch.stack([
            torch.where(finite, value * weight, torch.zeros_like(value)), value.new_full((), weight),
            value.new_full((), float(self.preemption.requested)),
            value.new_full((), float(self.checkpoints.time_due())), (~finite).to(torch.float64),
        ])
        work = dist.all_reduce(flags, async_op=True) if dist.get_world_size() > 1 else None
        return _PendingAgreement(flags, work)

    def _finish_agreement(self, pending: "_PendingAgreement") -> "Agreed":
        """Wait for the step's agreement; on a GPU also for the step's kernels, so that the
        step's time covers the optimizer (the all-reduce ran on its own stream)."""
        if pending.work is not None:
            pending.work.wait()
        if self.device.type == "cuda":
            torch.cuda.current_stream(self.device).synchronize()
        total, weight, preempt, save_now, nonfinite = pending.flags.tolist()
        mean = total / weight if nonfinite == 0 else float("nan")
        return Agreed(mean, preempt > 0, save_now > 0, nonfinite > 0)

    def _mean_of_losses(self, value: torch.Tensor) -> float:
        """Mean of a per-rank loss over the ranks that compute one (gloo has no AVG).
        Model-parallel peers hold the same value, so the mean is the data-parallel one."""
        weight = float(self.runner.holds_loss)
        pair = torch.tensor([value.detach().item() * weight, weight], dtype=torch.float64)
        dist.all_reduce(pair)
        return pair[0].item() / pair[1].item()

    def _next_micro_batches(self) -> list[Batch]:
        out = []
        for _ in range(self.batch.grad_accum):
            x, y = next(self._train_iter)
            out.append((x.to(self.device, non_blocking=True), y.to(self.device, non_blocking=True)))
        return out

    def train_step(self, micro_batches: list[Batch]) -> tuple[torch.Tensor, torch.Tensor, "_PendingAgreement"]:
        """One optimizer step over ``grad_accum`` micro-batches; returns (mean loss, grad
        norm, the step's agreement in flight)."""
        loss = self.runner.forward_backward(micro_batches)
        with self.timer.phase("comm", where="sync"):
            pending = self._start_agreement(loss)
        # Runners that cannot time forward and backward apart (a pipeline schedule
        # interleaves them) report their step's split instead.
        for phase, seconds in self.runner.phase_split().items():
            self.timer.add(phase, seconds)
        with self.timer.phase("optimizer"):
            grad_norm = self._optimizer_step()
        return loss, grad_norm, pending

    def _optimizer_step(self) -> torch.Tensor:
        self.precision.scaler.unscale_(self.optimizer)
        # A pipeline runner names the group its stages span and any parameter counted twice.
        grad_norm = clip_grad_norm(self.parameters, self.cfg.grad_clip, self.runner.grad_norm_group,
                                   self.runner.grad_norm_skip)
        self.checkpoints.wait_staged()  # an async save's copy of the weights is taken before they change
        self.precision.scaler.step(self.optimizer)
        self.precision.scaler.update()
        self.optimizer.zero_grad(set_to_none=True)
        self.scheduler.step()
        return grad_norm

    @torch.no_grad()
    def evaluate(self) -> float:
        self.model.eval()
        total = torch.zeros((), device=self.device)
        count = 0
        for inputs, targets in self.data.eval_batches(self.batch.micro_batch, self.cfg.eval_batches,
                                                      self.dp_rank, self.batch.dp_size):
            total += self.runner.eval_loss(inputs.to(self.device), targets.to(self.device))
            count += 1
        self.model.train()
        return self._mean_of_losses(total / max(count, 1))

    def fit(self) -> dict[str, Any]:
        """Run until ``cfg.steps`` optimizer steps are done; return the run's summary figures.

        Raises ``Preempted`` after saving when a preemption signal arrived on any rank,
        and ``NonFiniteError`` on a NaN/inf loss or gradient norm with ``on_nonfinite = stop``.
        """
        self.model.train()
        self._train_iter = iter(self.data.train_loader)
        start = time.perf_counter()
        self.sinks.display.start(self.progress.step)
        try:
            while self.progress.step < self.cfg.steps:
                record, preempt, time_save = self._one_step()
                if preempt:
                    self._stop_for_preemption()
                if time_save or self.checkpoints.due(self.progress.step):
                    self.timer.mark("checkpoint")
                    stall_start = time.perf_counter()
                    self.save_checkpoint(eval_loss=record.get("eval_loss"))
                    self._checkpoint_stall = time.perf_counter() - stall_start
            if self.checkpoints.save_final and self.checkpoints.saved_step != self.progress.step:
                self.timer.mark("checkpoint")
                self.save_checkpoint(blocking=True, eval_loss=self._last_eval_loss)
            self.checkpoints.wait()
        finally:
            self.sinks.display.stop()
        return self._summary(time.perf_counter() - start)

    def _one_step(self) -> tuple[dict[str, Any], bool, bool]:
        """Train one step, evaluate if due, record; returns (record, preempt, save now)."""
        self.meter.start_step()
        self.timer.mark("data", self.progress.step + 1)  # the step this rank is working on
        step_start = time.perf_counter()
        micro_batches = self._next_micro_batches()
        data_time = time.perf_counter() - step_start
        self.timer.add("data", data_time)
        lr = self.scheduler.get_last_lr()[0]
        loss, grad_norm, pending = self.train_step(micro_batches)
        with self.timer.phase("comm", where="sync"):
            agreed = self._finish_agreement(pending)  # also waits for the step to finish
        step_time = time.perf_counter() - step_start
        self.progress.step += 1
        self.progress.tokens_seen += self.tokens_per_step
        self.progress.losses.append(agreed.loss)
        record = {
            "step": self.progress.step, "loss": agreed.loss, "lr": lr, "grad_norm": grad_norm.item(),
            "step_time_s": step_time, "data_time_s": data_time,
            "tokens_per_s": self.tokens_per_step / step_time,
            "samples_per_s": self.batch.global_batch / step_time,
            "tokens_seen": self.progress.tokens_seen, "time": time.time(),
        }
        if self.precision.scaler.is_enabled():
            record["loss_scale"] = self.precision.scaler.get_scale()
        runner_figures = self.runner.take_step_stats()  # pipeline idle share, gathered per rank below
        record.update(runner_figures)
        record.update(self.meter.finish_step(step_time, self.tokens_per_step, runner_figures))
        record.update(self.compression.take_step_stats())
        if agreed.nonfinite or not math.isfinite(record["grad_norm"]):
            record["nonfinite"] = self._report_nonfinite(loss, record["grad_norm"])
        if self.meter.gather_due(self.progress.step):
            record.update(self.meter.gather() or {})
        self._last_eval_loss = None
        if self._should_evaluate():
            self.timer.mark("eval")
            record["eval_loss"] = self._last_eval_loss = self.evaluate()
            best = self.progress.best_eval_loss
            self.progress.best_eval_loss = record["eval_loss"] if best is None else min(best, record["eval_loss"])
        self.checkpoints.poll()
        record.update(self._checkpoint_figures())
        self.sinks.record_step(record, local_loss=loss.item())
        return record, agreed.preempt, agreed.save_now

    def _report_nonfinite(self, loss: torch.Tensor, grad_norm: float) -> list[dict[str, Any]]:
        """Name the ranks with a NaN/inf loss (rare path: one object all-gather)."""
        local = [] if math.isfinite(loss.item()) else [{"rank": dist.get_rank(), "what": "loss",
                                                         "value": str(loss.item())}]
        gathered: list[list[dict[str, Any]]] = [[] for _ in range(dist.get_world_size())]
        dist.all_gather_object(gathered, local)
        found = [entry for entries in gathered for entry in entries]
        if not math.isfinite(grad_norm):
            found.append({"rank": "all", "what": "gradient norm", "value": str(grad_norm)})
        where = "; ".join(f"{e['what']} {e['value']} on rank {e['rank']}" for e in found)
        self.sinks.warn(f"non-finite values at step {self.progress.step}: {where}")
        if self.on_nonfinite == "stop":
            raise NonFiniteError(f"non-finite values at step {self.progress.step}: {where}; stopping "
                                 "(fault.on_nonfinite = 'stop'). Lower optim.lr, check the data, or use fp32.")
        return found

    def _checkpoint_figures(self) -> dict[str, Any]:
        """How long the last save held up training, and saves that finished since the last
        step: their total time (in the background for async saves) or their error."""
        figures: dict[str, Any] = {}
        if self._checkpoint_stall is not None:
            figures["checkpoint_stall_s"], self._checkpoint_stall = self._checkpoint_stall, None
        outcomes = self.checkpoints.outcomes
        for outcome in outcomes[self._outcomes_seen:]:
            figures["checkpoint_step"] = outcome.step
            figures["checkpoint_s"] = outcome.seconds
            figures["checkpoint_commit_s"] = outcome.commit_s  # rank 0's; in the background when async
            if outcome.error:
                figures["checkpoint_error"] = outcome.error
        self._outcomes_seen = len(outcomes)
        return figures

    def _stop_for_preemption(self) -> None:
        self.sinks.display.note(f"meshyard: preemption signal received; saving at step {self.progress.step}")
        committed = self.checkpoints.last_committed()
        if self.checkpoints.enabled:
            self.save_checkpoint(blocking=True)
            committed = self.checkpoints.last_committed()
        received: list[tuple[str | None, float | None]] = [(None, None)] * dist.get_world_size()
        # Rare path: learn which rank got which signal, and when the first one came.
        dist.all_gather_object(received, (self.preemption.received, self.preemption.received_at))
        signal_name = ", ".join(f"{name} on rank {rank}" for rank, (name, _) in enumerate(received) if name)
        first = min((at for _, at in received if at is not None), default=None)
        raise Preempted(self.progress.step, signal_name, committed, first)

    def _should_evaluate(self) -> bool:
        if not self.cfg.eval_every or self.data.val_dataset is None:
            return False
        step = self.progress.step
        return step % self.cfg.eval_every == 0 or step == self.cfg.steps

    def _summary(self, wall_time: float) -> dict[str, Any]:
        losses = self.progress.losses
        steady = self.sinks.step_times[1:] or self.sinks.step_times
        mean_step = sum(steady) / len(steady) if steady else float("nan")
        return {
            "steps": self.progress.step,
            "first_loss": losses[0] if losses else None,
            "final_loss": losses[-1] if losses else None,
            "best_eval_loss": self.progress.best_eval_loss,
            "mean_step_time_s": mean_step,
            "tokens_per_s": self.tokens_per_step / mean_step if steady else None,
            "tokens_seen": self.progress.tokens_seen,
            "wall_time_s": wall_time,
        }
