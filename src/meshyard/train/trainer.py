"""The training loop: accumulation, precision, clipping, schedule, evaluation, records.

It receives ready objects (a parallelized model, an optimizer, loaders, sinks) and never
branches on the parallel strategy; the few places where layouts differ (gradient sync
on accumulation steps, norms of sharded gradients) are functions of the model itself.

A step is issued (its batch fetched and copied, forward, backward, the agreement
all-reduce, the update) and then settled (its figures read on the host, recorded,
acted on). On a GPU the Trainer issues step N+1 before it settles step N, so the
host never waits for the device inside a steady step: the loss, gradient norm and
flags come back through one non-blocking copy into pinned memory, read when the next
step's work is already queued, and the next batch is fetched and copied while the
current step runs. Steps after which something reads or saves the weights (an
evaluation, a checkpoint, the last step) are settled before the next is issued, so
every save and evaluation sees exactly the weights of its step. A preemption signal
or a time-based save, learnt at a settle, takes effect once nothing is in flight: one
step later than on CPU, where each step is settled before the next is issued.

Non-finite values: with ``fault.on_nonfinite = 'stop'`` the loss flags and gradient
norm are checked before the optimizer step (one host synchronisation per step, the
price of never applying such an update); with 'warn' the step is reported when its
figures are read and training goes on (fp16's loss scaler skips such updates itself).

The spike and NaN guard (``[guard]``, decisions in ``fault.guard``) judges each step
before its update in the same way: it waits for the step's agreed loss and gradient
norm (one host synchronisation per step, so on a GPU the host no longer runs a step
ahead of the device), drops the update of a bad step, and after several bad steps in a
row restores the newest host snapshot (taken every ``guard.snapshot_every`` steps with
nothing in flight) or, with ``snapshot_every = 0``, the run's newest checkpoint from
before them (``train.rollback``), skips the samples of those steps in the data stream and
goes on. Every decision is a line of guard.jsonl and a console note. Replayed steps are
recorded again, marked ``replay``; the summary's losses are those of kept steps. A
checkpoint that falls due during a run of bad steps waits for the next kept step (after a
rollback, its step comes round again), so no checkpoint holds a half-judged stretch: a
checkpoint saved before the rollback lets a resumed run meet the same bad steps and roll
back over them again, and every one saved after it (a step saved in the first pass is
saved again, replacing it) carries the skip list.
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
from meshyard.fault.guard import KEPT, SpikeGuard, Verdict
from meshyard.fault.preemption import NullWatcher, Preempted, PreemptionWatcher
from meshyard.fault.watchdog import HangWatchdog, NullWatchdog
from meshyard.metrics.cost import CostMeter, NullCostMeter
from meshyard.metrics.meter import StepMeter, StepReadings
from meshyard.metrics.profiling import NullProfiler, StepProfiler
from meshyard.metrics.records import JsonlWriter, NullWriter, Sinks
from meshyard.parallel.parallelize import Parallelized
from meshyard.runtime.batch_plan import BatchPlan
from meshyard.runtime.collector import RunCollector
from meshyard.train.precision import Precision
from meshyard.train.rollback import CheckpointRollback, RollbackTarget, SnapshotRollback
from meshyard.train.state import TrainProgress
from meshyard.train.step import Batch, RunnerFigures, StepRunner


def clip_grad_norm(parameters: list[nn.Parameter], max_norm: float,
                   stage_group: dist.ProcessGroup | None = None, skip: list[nn.Parameter] | None = None) -> torch.Tensor:
    """Global L2 norm of all gradients (clipped to ``max_norm`` when it is > 0).

    Sharded (DTensor: FSDP, TP) gradients give a partial norm per rank; ``full_tensor``
    reduces it so every rank clips by the norm of the whole model, not of its shard.
    Under pipelining each rank holds some stages: the squared norms are summed over
    ``stage_group``, leaving out ``skip`` (a tied weight's second copy, counted once).
    """
    skipped = {id(p) for p in skip or ()}
    # DTensor math does not mix meshes, and under expert parallelism the expert weights
    # live on another mesh than the dense ones: norms are reduced per mesh, then combined.
    by_mesh = _by_mesh([p for p in parameters if p.grad is not None])
    norms = []
    for group in by_mesh:
        norm = torch.nn.utils.get_total_norm([p.grad for p in group if id(p) not in skipped])
        norms.append(norm.full_tensor() if isinstance(norm, DTensor) else norm)
    total = norms[0] if len(norms) == 1 else torch.linalg.vector_norm(torch.stack(norms))
    if stage_group is not None:
        squared = total.detach().double() ** 2
        dist.all_reduce(squared, group=stage_group)
        total = squared.sqrt().to(total.dtype)
    if max_norm > 0:
        for group in by_mesh:
            partial, whole = [], []
            for param in group:
                (partial if _is_partial(param.grad) else whole).append(param)
            if partial:
                _scale_local_pieces([param.grad for param in partial], max_norm, total)
            torch.nn.utils.clip_grads_with_norm_(whole, max_norm, total)
    return total


def _is_partial(grad: torch.Tensor) -> bool:
    """Whether ``grad`` is a DTensor holding partial sums (tensor parallelism's layer norms)."""
    return isinstance(grad, DTensor) and any(placement.is_partial() for placement in grad.placements)


def _scale_local_pieces(grads: list[DTensor], max_norm: float, total: torch.Tensor) -> None:
    """Scales partial-sum gradients by ``clip_grads_with_norm_``'s coefficient through their
    local pieces (a sum scales with its parts): torch 2.10-2.11 run the in-place foreach
    multiply of a ``Partial`` DTensor on a copy and drop it, leaving it unclipped. Only these
    take the detour: ``to_local`` costs several times the DTensor multiply per gradient."""
    coefficient = torch.clamp(max_norm / (total + 1e-6), max=1.0)
    pieces = [grad.to_local() for grad in grads]
    torch._foreach_mul_(pieces, coefficient.to(pieces[0].device))


def _by_mesh(parameters: list[nn.Parameter]) -> list[list[nn.Parameter]]:
    """``parameters`` grouped by the mesh of their gradients (plain tensors as one group);
    one group (possibly empty) when they share one."""
    groups: dict[object, list[nn.Parameter]] = {}
    for param in parameters:
        grad = param.grad
        groups.setdefault(grad.device_mesh if isinstance(grad, DTensor) else None, []).append(param)
    return list(groups.values()) or [[]]


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
    """The step's agreement all-reduce in flight (``work`` is None on one rank): this rank's
    loss, and the flags being summed over the ranks (``READOUT[2:]``)."""

    local_loss: torch.Tensor
    flags: torch.Tensor
    work: dist.Work | None


# The figures a step sends back to the host, in this order, as one float64 vector: this
# rank's loss and the global gradient norm, then the agreement's sums: the loss over the
# ranks that compute one (NaN or inf when any of them is not finite), their number, and
# the ranks that saw a preemption signal or (rank 0) found a time-based save due.
READOUT = ("local_loss", "grad_norm", "loss_total", "loss_weight", "preempt", "save_now")


@dataclass(frozen=True)
class IssuedStep:
    """A step whose work has been issued (on a GPU possibly still running) and whatever
    its record needs that was known when it was issued."""

    step: int
    lr: float
    data_time: float
    readout: torch.Tensor
    """``READOUT`` on the host: on a GPU a non-blocking copy, valid once ``ready`` completes."""
    ready: Any
    """A CUDA event recorded after that copy; None where the copy is already done."""
    readings: StepReadings
    runner_figures: RunnerFigures
    compression_figures: dict[str, Any]
    loss_scale: float | None
    verdict: Verdict = KEPT
    """The spike and NaN guard's judgement (always kept without a guard)."""


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
    guard_log: JsonlWriter | NullWriter = field(default_factory=NullWriter)
    """guard.jsonl (rank 0): the spike and NaN guard's decisions."""
    cost: CostMeter | NullCostMeter = field(default_factory=NullCostMeter)
    profiler: StepProfiler | NullProfiler = field(default_factory=NullProfiler)
    """torch.profiler over metrics.profile_steps."""


class Trainer:
    """Runs optimizer steps until ``cfg.steps``, recording each and checkpointing when due.

    Build one with ``meshyard.train.build.build_trainer`` (what every rank of a run does),
    or from parts: a parallelized model, its step runner and the bundles above.
    ``progress`` is shared with the checkpointer, which saves and restores it.
    """

    def __init__(self, parallelized: Parallelized, runner: StepRunner, optimization: Optimization, feed: Feed,
                 cfg: TrainConfig, services: Services, progress: TrainProgress, on_nonfinite: str = "warn",
                 read_ahead: bool | None = None, guard: SpikeGuard | None = None,
                 snapshot_every: int = 10) -> None:
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
        self.sinks, self.meter, self.cost = services.sinks, services.meter, services.cost
        self.checkpoints, self.preemption, self.watchdog = services.checkpointer, services.preemption, \
            services.watchdog
        self.profiler = services.profiler
        self.timer = self.meter.timer
        self.on_nonfinite = on_nonfinite
        self.guard, self.guard_log = guard, services.guard_log
        self._lr_factor = 1.0  # the guard's lowering of the scheduled learning rate, in force now
        self.progress = progress
        self.rollback: RollbackTarget = (
            SnapshotRollback(snapshot_every, self.model, self.optimizer, self.scheduler, self.precision, self.device)
            if snapshot_every > 0 else CheckpointRollback(self.checkpoints, progress))
        self.parameters = [p for p in self.model.parameters() if p.requires_grad]
        self._last_eval_loss: float | None = None
        self._checkpoint_stall: float | None = None
        self._previous_save_wait: float | None = None
        self._staging_wait: float | None = None
        self._staging_warm = False  # async saves' pinned host buffers are allocated (see fit)
        self.collector = RunCollector()  # keeps set-up out of the collector's walks; its time per record
        self._outcomes_seen = 0
        # Whether the next step is issued before the last one's figures are read: where the
        # device runs behind the host (CUDA), so that the host never waits for it. On CPU
        # each step is complete when issued and reading ahead only shifts figures.
        self.read_ahead = self.device.type == "cuda" if read_ahead is None else read_ahead
        self._period_start = 0.0  # when the iteration of the next step to settle began

    def save_checkpoint(self, blocking: bool = False, eval_loss: float | None = None) -> None:
        facts = {"eval_loss": eval_loss, "tokens_seen": self.progress.tokens_seen,
                 "samples_consumed": self.progress.step * self.batch.global_batch}
        self.checkpoints.save(self.progress.step, facts, blocking=blocking)

    def close(self) -> None:
        """Stop the watchdog, close the sinks, the checkpointer and the data (after ``fit``,
        also when it raised)."""
        self.watchdog.stop()
        self.sinks.close()
        self.guard_log.close()
        self.checkpoints.close()
        self.data.close()

    # steps ----------------------------------------------------------------------
    def _start_agreement(self, loss: torch.Tensor) -> "_PendingAgreement":
        """Start the one all-reduce per step that carries the loss and the facts every rank
        must agree on: a preemption signal seen by any rank, rank 0's clock asking for a
        time-based checkpoint, and (a NaN or inf in the sum) whether any rank's loss is not
        finite.

        It is started before the optimizer step and read after it, so it overlaps the
        step instead of adding a blocking collective to it. The flags are built on the
        loss's device without reading the loss, so nothing waits for the backward here;
        the host's entries travel in one non-blocking copy (from pinned memory on a GPU).
        """
        local = loss.detach().to(torch.float64).reshape(1)
        holds_loss = self.runner.holds_loss
        host = torch.tensor([float(holds_loss), float(self.preemption.requested), float(self.checkpoints.time_due())],
                            dtype=torch.float64, pin_memory=self.device.type == "cuda")
        flags = torch.cat([local if holds_loss else torch.zeros_like(local), host.to(self.device, non_blocking=True)])
        work = dist.all_reduce(flags, async_op=True) if dist.get_world_size() > 1 else None
        return _PendingAgreement(local, flags, work)

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

    def issue_step(self, step: int) -> IssuedStep:
        """Issue optimizer step ``step`` over ``grad_accum`` micro-batches: fetch and copy
        its batch, forward and backward, start the agreement, update the weights, and send
        its figures back to the host without waiting for them (``settle_step`` reads them)."""
        self.profiler.step_issued(step)
        self.meter.start_step()
        self.timer.mark("data", step)  # the step this rank is working on
        data_start = time.perf_counter()
        micro_batches = self._next_micro_batches()
        data_time = time.perf_counter() - data_start
        self.timer.add("data", data_time)
        lr = self.scheduler.get_last_lr()[0] * self._lr_factor
        loss = self.runner.forward_backward(micro_batches)
        with self.timer.phase("comm", where="sync"):
            pending = self._start_agreement(loss)
        with self.timer.phase("optimizer"):
            self.precision.scaler.unscale_(self.optimizer)
            # A pipeline runner names the group its stages span and any parameter counted twice.
            grad_norm = clip_grad_norm(self.parameters, self.cfg.grad_clip, self.runner.grad_norm_group,
                                       self.runner.grad_norm_skip)
        if self.on_nonfinite == "stop":
            with self.timer.phase("comm", where="sync"):
                self._stop_if_nonfinite(step, loss, grad_norm, pending)
        verdict = self._judge(step, grad_norm, pending) if self.guard is not None else KEPT
        with self.timer.phase("optimizer"):
            self._apply_update(verdict.keep)
        with self.timer.phase("comm", where="sync"):
            readout, ready = self._send_back(grad_norm, pending)
        scale = self.precision.scaler.get_scale() if self.precision.scaler.is_enabled() else None
        return IssuedStep(step, lr, data_time, readout, ready, self.meter.close_step(), self.runner.step_figures(),
                          self.compression.take_step_stats(), scale, verdict)

    def _apply_update(self, keep: bool = True) -> None:
        """The optimizer step (left out when the guard does not ``keep`` the step: its
        gradients are dropped, while the schedule still moves on with the step count)."""
        waited = self.checkpoints.wait_staged()  # an async save's copy of the weights is taken before they change
        if waited is not None:
            self._staging_wait = waited
        if keep:
            self.precision.scaler.step(self.optimizer)
            if not self._staging_warm:  # the optimizer's state exists once it has stepped
                self._staging_warm = self.checkpoints.warm_staging()
        self.precision.scaler.update()
        self.optimizer.zero_grad(set_to_none=True)
        self.scheduler.step()
        self._follow_schedule()

    def _follow_schedule(self) -> None:
        """Set the optimizer's learning rates to the schedule's, lowered while the guard says so."""
        factor = self.guard.lr_factor() if self.guard is not None else 1.0
        if factor != 1.0 or self._lr_factor != 1.0:
            for group, lr in zip(self.optimizer.param_groups, self.scheduler.get_last_lr()):
                group["lr"] = lr * factor
        self._lr_factor = factor

    def _judge(self, step: int, grad_norm: torch.Tensor, pending: _PendingAgreement) -> Verdict:
        """The guard's verdict on a step, before its update: waits for the agreed loss and
        the gradient norm, which are the same on every rank, so every rank judges alike."""
        assert self.guard is not None
        with self.timer.phase("comm", where="sync"):
            if pending.work is not None:
                pending.work.wait()
            loss_total, loss_weight = pending.flags[:2].tolist()
            norm = grad_norm.item()
        return self.guard.judge(step, loss_total / loss_weight, norm)

    def _send_back(self, grad_norm: torch.Tensor, pending: _PendingAgreement) -> tuple[torch.Tensor, Any]:
        """The step's ``READOUT`` on its way to the host. The agreement was started before
        the update, so it has overlapped it; on a GPU, waiting for it only orders the
        device's stream, and the copy lands in pinned memory behind an event."""
        if pending.work is not None:
            pending.work.wait()
        figures = torch.cat([pending.local_loss, grad_norm.detach().to(torch.float64).reshape(1), pending.flags])
        if figures.device.type != "cuda":
            return figures, None
        readout = figures.to("cpu", non_blocking=True)  # into pinned memory, asynchronously
        ready = torch.cuda.Event()
        ready.record()
        return readout, ready

    def _stop_if_nonfinite(self, step: int, loss: torch.Tensor, grad_norm: torch.Tensor,
                           pending: _PendingAgreement) -> None:
        """``on_nonfinite = 'stop'``: read the agreed loss flag and the gradient norm before
        the update, and stop without applying a non-finite one (waits for the device)."""
        if pending.work is not None:
            pending.work.wait()
        norm = grad_norm.item()
        if not math.isfinite(pending.flags[0].item()) or not math.isfinite(norm):
            self._report_nonfinite(step, loss.item(), norm)

    def settle_step(self, issued: IssuedStep) -> tuple[dict[str, Any], Agreed]:
        """Read an issued step's figures (waiting for it if it still runs), evaluate if due,
        and record it; returns its record and what all ranks agreed on."""
        if issued.ready is not None:
            issued.ready.synchronize()
        read = dict(zip(READOUT, issued.readout.tolist()))
        done = time.perf_counter()
        # The whole iteration since the last step was settled: its own work, the last
        # step's records and console line, and fetching its batch.
        step_time, self._period_start = done - self._period_start, done
        collecting = self.collector.step_settled()
        nonfinite = not math.isfinite(read["loss_total"])
        agreed = Agreed(read["loss_total"] / read["loss_weight"] if not nonfinite else float("nan"),
                        read["preempt"] > 0, read["save_now"] > 0, nonfinite)
        step = issued.step
        self.progress.step = step
        self.progress.tokens_seen += self.tokens_per_step
        if issued.verdict.keep:  # the summary's losses: what training kept
            self.progress.losses.append(agreed.loss)
        record = {
            "step": step, "loss": agreed.loss, "lr": issued.lr, "grad_norm": read["grad_norm"],
            "step_time_s": step_time, "data_time_s": issued.data_time,
            "tokens_per_s": self.tokens_per_step / step_time,
            "samples_per_s": self.batch.global_batch / step_time,
            "tokens_seen": self.progress.tokens_seen, "time": time.time(),
        }
        if collecting > 0:
            record["gc_s"] = collecting
        if issued.loss_scale is not None:
            record["loss_scale"] = issued.loss_scale
        runner_figures, split = issued.runner_figures.read()
        record.update(runner_figures)  # pipeline idle share, gathered per rank below
        # Runners that cannot time forward and backward apart (a pipeline schedule
        # interleaves them) report their step's split instead.
        for phase, seconds in split.items():
            issued.readings.phases.add(phase, seconds)
        record.update(self.meter.finish_step(step_time, self.tokens_per_step, issued.readings, runner_figures))
        record.update(issued.compression_figures)
        record.update(self._cost_figures(step, step_time))
        if nonfinite or not math.isfinite(record["grad_norm"]):
            record["nonfinite"] = self._report_nonfinite(step, read["local_loss"], record["grad_norm"])
        record.update(self._marks(issued, agreed.loss, record["grad_norm"]))
        if self.meter.gather_due(step):
            record.update(self.meter.gather() or {})
        self._last_eval_loss = None
        if self._should_evaluate(step):
            self.timer.mark("eval")
            record["eval_loss"] = self._last_eval_loss = self.evaluate()
            best = self.progress.best_eval_loss
            self.progress.best_eval_loss = record["eval_loss"] if best is None else min(best, record["eval_loss"])
            self._period_start = time.perf_counter()  # evaluation is not the next step's time
        self.checkpoints.poll()
        record.update(self._checkpoint_figures())
        self.sinks.record_step(record, local_loss=read["local_loss"])
        if self.profiler.step_recorded(step):
            self._period_start = time.perf_counter()  # writing the profile is not the next step's time
        return record, agreed

    def _marks(self, issued: IssuedStep, loss: float, grad_norm: float) -> dict[str, Any]:
        """What sets a step's record apart: trained again after a rollback, run under the
        profiler, or not kept by the guard (reported here)."""
        marks: dict[str, Any] = {}
        if issued.verdict.replay:
            marks["replay"] = True
        if self.profiler.covers(issued.step):
            marks["profiled"] = True
        if not issued.verdict.keep:
            marks["guard"] = issued.verdict.reason
            self._report_not_kept(issued.step, issued.verdict, loss, grad_norm)
        return marks

    def _cost_figures(self, step: int, step_time: float) -> dict[str, float]:
        """The step's cost, the run's so far (kept in ``progress``, which checkpoints carry)
        and its projection; nothing without a price."""
        figures = self.cost.step_figures(step, step_time, self.progress.cost_so_far)
        self.progress.cost_so_far = figures.get("cost_so_far_usd", self.progress.cost_so_far)
        return figures

    def _may_issue_ahead(self, step: int) -> bool:
        """Whether step ``step + 1`` may be issued before ``step`` is settled: not when
        anything reads or saves the weights of ``step`` (evaluation, a checkpoint), nor at
        either end of a profile window (its trace holds its steps alone)."""
        return (self.read_ahead and step < self.cfg.steps and not self.checkpoints.due(step)
                and not self._should_evaluate(step) and not self._snapshot_step(step)
                and not self.profiler.starts_after(step) and not self.profiler.ends_at(step))

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

    def _begin_fit(self) -> None:
        self.model.train()
        self._train_iter = iter(self.data.train_loader)
        # Async saves on CUDA stage into pinned host buffers: allocated and pinned here, not
        # inside the step after the first save (the optimizer's part after its first step
        # on a fresh start). Nothing to do elsewhere.
        self._staging_warm = self.checkpoints.warm_staging()
        self.profiler.resumed_at(self.progress.step)

    def fit(self) -> dict[str, Any]:
        """Run until ``cfg.steps`` optimizer steps are done; return the run's summary figures.

        Raises ``Preempted`` after saving when a preemption signal arrived on any rank,
        and ``NonFiniteError`` on a NaN/inf loss or gradient norm with ``on_nonfinite = stop``.
        """
        self._begin_fit()
        self.sinks.display.start(self.progress.step)
        in_flight: IssuedStep | None = None
        preempt = time_save = roll_back = save_waiting = False
        try:
            self.collector.start()  # set-up is done: what it made lives as long as the run
            if self.guard is not None:
                self._take_snapshot(force=True)  # a rollback always has somewhere to go
                self._lr_factor = 0.0  # a resumed run lowered its learning rate: so does this one
                self._follow_schedule()
            start = self._period_start = time.perf_counter()
            while self.progress.step < self.cfg.steps:
                issued = None
                next_step = (in_flight.step if in_flight else self.progress.step) + 1
                if next_step <= self.cfg.steps and not (preempt or time_save) and (
                        in_flight is None or (self._may_issue_ahead(in_flight.step)
                                              and not in_flight.verdict.roll_back)):
                    try:
                        issued = self.issue_step(next_step)
                    except NonFiniteError:
                        if in_flight is not None:
                            self.settle_step(in_flight)  # the step before it is recorded
                        raise
                if in_flight is not None:
                    _, agreed = self.settle_step(in_flight)
                    preempt, time_save = preempt or agreed.preempt, time_save or agreed.save_now
                    roll_back = roll_back or in_flight.verdict.roll_back
                in_flight = issued
                if in_flight is not None:
                    continue
                # Nothing in flight: the weights are those of progress.step.
                if roll_back:
                    # Back at a step whose snapshot or checkpoint exists; the saves that waited
                    # for the bad steps fall due again when their steps are trained again.
                    roll_back = save_waiting = False
                    self._roll_back()
                    continue
                if self._snapshot_step(self.progress.step):
                    self._take_snapshot()
                if preempt:
                    self._stop_for_preemption()
                save_waiting = self._save_if_due(save_waiting or time_save)
                time_save = False
            if self.checkpoints.save_final and self.checkpoints.saved_step != self.progress.step:
                self.timer.mark("checkpoint")
                self.save_checkpoint(blocking=True, eval_loss=self._last_eval_loss)
            self.checkpoints.wait()
        finally:
            self.sinks.display.stop()
            self.collector.stop()
            self.profiler.close()
        return self._summary(time.perf_counter() - start)

    def _save_if_due(self, waiting: bool) -> bool:
        """Save the weights of ``progress.step`` when a save is due or ``waiting``; returns
        whether one still waits. A save due during a run of bad steps waits for the next
        kept step: no checkpoint holds a half-judged stretch."""
        if not (waiting or self.checkpoints.due(self.progress.step)):
            return False
        if self._in_bad_run():
            return True
        self.timer.mark("checkpoint")
        stall_start = time.perf_counter()
        self.checkpoints.wait()  # at most one save in flight: a previous one still writing finishes first
        self._previous_save_wait = time.perf_counter() - stall_start
        self.save_checkpoint(eval_loss=self._last_eval_loss)
        self._period_start = time.perf_counter()
        self._checkpoint_stall = self._period_start - stall_start
        return False

    def _report_nonfinite(self, step: int, local_loss: float, grad_norm: float) -> list[dict[str, Any]]:
        """Name the ranks with a NaN/inf loss (rare path: one object all-gather)."""
        local = [] if math.isfinite(local_loss) else [{"rank": dist.get_rank(), "what": "loss",
                                                        "value": str(local_loss)}]
        gathered: list[list[dict[str, Any]]] = [[] for _ in range(dist.get_world_size())]
        dist.all_gather_object(gathered, local)
        found = [entry for entries in gathered for entry in entries]
        if not math.isfinite(grad_norm):
            found.append({"rank": "all", "what": "gradient norm", "value": str(grad_norm)})
        where = "; ".join(f"{e['what']} {e['value']} on rank {e['rank']}" for e in found)
        self.sinks.warn(f"non-finite values at step {step}: {where}")
        if self.on_nonfinite == "stop":
            raise NonFiniteError(f"non-finite values at step {step}: {where}; stopping before its update "
                                 "(fault.on_nonfinite = 'stop'). Lower optim.lr, check the data, or use fp32.")
        return found

    # the spike and NaN guard ------------------------------------------------------------
    def _snapshot_step(self, step: int) -> bool:
        return self.guard is not None and self.rollback.due(step)

    def _in_bad_run(self) -> bool:
        return self.guard is not None and self.guard.in_a_row > 0

    def _take_snapshot(self, force: bool = False) -> None:
        """Copy the state of ``progress.step`` to the host, unless a run of bad steps is
        under way (its rollback must go back beyond them)."""
        if self.guard is None or (self._in_bad_run() and not force):
            return
        self.rollback.take(self.progress.step, self.progress.tokens_seen)

    def _roll_back(self) -> None:
        """Restore the newest snapshot or checkpoint from before the bad steps that asked
        for it and skip their samples (raises ``GuardStop`` past ``guard.max_rollbacks``,
        or when there is nothing to return to)."""
        assert self.guard is not None
        self.profiler.rolled_back()  # the steps trained again are not profiled
        from_step, sampler = self.progress.step, self.data.sampler
        first_bad = from_step - self.guard.in_a_row + 1
        stream_steps = [sampler.stream_step(step) for step in range(first_bad, from_step + 1)]
        to_step = self.rollback.newest(first_bad - 1)
        self.guard.start_rollback(from_step, to_step, self.rollback.kind)
        self.progress.step, self.progress.tokens_seen = self.rollback.restore()
        sampler.skip(stream_steps)  # added to the live list, which holds every earlier skip
        self.data.seek(self.progress.step)
        self._train_iter = iter(self.data.train_loader)
        self._lr_factor = 0.0  # forces the rates back to the restored schedule's
        self._follow_schedule()
        skipped = sorted(index for stream_step in stream_steps for index in sampler.global_indices(stream_step))
        self.guard_log.write({"event": "rollback", "step": from_step, "to_step": self.progress.step,
                              "to": self.rollback.kind, "rollback": self.guard.rollbacks,
                              "skipped_stream_steps": stream_steps, "skipped_samples": skipped,
                              "lr_factor": self._lr_factor, "lr_steps": self.guard.lr_steps_left,
                              "time": time.time()})
        self.sinks.warn(f"guard: rolled back from step {from_step} to the {self.rollback.kind} of step "
                        f"{self.progress.step} (rollback {self.guard.rollbacks}); skipping the {len(skipped)} "
                        f"samples of stream steps {stream_steps}")
        self._period_start = time.perf_counter()

    def _report_not_kept(self, step: int, verdict: Verdict, loss: float, grad_norm: float) -> None:
        sampler = self.data.sampler
        stream_step = sampler.stream_step(step)
        self.guard_log.write({"event": "not kept", "step": step, "reason": verdict.reason, "loss": loss,
                              "grad_norm": grad_norm, "threshold": verdict.threshold, "in_a_row": verdict.in_a_row,
                              "stream_step": stream_step, "samples": sorted(sampler.global_indices(stream_step)),
                              "time": time.time()})
        threshold = f", threshold {verdict.threshold:.4g}" if verdict.threshold is not None else ""
        self.sinks.warn(f"guard: step {step} not kept ({verdict.reason}: loss {loss:.4g}{threshold}, gradient norm "
                        f"{grad_norm:.4g}); {verdict.in_a_row} bad in a row")

    def _checkpoint_figures(self) -> dict[str, Any]:
        """How long the last save held up training, and saves that finished since the last
        step: their total time (in the background for async saves) or their error."""
        figures: dict[str, Any] = {}
        if self._checkpoint_stall is not None:
            figures["checkpoint_stall_s"], self._checkpoint_stall = self._checkpoint_stall, None
        if self._previous_save_wait is not None:
            figures["checkpoint_previous_wait_s"], self._previous_save_wait = self._previous_save_wait, None
        if self._staging_wait is not None:
            figures["checkpoint_staging_wait_s"], self._staging_wait = self._staging_wait, None
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

    def _should_evaluate(self, step: int) -> bool:
        if not self.cfg.eval_every or self.data.val_dataset is None:
            return False
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
