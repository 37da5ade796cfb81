"""The training loop: accumulation, precision, clipping, schedule, evaluation, records.

It receives ready objects (a parallelized model, an optimizer, loaders, sinks) and never
branches on the parallel strategy; the few places where layouts differ (gradient sync
on accumulation steps, norms of sharded gradients) are functions of the model itself.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.tensor import DTensor

from meshyard.config.sections import TrainConfig
from meshyard.data.loader import DataBundle
from meshyard.parallel.data_parallel import set_gradient_sync
from meshyard.train.batching import BatchPlan
from meshyard.train.precision import Precision


def clip_grad_norm(parameters: list[nn.Parameter], max_norm: float) -> torch.Tensor:
    """Global L2 norm of all gradients (clipped to ``max_norm`` when it is > 0).

    Sharded (DTensor) gradients give a partial norm per rank; ``full_tensor`` reduces it
    so every rank clips by the norm of the whole model, not of its shard.
    """
    grads = [p.grad for p in parameters if p.grad is not None]
    total = torch.nn.utils.get_total_norm(grads)
    if isinstance(total, DTensor):
        total = total.full_tensor()
    if max_norm > 0:
        torch.nn.utils.clip_grads_with_norm_(parameters, max_norm, total)
    return total


def next_token_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Mean cross-entropy over all positions, computed in fp32 whatever the compute dtype."""
    return F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), targets.reshape(-1))


@dataclass
class TrainProgress:
    """Counters a resume needs besides model and optimizer state."""

    step: int = 0
    tokens_seen: int = 0
    losses: list[float] = field(default_factory=list)


