"""Forward and backward of one optimizer step through a pipeline schedule.

Batch arithmetic: each of the step's ``grad_accum`` micro-batches (``train.micro_batch``
samples, exactly as without pipelining) runs through one pass of the schedule, which
cuts it into ``parallel.microbatches`` pipeline micro-batches. Gradients of the passes
add up, and every micro-batch's loss is scaled by ``1 / (microbatches x grad_accum)``,
so the gradient is that of the mean loss over the whole per-rank batch: the same model
as without pipelining, whatever the split.

Only the last stage sees the loss (``holds_loss``); the Trainer averages the loss over
those ranks. Each step also measures, per rank, the time its stages spent computing
(forward and backward chunks) against the wall time of the schedule: the rest is the
pipeline bubble plus communication waits, reported beside the schedule's theoretical
bubble ``(p - 1) / (v m + p - 1)`` (``v`` stages per rank when interleaved).
Stage time is wall-clock on CPU and CUDA events on GPU, where a chunk's kernels are
still running when its Python call returns.

fp16: the loss of each micro-batch is multiplied by the gradient scaler's factor inside
the schedule's loss function, so the backward the schedule runs from it produces scaled
gradients on every stage, which the Trainer unscales before clipping. The scaler's
inf/NaN finding is all-reduced over all ranks (``ShardedGradScaler``), so a stage that
overflows makes every stage skip the step and lower the scale alike.
"""

from __future__ import annotations

import logging
import time
from typing import Any, Callable

import torch
import torch.distributed as dist
from torch.distributed.pipelining import (Schedule1F1B, ScheduleGPipe, ScheduleInterleaved1F1B,
                                          ScheduleInterleavedZeroBubble)
from torch.distributed.pipelining.stage import _PipelineStageBase

from meshyard.parallel.compile import Compilation, compiled_graphs
from meshyard.parallel.pipeline import PipelinedModel, sync_tied_grads
from meshyard.train.loss import next_token_loss
from meshyard.train.precision import Precision
from meshyard.train.step import Batch, RunnerFigures

SCHEDULES: dict[str, type] = {
    "gpipe": ScheduleGPipe,
    "1f1b": Schedule1F1B,
    "interleaved1f1b": ScheduleInterleaved1F1B,
    "zerobubble": ScheduleInterleavedZeroBubble,
}


SUMMARY_EVERY = 25


def theoretical_bubble(pp: int, microbatches: int, virtual_stages: int = 1) -> float:
    """Idle share of a rank in a synchronous schedule: (p - 1) / (v m + p - 1)."""
    return (pp - 1) / (virtual_stages * microbatches + pp - 1)


class StageClock:
    """Adds up the time a stage spends in its forward and backward chunks.

    On CPU a chunk's time is the wall-clock time of its call. On GPU the call only
    queues kernels, so each chunk is bracketed by CUDA events on the compute stream
    instead; they are read with the step's figures, once its last one has completed.
    """

    def __init__(self, cuda: bool) -> None:
        self.cuda = cuda
        self.seconds = 0.0
        self._pending: list[tuple[Any, Any]] = []

    @classmethod
    def for_device(cls, device: torch.device) -> "StageClock":
        """CUDA events for stages on a GPU, wall-clock time otherwise."""
        return cls(device.type == "cuda")

    def wrap(self, stage: _PipelineStageBase) -> None:
        for name in ("forward_one_chunk", "backward_one_chunk", "backward_weight_one_chunk"):
            setattr(stage, name, self._timed(getattr(stage, name)))

    def now(self) -> Any:
        """A point in time: ``perf_counter`` seconds on CPU, a recorded CUDA event on GPU."""
        if not self.cuda:
            return time.perf_counter()
        event = torch.cuda.Event(enable_timing=True)
        event.record()
        return event

    def elapsed(self, start: Any, end: Any) -> float:
        """Seconds from ``start`` to ``end`` (both from ``now``); on GPU waits for ``end``."""
        if not self.cuda:
            return end - start
        end.synchronize()  # elapsed_time needs both events to have completed
        return start.elapsed_time(end) / 1000.0

    def take(self) -> tuple[float, list[tuple[Any, Any]]]:
        """The chunk seconds added up since the last take, and (on GPU) the event pairs of
        the chunks, still to be read with ``elapsed``; the clock starts again from zero."""
        seconds, pending = self.seconds, self._pending
        self.seconds, self._pending = 0.0, []
        return seconds, pending

    def _timed(self, method: Callable[..., Any]) -> Callable[..., Any]:
        def run(*args: Any, **kwargs: Any) -> Any:
            start = self.now()
            try:
                return method(*args, **kwargs)
            finally:
                end = self.now()
                if self.cuda:
                    self._pending.append((start, end))  # read once per step, not per chunk
                else:
                    self.seconds += end - start
        return run


