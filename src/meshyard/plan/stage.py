"""What one device holds: its pipeline stage's layers, its tensor- and expert-parallel share
of them, and how many micro-batches' activations are alive on it at once."""

from __future__ import annotations

import math
from dataclasses import dataclass

from meshyard.plan.layout import PlannedLayout
from meshyard.plan.model import ModelDescription


@dataclass(frozen=True)
class StageShape:
    """Parameters and in-flight work of one (pipeline stage, tensor-parallel rank)."""

    index: int
    first: bool
    last: bool
    layers: int
    block_params: int
    """Parameters of one block on this tensor-parallel rank."""
    root_params: int
    """Parameters outside the blocks on this stage and rank (embeddings, final norm, head)."""
    in_flight: float
    """Micro-batches whose block activations this stage holds at its peak."""
    last_in_flight: float
    """Micro-batches whose head activations this stage holds (last stage only)."""
    block_expert_params: int = 0
    """Of ``block_params``, the routed experts this rank holds (1/ep of a block's)."""

    @property
    def params(self) -> int:
        """Psi: every parameter this device stores a share of (before data-parallel sharding)."""
        return self.layers * self.block_params + self.root_params

    @property
    def expert_params(self) -> int:
        """Of ``params``, the routed experts' (sharded over fewer ranks than the rest)."""
        return self.layers * self.block_expert_params

    def stored_params(self, shard_degree: int, expert_shard_degree: int) -> float:
        """Parameters whose states this device keeps once the experts are sharded over
        ``expert_shard_degree`` ranks and the rest over ``shard_degree``."""
        return (self.params - self.expert_params) / shard_degree + self.expert_params / expert_shard_degree


def block_params_per_rank(desc: ModelDescription, tp: int, ep: int = 1) -> tuple[int, int]:
    """One block's parameters on one rank, and the routed experts' among them. TP splits the
    matmul weights (and their biases, to a close approximation) of attention, the dense MLP
    and shared experts; norms, a MoE router and its routed experts stay whole on every tp
    rank, the experts split over the ``ep`` ranks instead."""
    experts = desc.expert_params_per_layer
    if tp == 1 and ep == 1:
        return desc.layer_params, experts
    routed_matmul = desc.moe.top_k * experts // desc.moe.experts if desc.moe is not None else 0
    split = desc.matmul_params_per_layer - desc.router_params_per_layer - routed_matmul
    whole = desc.layer_params - experts - split
    local_experts = math.ceil(experts / ep)
    return math.ceil(split / tp) + whole + local_experts, local_experts


def _root_params(desc: ModelDescription, layout: PlannedLayout, first: bool, last: bool) -> int:
    """Parameters outside the blocks on a stage: the embeddings on the first, the final
    norm and output head on the last, the vocabulary table split when vocab-parallel."""
    tp = layout.tp if layout.vocab_parallel else 1
    table = desc.vocab_size * desc.d_model if desc.tp_capable else 0
    table_share = math.ceil(table / tp)
    params = 0
    if first:
        params += table_share + desc.embedding_params - table
    if last:
        params += desc.head_params - (0 if desc.tied_embeddings else table)
        if not desc.tied_embeddings or not first:
            # An untied head, or a tied one on another stage: that stage keeps its own
            # copy of the table (Megatron all-reduces the two copies' gradients).
            params += table_share
    return params


def in_flight_micro_batches(layout: PlannedLayout, stage: int) -> float:
    """Micro-batches whose activations stage ``stage`` holds at its peak.

    GPipe runs every forward before any backward (all ``m``); 1F1B lets stage ``s`` of
    ``p`` hold ``p - s`` (Narayanan et al. 2021); the interleaved schedule with ``v``
    chunks per rank holds ``p (1 + (p - 1) / (p v))`` on the first stage (Korthikanti
    et al. 2022, section 4.2.3).
    """
    p, m = layout.pp, layout.grad_accum
    if p == 1:
        return 1.0
    if layout.pp_schedule == "gpipe":
        return float(m)
    depth = float(min(m, p - stage))
    if layout.pp_schedule == "interleaved" and layout.pp_virtual > 1:
        return depth * (1.0 + (p - 1) / (p * layout.pp_virtual))
    return depth


def stage_shapes(desc: ModelDescription, layout: PlannedLayout) -> list[StageShape]:
    """The first and last pipeline stages (the memory extremes; identical when pp = 1).

    Layers are split as evenly as possible; the first stage takes the remainder, so it
    is also the one with the most layers.
    """
    p = layout.pp
    per_stage = [desc.n_layer // p + (1 if s < desc.n_layer % p else 0) for s in range(p)]
    block, block_experts = block_params_per_rank(desc, layout.tp, layout.ep)
    stages = sorted({0, p - 1})
    shapes = []
    for s in stages:
        first, last = s == 0, s == p - 1
        shapes.append(StageShape(
            index=s, first=first, last=last, layers=per_stage[s], block_params=block,
            root_params=_root_params(desc, layout, first, last),
            in_flight=in_flight_micro_batches(layout, s),
            last_in_flight=float(layout.grad_accum) if layout.pp_schedule == "gpipe" and p > 1 else 1.0,
            block_expert_params=block_experts,
        ))
    return shapes
