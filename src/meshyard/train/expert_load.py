"""The router losses of a mixture-of-experts model in training, and its expert load per step.

Each micro-batch's training loss is its next-token loss plus the MoE layers' weighted
load-balancing and z-losses (``models.moe.routing_losses``); the recorded ``loss`` stays
the next-token loss alone, so it compares with a dense model's, and the router losses go
to the record beside it. Per step the record also carries the tokens each expert of each
layer received on this rank, the tokens the capacity limit dropped, and the imbalance (the
busiest expert's load over the mean load, of the worst layer), which the doctor reads.

Everything stays on the device while the step runs; the figures are read when the step's
record is written (``RunnerFigures.read``), after the step completed.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn
from torch.distributed.tensor import DTensor

from meshyard.models.moe import moe_layers, routing_losses


class ExpertLoad:
    """Adds the router losses to each micro-batch's loss and sums the step's expert load.
    For a dense model it adds nothing and records nothing."""

    def __init__(self, model: nn.Module) -> None:
        self.layers = moe_layers(model)
        self._micro_batches: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]] = []

    @property
    def active(self) -> bool:
        return bool(self.layers)

    def training_loss(self, loss: torch.Tensor) -> torch.Tensor:
        """``loss`` plus the weighted router losses of the forward just run (and that
        forward's load noted for the step's record)."""
        if not self.layers:
            return loss
        weighted, balance, z_loss = routing_losses(self.layers)
        routed = [layer.last_routing for layer in self.layers]
        counts = torch.stack([r.tokens_per_expert for r in routed])
        dropped = torch.stack([r.dropped for r in routed]).sum()
        self._micro_batches.append((balance.detach(), z_loss.detach(), counts, dropped))
        weighted = weighted.to(loss.dtype)
        if isinstance(loss, DTensor):
            # Loss parallel: the next-token loss is a DTensor replicated over the tp ranks, which
            # route the same tokens alike, so the router losses are the same on each of them too.
            weighted = DTensor.from_local(weighted, loss.device_mesh, loss.placements, run_check=False)
        return loss + weighted

    def take_step(self) -> "StepLoad":
        """The load noted since the last call (one optimizer step's micro-batches)."""
        taken, self._micro_batches = self._micro_batches, []
        return StepLoad(taken)


class StepLoad:
    """One step's router losses and expert load, read into record figures on demand."""

    def __init__(self, micro_batches: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]]) -> None:
        self._micro_batches = micro_batches

    def figures(self) -> dict[str, Any]:
        if not self._micro_batches:
            return {}
        balance, z_loss, counts, dropped = (list(parts) for parts in zip(*self._micro_batches))
        per_layer = torch.stack(counts).sum(dim=0)  # [layers, experts], summed over micro-batches
        mean = per_layer.double().mean(dim=1).clamp(min=1e-12)
        return {
            "moe_aux_loss": torch.stack(balance).mean().item(),
            "moe_z_loss": torch.stack(z_loss).mean().item(),
            "moe_tokens_per_expert": per_layer.tolist(),
            "moe_dropped_tokens": int(torch.stack(dropped).sum().item()),
            "moe_imbalance": (per_layer.double().max(dim=1).values / mean).max().item(),
        }