class PipelineStep:
    """Step runner for pipelined models (``meshyard.train.step.StepRunner``)."""

    def __init__(self, model: PipelinedModel, pp_group: dist.ProcessGroup, schedule: str, microbatches: int,
                 precision: Precision, device: torch.device, tied_group: dist.ProcessGroup | None = None,
                 compilation: Compilation | None = None) -> None:
        self.model = model
        # Blocks compiled per stage. A stage cannot fall back to eager alone (the others are
        # in the schedule with it), so a compile failure stops the run whatever train.compile says.
        self.compilation = compilation or Compilation()
        self.precision = precision
        self.device = device
        self.microbatches = microbatches
        self.pp_group = pp_group
        self.pp = dist.get_world_size(pp_group)
        self.virtual_stages = len(model.stages)
        self.holds_loss = model.has_last
        self.tied_group = tied_group
        self.clock = StageClock.for_device(device)
        stages = []
        for index, module in model.stages:
            stage = model.pipeline_stage(index, module, device, pp_group)
            self.clock.wrap(stage)
            stages.append(stage)
        self._loss_factor: torch.Tensor | float = 1.0
        cls = SCHEDULES[schedule]
        # Gradients are scaled in the loss (not by the schedule) so that several passes
        # per optimizer step accumulate correctly.
        if cls in (ScheduleGPipe, Schedule1F1B):
            self.schedule = cls(stages[0], microbatches, loss_fn=self._loss, scale_grads=False)
        else:
            self.schedule = cls(stages, microbatches, loss_fn=self._loss, scale_grads=False)
        self._figures = RunnerFigures()
        self._steps, self._total_compute, self._total_wall = 0, 0.0, 0.0

    @property
    def grad_norm_group(self) -> dist.ProcessGroup:
        """Gradient norms are summed over the pipeline stages before clipping."""
        return self.pp_group

    @property
    def grad_norm_skip(self) -> list[torch.nn.Parameter]:
        """Parameters counted on another stage (the tied head's copy)."""
        return self.model.norm_duplicates()

    def _loss(self, logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        """The schedule's loss function; backward starts from its result."""
        return next_token_loss(logits, targets) * self._loss_factor

    def _run(self, inputs: torch.Tensor, targets: torch.Tensor, train: bool) -> torch.Tensor:
        """One pass of the schedule; returns the mean unscaled loss (0 off the last stage)."""
        # The schedule's own list, not values seen by ``_loss``: on its first pass the
        # schedule also calls the loss function on placeholder outputs to infer shapes.
        losses: list[torch.Tensor] = []
        # Contiguous: a batch sliced from longer windows (inputs = window[:, :-1]) has another
        # stride than the one the schedule's shape check expects (torch 2.10-2.11 refuse it).
        args = (inputs.contiguous(),) if self.model.has_first else ()
        target = targets.contiguous() if self.holds_loss else None
        with self.precision.autocast():
            if train:
                self.schedule.step(*args, target=target, losses=losses, return_outputs=False)
            else:
                self.schedule.eval(*args, target=target, losses=losses)
        if not losses:
            return torch.zeros((), device=self.device)
        return torch.stack([loss.detach().float() for loss in losses]).sum() / (self._loss_factor * len(losses))

    def forward_backward(self, micro_batches: list[Batch]) -> torch.Tensor:
        accum = len(micro_batches)
        # Each micro-batch's share of the mean loss, times the fp16 loss scale (1 when the
        # scaler is off). Scaling a one on every rank also creates the scale on stages
        # without the loss, which the Trainer's unscale_ needs there too.
        scale = self.precision.scaler.scale(torch.ones((), device=self.device))
        self._loss_factor = scale / (self.microbatches * accum)
        self.clock.take()  # chunks of evaluations since the last step are not this step's
        start = self.clock.now()
        loss_sum = torch.zeros((), device=self.device)
        for inputs, targets in micro_batches:
            loss_sum += self._run(inputs, targets, train=True)
        sync_tied_grads(self.model, self.tied_group)
        self._figures = _PipelineFigures(self, start, self.clock.now(), *self.clock.take())
        return loss_sum / accum

    def figures_of(self, compute: float, wall: float) -> tuple[dict[str, float], dict[str, float]]:
        """A step's record figures and phase split from its measured compute and wall time.
        The schedule interleaves forward and backward, so compute is split 1:2 (their FLOP
        ratio); time the stage spent waiting for its neighbours (the bubble and transfers)
        counts as exposed communication."""
        stats = {
            "pp_compute_s": compute, "pp_wall_s": wall,
            "pp_idle_fraction": max(0.0, 1.0 - compute / wall) if wall > 0 else 0.0,
            "pp_bubble_theory": theoretical_bubble(self.pp, self.microbatches, self.virtual_stages),
        }
        if self.compilation.enabled:
            stats["compiled_graphs"] = compiled_graphs()
        self._log_summary(compute, wall, stats["pp_bubble_theory"])
        return stats, {"forward": compute / 3, "backward": 2 * compute / 3, "comm": max(0.0, wall - compute)}

    def _log_summary(self, compute: float, wall: float, bubble_theory: float) -> None:
        """Every ``SUMMARY_EVERY`` steps, this rank's idle share so far (first step, which
        also infers shapes, left out) goes to its log beside the theoretical bubble."""
        self._steps += 1
        if self._steps > 1:
            self._total_compute += compute
            self._total_wall += wall
        if self._steps % SUMMARY_EVERY == 0 and self._total_wall > 0:
            logging.getLogger(f"meshyard.rank{dist.get_rank()}").info(
                "pipeline: stages %s, %s x %d micro-batches: idle %.1f%% of step time measured, %.1f%% theoretical "
                "bubble", [index for index, _ in self.model.stages], type(self.schedule).__name__, self.microbatches,
                100 * (1 - self._total_compute / self._total_wall), 100 * bubble_theory)

    @torch.no_grad()
    def eval_loss(self, inputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        self._loss_factor = 1.0
        return self._run(inputs, targets, train=False)

    def step_figures(self) -> RunnerFigures:
        """This rank's pipeline figures of the last step (measured idle share vs theory) and
        its phase split; on GPU read from CUDA events when the step has completed."""
        figures, self._figures = self._figures, RunnerFigures()
        return figures


class _PipelineFigures(RunnerFigures):
    """A pipeline step's figures: its wall time (``start`` to ``end``) and the chunks'
    compute time, read (on GPU from CUDA events, waiting for the last) when asked."""

    def __init__(self, runner: PipelineStep, start: Any, end: Any, seconds: float,
                 pending: list[tuple[Any, Any]]) -> None:
        super().__init__()
        self._runner, self._start, self._end, self._seconds, self._pending = runner, start, end, seconds, pending
        self._read: tuple[dict[str, float], dict[str, float]] | None = None

    def read(self) -> tuple[dict[str, float], dict[str, float]]:
        if self._read is None:
            clock = self._runner.clock
            wall = clock.elapsed(self._start, self._end)
            compute = self._seconds + sum(clock.elapsed(begin, end) for begin, end in self._pending)
            self._read = self._runner.figures_of(compute, wall)
        return self._read
