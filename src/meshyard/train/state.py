"""The training loop's own resumable state, as ``Stateful`` parts for the checkpointer.

Each part is identical on every rank and travels as JSON in ``trainer_state.json``
(written by rank 0) under its name: ``progress`` (counters), ``scheduler``, ``scaler``
and ``data`` (the position in the sample stream). Model, optimizer, RNG and per-rank
compression state are tensors and go through DCP (``checkpoint/state.py``).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from meshyard.data.loader import DataBundle
from meshyard.runtime.batch_plan import BatchPlan


@dataclass
class TrainProgress:
    """Counters a resume needs besides model and optimizer state."""

    step: int = 0
    tokens_seen: int = 0
    best_eval_loss: float | None = None
    losses: list[float] = field(default_factory=list)
    cost_so_far: float = 0.0
    """US dollars the recorded steps cost (with a price), so a resumed run's total goes on."""

    def state_dict(self) -> dict[str, Any]:
        return {"step": self.step, "tokens_seen": self.tokens_seen, "best_eval_loss": self.best_eval_loss,
                "cost_so_far": self.cost_so_far}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.step, self.tokens_seen = int(state["step"]), int(state["tokens_seen"])
        self.best_eval_loss = state.get("best_eval_loss")
        self.cost_so_far = float(state.get("cost_so_far", 0.0))  # checkpoints written before costs had none


class SchedulerState:
    """The LR schedule; on load the optimizer's learning rates follow it, for optimizers
    whose state was loaded without hyperparameters (ZeRO-1)."""

    def __init__(self, scheduler: torch.optim.lr_scheduler.LRScheduler, optimizer: torch.optim.Optimizer) -> None:
        self.scheduler = scheduler
        self.optimizer = optimizer

    def state_dict(self) -> dict[str, Any]:
        return self.scheduler.state_dict()

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.scheduler.load_state_dict(state)
        for group, lr in zip(self.optimizer.param_groups, self.scheduler.get_last_lr()):
            group["lr"] = lr


class ScalerState:
    """The fp16 loss scaler; an inert scaler saves an empty state, which loads as nothing."""

    def __init__(self, scaler: torch.amp.GradScaler) -> None:
        self.scaler = scaler

    def state_dict(self) -> dict[str, Any]:
        return self.scaler.state_dict()

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if state:
            self.scaler.load_state_dict(state)


class DataPosition:
    """Where the sample stream stands. It is indexed by global step, so the position is
    valid for any world size: no sample is skipped or repeated after a resume on
    another layout, as long as the global batch and what decides the order of samples
    (``GlobalBatchSampler.order_description``) are the same. The stretches of the stream
    the spike and NaN guard skipped travel with it, so a resumed run skips them too."""

    def __init__(self, data: DataBundle, batch: BatchPlan, progress: TrainProgress) -> None:
        self.data = data
        self.batch = batch
        self.progress = progress

    def state_dict(self) -> dict[str, Any]:
        step = self.progress.step
        sampler = self.data.sampler
        return {"step": step, "global_batch": self.batch.global_batch,
                "samples_consumed": sampler.stream_step(step + 1) * self.batch.global_batch,
                "skipped_steps": [list(stretch) for stretch in sampler.skipped],
                "order": sampler.order_description}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        saved_batch = state["global_batch"]
        if saved_batch != self.batch.global_batch:
            raise ValueError(
                f"the checkpoint was trained with train.global_batch = {saved_batch}, this run uses "
                f"{self.batch.global_batch}; keep the global batch when resuming (the world size and "
                "micro-batch may change)"
            )
        # Checkpoints written before the order was recorded shuffled over all samples.
        saved_order, order = state.get("order", "shuffled over all samples"), self.data.sampler.order_description
        if saved_order != order:
            raise ValueError(
                f"the checkpoint's samples came in another order ({saved_order}) than this run's ({order}): resumed, "
                "some samples would be trained on twice and others never. Resume with the data settings that "
                "wrote it (for token shards, data.shuffle_span_shards and data.shuffle_lanes; 0 span shards is "
                "the shuffle over all samples), or start a new run"
            )
        self.data.sampler.skipped = [(int(first), int(end)) for first, end in state.get("skipped_steps", [])]
        self.data.seek(state["step"])
