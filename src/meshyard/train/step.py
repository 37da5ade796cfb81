"""Forward and backward of one optimizer step, for layouts without pipelining.

The Trainer hands each step's micro-batches to a step runner and gets back the mean
loss. Runners differ by how the model is executed (here: one micro-batch after another
on the whole model; a pipeline runner drives a schedule instead); everything around
them (clipping, optimizer, schedule, records, checkpoints) is the Trainer's.
"""

from __future__ import annotations

import contextlib
from typing import Callable, Protocol

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor.parallel import loss_parallel as loss_parallel_context

from meshyard.config.load import ConfigError
from meshyard.fault.failure import first_line
from meshyard.metrics.timing import NullStepTimer, StepTimer
from meshyard.models.linear_cross_entropy import fused_loss_refusal
from meshyard.models.local_part import local_part
from meshyard.models.outputs import logits_of
from meshyard.parallel.compile import Compilation, compile_errors, compiled_graphs
from meshyard.parallel.context_parallel import SequenceSplit
from meshyard.parallel.data_parallel import set_gradient_sync, unwrap
from meshyard.train.expert_load import ExpertLoad, StepLoad
from meshyard.train.loss import next_token_loss, split_sequence_mean
from meshyard.train.precision import Precision

Batch = tuple[torch.Tensor, torch.Tensor]


class CompileFailed(RuntimeError):
    """``train.compile = true`` and the model does not compile."""


