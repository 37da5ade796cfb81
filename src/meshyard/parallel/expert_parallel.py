"""Expert parallelism: the experts of each MoE layer split over the ranks of the ``ep`` mesh.

``apply_ep`` makes every expert weight (``GroupedExperts``: [experts, ...] tensors) a
DTensor sharded along the experts (``Shard(0)``), so rank i of an expert-parallel group of
k holds experts [i E/k, (i+1) E/k); parameter names and global shapes stay those of the
model, so distributed checkpoints reshard between ep degrees like any other layout. The
experts' call (tokens grouped by expert, and their counts) is wrapped with torch's
``distribute_module`` hooks:

1. dispatch (before the call): the counts go all-to-all first, so every rank knows how many
   tokens it gets from each peer for each of its experts; then the tokens go all-to-all
   with those split sizes (``all_to_all_single_autograd``: the backward sends the
   gradients back the same way) and are regrouped by local expert;
2. combine (after the call): the outputs are put back in the order they arrived and go
   all-to-all back to the ranks their tokens came from.

Every rank routes its own tokens (the router is replicated), so routing is the same as on
one process with the same micro-batches. With FSDP the dense weights are sharded over the
whole ``dp_shard`` dimension and the expert weights over the ranks holding the same experts
(``ParallelDims.expert_dp_mesh``); the gradient of an expert already sums the tokens of the
whole expert-parallel group, so FSDP divides it by the full data-parallel degree
(its tokens came from every rank's loss), not by the size of its own mesh.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed._functional_collectives import all_to_all_single_autograd
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import Shard, distribute_module, distribute_tensor

from meshyard.models.moe import expert_modules


def apply_ep(model: nn.Module, ep_mesh: DeviceMesh) -> nn.Module:
    """Split the experts of ``model`` over the 1-D ``ep_mesh`` (in place; returns ``model``).
    Raises ValueError when a layer's experts do not divide evenly over its ranks."""
    size = ep_mesh.size()
    for experts in expert_modules(model):
        count = experts.w_in.shape[0]
        if count % size:
            raise ValueError(f"{count} experts cannot be split evenly over parallel.ep = {size} ranks; use an ep "
                             "that divides model.moe_experts")
        distribute_module(experts, ep_mesh, _shard_experts, _dispatch, _combine)
    return model


def _shard_experts(name: str, module: nn.Module, mesh: DeviceMesh) -> None:
    """Each expert weight becomes a DTensor holding this rank's experts (works on meta too)."""
    for param_name, param in list(module.named_parameters(recurse=False)):
        sharded = nn.Parameter(distribute_tensor(param, mesh, [Shard(0)]), requires_grad=param.requires_grad)
        module.register_parameter(param_name, sharded)


class _Route:
    """Where the tokens of one call went: split sizes of both all-to-alls, and the order that
    groups the received tokens by local expert."""

    def __init__(self, send_splits: list[int], receive_splits: list[int], by_expert: torch.Tensor) -> None:
        self.send_splits, self.receive_splits, self.by_expert = send_splits, receive_splits, by_expert


def _dispatch(module: nn.Module, inputs: tuple[Any, ...], mesh: DeviceMesh) -> tuple[torch.Tensor, torch.Tensor]:
    """Send each token to the rank holding its expert; return what this rank's experts take."""
    tokens, counts = inputs
    group, size = mesh.get_group(), mesh.size()
    local = counts.numel() // size
    received_counts = torch.empty_like(counts)
    dist.all_to_all_single(received_counts, counts, group=group)
    per_source = received_counts.view(size, local).tolist()  # [source rank][local expert]
    send_splits = counts.view(size, local).sum(dim=1).tolist()
    receive_splits = [sum(row) for row in per_source]
    received = all_to_all_single_autograd(tokens, receive_splits, send_splits, group)
    by_expert = _expert_major_order(per_source, tokens.device)
    module._ep_route = _Route(send_splits, receive_splits, by_expert)
    return received[by_expert], received_counts.view(size, local).sum(dim=0)


def _combine(module: nn.Module, outputs: torch.Tensor, mesh: DeviceMesh) -> torch.Tensor:
    """Send each expert output back to the rank its token came from, in that rank's order."""
    route: _Route = module._ep_route
    del module._ep_route
    arrival_order = torch.empty_like(route.by_expert)
    arrival_order[route.by_expert] = torch.arange(route.by_expert.numel(), device=route.by_expert.device)
    return all_to_all_single_autograd(outputs[arrival_order], route.send_splits, route.receive_splits,
                                      mesh.get_group())


def _expert_major_order(per_source: list[list[int]], device: torch.device) -> torch.Tensor:
    """Indices that reorder tokens arrived source-major (all of rank 0's for each of my
    experts, then rank 1's ...) into expert-major order (each expert's tokens from every
    source, in source order), as the experts take them."""
    starts, offset = [], 0
    for row in per_source:
        row_starts = []
        for count in row:
            row_starts.append(offset)
            offset += count
        starts.append(row_starts)
    pieces = [torch.arange(starts[source][expert], starts[source][expert] + per_source[source][expert])
              for expert in range(len(per_source[0])) for source in range(len(per_source))]
    order = torch.cat(pieces) if pieces else torch.zeros(0, dtype=torch.long)
    return order.to(device)

