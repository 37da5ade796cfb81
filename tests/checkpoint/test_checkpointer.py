"""The checkpointer's side of async saves: tensors kept from one save to the next, and the
warm-up of pinned staging buffers, against a manager that only records what it is given."""

from __future__ import annotations

from typing import Any

import torch

from meshyard.checkpoint.checkpointer import Checkpointer, TrainingState
from meshyard.checkpoint.state import restore_rng, rng_key
from meshyard.config.sections import CheckpointConfig


class RecordingManager:
    """What the checkpointer hands a manager, kept for inspection."""

    enabled = True

    def __init__(self, pins: bool) -> None:
        self.stages_to_pinned_memory = pins
        self.saved: list[dict[str, Any]] = []
        self.warmed: list[dict[str, Any]] = []
        self.events: list[str] = []

    def save(self, step: int, tensors: dict[str, Any], shared: dict[str, Any], facts: dict[str, Any],
             blocking: bool = False) -> None:
        self.saved.append(tensors)

    def warm_staging(self, tensors: dict[str, Any]) -> None:
        self.warmed.append(tensors)
        self.events.append("warm")

    def wait(self) -> None:
        self.events.append("wait")

    def wait_staged(self) -> float | None:
        return None


def _checkpointer(pins: bool = True) -> tuple[Checkpointer, RecordingManager, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 3)
    optimizer = torch.optim.AdamW(model.parameters())
    manager = RecordingManager(pins)
    return Checkpointer(manager, TrainingState(model, optimizer), rank=0, cfg=CheckpointConfig()), manager, optimizer


def _step(optimizer: torch.optim.Optimizer) -> None:
    for group in optimizer.param_groups:
        for param in group["params"]:
            param.grad = torch.ones_like(param)
    optimizer.step()


def test_the_rng_state_goes_into_the_same_tensor_save_after_save():
    checkpointer, manager, optimizer = _checkpointer()
    _step(optimizer)
    checkpointer.save(1, {})
    torch.rand(5)  # the generators move on between saves
    checkpointer.save(2, {})
    after_second = torch.rand(3)
    first, second = (tensors[rng_key(0)] for tensors in manager.saved)
    assert first.untyped_storage().data_ptr() == second.untyped_storage().data_ptr()
    assert restore_rng(second)  # the blob holds the second save's states
    assert torch.equal(torch.rand(3), after_second)


def test_warming_never_builds_the_optimizer_state_and_finishes_after_its_first_step():
    checkpointer, manager, optimizer = _checkpointer()
    assert checkpointer.warm_staging() is False  # before the first step: the model's part only
    assert "model" in manager.warmed[0] and "optim" not in manager.warmed[0]
    assert not optimizer.state  # no optimizer step was counted to build its state
    assert checkpointer.warm_staging() is False and len(manager.warmed) == 1  # not the model again
    _step(optimizer)
    assert checkpointer.warm_staging() is True
    assert "optim" in manager.warmed[1] and [int(s["step"]) for s in optimizer.state.values()] == [1, 1]


def test_nothing_is_warmed_where_staging_pins_nothing():
    checkpointer, manager, optimizer = _checkpointer(pins=False)
    _step(optimizer)
    assert checkpointer.warm_staging() is True and manager.warmed == []


def test_a_save_that_staged_the_whole_state_leaves_nothing_to_warm_and_a_warm_up_waits_for_a_save_in_flight():
    """The guard may drop every step before the first save: that save stages first (DCP
    builds the optimizer's state for it), and a warm-up must never stage into the buffers a
    writer still reads."""
    checkpointer, manager, optimizer = _checkpointer()
    checkpointer.save(1, {})  # async, before any optimizer step
    _step(optimizer)
    assert checkpointer.warm_staging() is True and manager.events == []  # its buffers are there
    checkpointer, manager, optimizer = _checkpointer()
    _step(optimizer)
    checkpointer.save(1, {}, blocking=True)  # staged nothing
    assert checkpointer.warm_staging() is True and manager.events == ["wait", "warm"]