class StepRunner(Protocol):
    """What the Trainer asks of a step runner; every runner answers all of it."""

    model: nn.Module
    """The module it runs (the Trainer switches it between train and eval mode)."""
    device: torch.device
    holds_loss: bool
    """Whether this rank computes the loss (under pipelining only the last stage does)."""
    grad_norm_group: dist.ProcessGroup | None
    """The group whose ranks hold other parts of the model's gradients beyond sharding
    (pipeline stages): their squared norms are summed before clipping. None otherwise."""
    grad_norm_skip: list[nn.Parameter]
    """Parameters whose gradient another rank already counts in the norm (a tied weight's
    second copy on another pipeline stage)."""
    compilation: Compilation
    """What runs compiled (empty when nothing does)."""

    def forward_backward(self, micro_batches: list[Batch]) -> torch.Tensor:
        """Accumulate gradients of the mean loss over ``micro_batches``; return that loss."""
        ...

    def eval_loss(self, inputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        """Loss of one batch without gradients."""
        ...

    def step_figures(self) -> "RunnerFigures":
        """What the runner measured of the step just issued, to read once it completed."""
        ...


class RunnerFigures:
    """A runner's figures of one step: read when the step has completed (on a GPU its
    timings are CUDA events until then), so that taking them costs the issuing host no wait."""

    def __init__(self, stats: dict[str, float] | None = None, split: dict[str, float] | None = None,
                 load: StepLoad | None = None) -> None:
        self._stats, self._split, self._load = stats or {}, split or {}, load

    def read(self) -> tuple[dict[str, float], dict[str, float]]:
        """(figures for the step's record, e.g. a pipeline stage's idle share or a MoE
        model's expert load; seconds per breakdown phase for runners whose forward and
        backward cannot be timed apart, as a schedule interleaves them, or {} when the
        runner timed its phases itself)."""
        if self._load is not None:
            self._stats, self._load = {**self._stats, **self._load.figures()}, None
        return self._stats, self._split


class MicroBatchStep:
    """Runs the micro-batches one after another through the whole (possibly sharded) model."""

    holds_loss = True
    grad_norm_group = None

    def __init__(self, model: nn.Module, precision: Precision, device: torch.device,
                 timer: StepTimer | NullStepTimer | None = None, loss_parallel: bool = False,
                 compilation: Compilation | None = None, compile_whole: bool = False,
                 report: Callable[[str], None] | None = None, sequence: SequenceSplit | None = None,
                 fused_loss: bool = False) -> None:
        self.model = model
        # train.fused_linear_loss: the model's forward takes the targets and returns the loss.
        refusal = fused_loss_refusal(unwrap(model)) if fused_loss else None
        if refusal is not None:  # validate refuses it first wherever the builder runs on the meta device
            raise ConfigError([refusal])
        self.fused_loss = fused_loss
        self.precision = precision
        self.device = device
        self.timer = timer or NullStepTimer()
        # Under tensor parallelism the head may return vocabulary-split logits; the loss
        # (and its backward) then run under loss_parallel(), which reduces across ranks.
        self.loss_context = loss_parallel_context if loss_parallel else contextlib.nullcontext
        self.grad_norm_skip: list[nn.Parameter] = []
        # Under context parallelism each rank runs its share of every sequence.
        self.sequence = sequence
        # What was compiled (blocks by parallelize, or here the model and its loss as one
        # region); the first step learns whether it compiles at all.
        self.compilation = compilation or Compilation()
        self._forward_loss = self._eager_forward_loss
        if compile_whole:
            self._forward_loss = self.compilation.compile_function(self._eager_forward_loss, "the model and its loss")
        self._report = report or (lambda message: None)
        self._compile_checked = not self.compilation.enabled
        # A mixture-of-experts model trains on its router losses too (none for a dense one).
        self.expert_load = ExpertLoad(unwrap(model))

    def _eager_forward_loss(self, inputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        split = self.sequence
        if split is None:
            return self._mean_loss(inputs, targets)
        inputs, targets = split.local(inputs), split.local(targets)
        return split_sequence_mean(self._mean_loss(inputs, targets), targets, split.ring.group, split.size)

    def _mean_loss(self, inputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        """The mean loss of this rank's tokens: from the model's logits, or by the model itself
        from its hidden states (``train.fused_linear_loss``)."""
        if self.fused_loss:
            return self.model(inputs, targets=targets)
        return next_token_loss(logits_of(self.model(inputs)), targets)

    def forward_backward(self, micro_batches: list[Batch]) -> torch.Tensor:
        if self._compile_checked:
            return self._forward_backward(micro_batches)
        self._compile_checked = True
        try:
            return self._forward_backward(micro_batches)
        except compile_errors() as exc:
            self._fall_back_to_eager(exc)
            return self._forward_backward(micro_batches)

    def _fall_back_to_eager(self, exc: BaseException) -> None:
        """A model that does not compile: with ``train.compile = true`` the run stops with
        one paragraph; with 'auto' it trains eagerly after one warning line."""
        what = self.compilation.describe()
        reason = first_line(str(exc))
        if self.compilation.requested is True:
            raise CompileFailed(
                f"train.compile = true, but torch.compile could not compile {what}: {reason}. Set "
                "train.compile = false to train this model eagerly (or 'auto', which falls back to eager "
                "with a warning); the full error is in this rank's log") from exc
        self.compilation.revert()
        self.model.zero_grad(set_to_none=True)  # whatever the failed attempt accumulated
        self._report(f"train.compile: {what} could not be compiled ({reason}); training eagerly")

    def _forward_backward(self, micro_batches: list[Batch]) -> torch.Tensor:
        accum = len(micro_batches)
        loss_sum = torch.zeros((), device=self.device)
        for index, (inputs, targets) in enumerate(micro_batches):
            # Gradients are synchronised only on the last micro-step: the others just
            # accumulate locally, which is what makes accumulation cheap.
            set_gradient_sync(self.model, index == accum - 1)
            if self.compilation.graphs:
                # A new step of the graphs: the last step's outputs (its loss, its gradients,
                # which the optimizer has consumed) may be overwritten by this replay.
                torch.compiler.cudagraph_mark_step_begin()
            with self.timer.phase("forward"), self.precision.autocast(), self.loss_context():
                loss = self._forward_loss(inputs, targets)
                training_loss = self.expert_load.training_loss(loss)
            with self.timer.backward(), self.loss_context():
                self.precision.scaler.scale(training_loss / accum).backward()
            loss_sum += local_part(loss.detach())  # a replicated DTensor under loss parallelism
        return loss_sum / accum

    def eval_loss(self, inputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        # Eager: evaluation runs without gradients, which a compiled region would compile anew.
        with self.precision.autocast(), self.loss_context():
            return local_part(self._eager_forward_loss(inputs, targets))

    def step_figures(self) -> RunnerFigures:
        # Forward and backward were timed as they ran: no split of their own.
        return RunnerFigures({"compiled_graphs": compiled_graphs()} if self.compilation.enabled else {},
                             load=self.expert_load.take_step() if self.expert_load.active else None)