class Trainer:
    def __init__(
        self,
        model: nn.Module,
        optimizer: torch.optim.Optimizer,
        scheduler: torch.optim.lr_scheduler.LRScheduler,
        precision: Precision,
        data: DataBundle,
        batch: BatchPlan,
        cfg: TrainConfig,
        device: torch.device,
        dp_group: dist.ProcessGroup,
        dp_rank: int,
        seq_len: int,
        sinks: "Sinks",
    ) -> None:
        self.model = model
        self.optimizer = optimizer
        self.scheduler = scheduler
        self.precision = precision
        self.data = data
        self.batch = batch
        self.cfg = cfg
        self.device = device
        self.dp_group = dp_group
        self.dp_rank = dp_rank
        self.tokens_per_step = batch.global_batch * seq_len
        self.sinks = sinks
        self.progress = TrainProgress()
        self.parameters = [p for p in model.parameters() if p.requires_grad]
        self._train_iter = iter(data.train_loader)

    def _mean_over_dp(self, value: torch.Tensor) -> float:
        """Average of a per-rank scalar over the data-parallel ranks (gloo has no AVG)."""
        value = value.detach().reshape(1).to(torch.float64)
        dist.all_reduce(value, group=self.dp_group)
        return value.item() / dist.get_world_size(self.dp_group)

    def _next_micro_batches(self) -> list[tuple[torch.Tensor, torch.Tensor]]:
        out = []
        for _ in range(self.batch.grad_accum):
            x, y = next(self._train_iter)
            out.append((x.to(self.device, non_blocking=True), y.to(self.device, non_blocking=True)))
        return out

    def train_step(self, micro_batches: list[tuple[torch.Tensor, torch.Tensor]]) -> tuple[torch.Tensor, torch.Tensor]:
        """One optimizer step over ``grad_accum`` micro-batches; returns (mean loss, grad norm)."""
        accum = len(micro_batches)
        loss_sum = torch.zeros((), device=self.device)
        for index, (inputs, targets) in enumerate(micro_batches):
            # Gradients are synchronised only on the last micro-step: the others just
            # accumulate locally, which is what makes accumulation cheap.
            set_gradient_sync(self.model, index == accum - 1)
            with self.precision.autocast():
                loss = next_token_loss(self.model(inputs), targets)
            self.precision.scaler.scale(loss / accum).backward()
            loss_sum += loss.detach()
        self.precision.scaler.unscale_(self.optimizer)
        grad_norm = clip_grad_norm(self.parameters, self.cfg.grad_clip)
        self.precision.scaler.step(self.optimizer)
        self.precision.scaler.update()
        self.optimizer.zero_grad(set_to_none=True)
        self.scheduler.step()
        return loss_sum / accum, grad_norm

    @torch.no_grad()
    def evaluate(self) -> float:
        self.model.eval()
        total = torch.zeros((), device=self.device)
        count = 0
        for inputs, targets in self.data.eval_batches(self.batch.micro_batch, self.cfg.eval_batches,
                                                      self.dp_rank, self.batch.dp_size):
            with self.precision.autocast():
                total += next_token_loss(self.model(inputs.to(self.device)), targets.to(self.device))
            count += 1
        self.model.train()
        return self._mean_over_dp(total / max(count, 1))

    def fit(self) -> dict[str, Any]:
        """Run until ``cfg.steps`` optimizer steps are done; return the run's summary figures."""
        self.model.train()
        start = time.perf_counter()
        self.sinks.display.start(self.progress.step)
        best_eval = math.inf
        try:
            while self.progress.step < self.cfg.steps:
                step_start = time.perf_counter()
                micro_batches = self._next_micro_batches()
                data_time = time.perf_counter() - step_start
                lr = self.scheduler.get_last_lr()[0]
                loss, grad_norm = self.train_step(micro_batches)
                loss_value = self._mean_over_dp(loss)  # also waits for the step to finish
                step_time = time.perf_counter() - step_start
                self.progress.step += 1
                self.progress.tokens_seen += self.tokens_per_step
                self.progress.losses.append(loss_value)
                record = {
                    "step": self.progress.step, "loss": loss_value, "lr": lr, "grad_norm": grad_norm.item(),
                    "step_time_s": step_time, "data_time_s": data_time,
                    "tokens_per_s": self.tokens_per_step / step_time,
                    "samples_per_s": self.batch.global_batch / step_time,
                    "tokens_seen": self.progress.tokens_seen,
                }
                if self._should_evaluate():
                    record["eval_loss"] = self.evaluate()
                    best_eval = min(best_eval, record["eval_loss"])
                self.sinks.record_step(record, local_loss=loss.item())
        finally:
            self.sinks.display.stop()
        return self._summary(time.perf_counter() - start, best_eval)

    def _should_evaluate(self) -> bool:
        if not self.cfg.eval_every or self.data.val_dataset is None:
            return False
        step = self.progress.step
        return step % self.cfg.eval_every == 0 or step == self.cfg.steps

    def _summary(self, wall_time: float, best_eval: float) -> dict[str, Any]:
        losses = self.progress.losses
        steady = self.sinks.step_times[1:] or self.sinks.step_times
        mean_step = sum(steady) / len(steady) if steady else float("nan")
        return {
            "steps": self.progress.step,
            "first_loss": losses[0] if losses else float("nan"),
            "final_loss": losses[-1] if losses else float("nan"),
            "best_eval_loss": best_eval if best_eval < math.inf else None,
            "mean_step_time_s": mean_step,
            "tokens_per_s": self.tokens_per_step / mean_step if steady else None,
            "tokens_seen": self.progress.tokens_seen,
            "wall_time_s": wall_time,
        }


class Sinks:
    """Where step records go: the display, metrics.jsonl and the per-rank log."""

    def __init__(self, display: Any, writer: Any, logger: Any) -> None:
        self.display = display
        self.writer = writer
        self.logger = logger
        self.step_times: list[float] = []

    def record_step(self, record: dict[str, Any], local_loss: float) -> None:
        self.step_times.append(record["step_time_s"])
        self.writer.write(record)
        self.display.update(record)
        self.logger.info(
            "step %d local_loss %.6f step_time %.4fs data_time %.4fs",
            record["step"], local_loss, record["step_time_s"], record["data_time_s"],
        )
