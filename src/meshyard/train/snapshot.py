"""An in-memory copy of the training state on the host: where the spike and NaN guard
rolls a run back to.

Each rank copies what it holds (its shards under FSDP or ZeRO-1, its stages under
pipelining: the local tensor of a DTensor), so a snapshot works under every layout and
costs one device-to-host copy of this rank's parameters, buffers and optimizer state.
Restoring copies the values back into the same tensors in place, so the optimizer, the
parallel wrappers and their hooks keep pointing at them.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from meshyard.models.local_part import local_part


def _to_host(value: Any) -> Any:
    if isinstance(value, torch.Tensor):
        return local_part(value).detach().to("cpu", copy=True)
    return copy.deepcopy(value)


@dataclass
class Snapshot:
    """The state after optimizer step ``step``."""

    step: int
    tokens_seen: int
    tensors: list[torch.Tensor]  # parameters and buffers, in ``_live_tensors`` order
    optimizer_state: list[dict[str, Any]]  # per parameter, in the optimizer's order
    scheduler: dict[str, Any]
    scaler: dict[str, Any]
    rng: torch.Tensor
    device_rng: torch.Tensor | None


def _live_tensors(model: nn.Module) -> list[torch.Tensor]:
    return [*model.parameters(), *model.buffers()]


def _optimizer_parameters(optimizer: torch.optim.Optimizer) -> list[torch.Tensor]:
    # ZeRO-1 keeps its state in the local optimizer it wraps.
    inner = getattr(optimizer, "optim", optimizer)
    return [p for group in inner.param_groups for p in group["params"]]


def _optimizer_states(optimizer: torch.optim.Optimizer) -> dict:
    return getattr(optimizer, "optim", optimizer).state


@torch.no_grad()
def take_snapshot(step: int, tokens_seen: int, model: nn.Module, optimizer: torch.optim.Optimizer,
                  scheduler: torch.optim.lr_scheduler.LRScheduler, scaler: torch.amp.GradScaler,
                  device: torch.device) -> Snapshot:
    """Copy this rank's training state to host memory."""
    states = _optimizer_states(optimizer)
    optimizer_state = [{key: _to_host(value) for key, value in states.get(p, {}).items()}
                       for p in _optimizer_parameters(optimizer)]
    device_rng = torch.cuda.get_rng_state(device) if device.type == "cuda" else None
    return Snapshot(step, tokens_seen, [_to_host(t) for t in _live_tensors(model)], optimizer_state,
                    copy.deepcopy(scheduler.state_dict()), copy.deepcopy(scaler.state_dict()),
                    torch.get_rng_state(), device_rng)


@torch.no_grad()
def restore_snapshot(snapshot: Snapshot, model: nn.Module, optimizer: torch.optim.Optimizer,
                     scheduler: torch.optim.lr_scheduler.LRScheduler, scaler: torch.amp.GradScaler,
                     device: torch.device) -> None:
    """Put a snapshot's values back into the live tensors (the step counters are the
    caller's: ``snapshot.step`` and ``snapshot.tokens_seen``)."""
    for live, saved in zip(_live_tensors(model), snapshot.tensors):
        local_part(live).copy_(saved)
    states = _optimizer_states(optimizer)
    for p, saved in zip(_optimizer_parameters(optimizer), snapshot.optimizer_state):
        live = states.get(p, {})
        if set(live) != set(saved):  # the state was created after the snapshot (or differs): rebuild it
            states[p] = {key: value.to(local_part(p).device) if isinstance(value, torch.Tensor) else copy.deepcopy(value)
                         for key, value in saved.items()}
            continue
        for key, value in saved.items():
            if isinstance(value, torch.Tensor):
                local_part(live[key]).copy_(value)
            else:
                live[key] = copy.deepcopy(value)
    optimizer.zero_grad(set_to_none=True)
    scheduler.load_state_dict(copy.deepcopy(snapshot.scheduler))
    if snapshot.scaler:
        scaler.load_state_dict(copy.deepcopy(snapshot.scaler))
    torch.set_rng_state(snapshot.rng)
    if snapshot.device_rng is not None:
        torch.cuda.set_rng_state(snapshot.device_rng, device)
