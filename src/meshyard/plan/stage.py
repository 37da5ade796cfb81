"""What one device holds: its pipeline stage's layers, its tensor-parallel share of them,
and how many micro-batches' activations are alive on it at once."""

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

    @property
    def params(self) -> int:
        """Psi: every parameter this device stores a share of (before data-parallel sharding)."""
        return self.layers * self.block_params + self.root_params


def tp_block_params(desc: ModelDescription, tp: int) -> int:
    """One block's parameters on one TP rank: matmul weights (and their biases, to a close
    approximation) are split, norms stay replicated."""
    if tp == 1:
        return desc.layer_params
    other = desc.layer_params - desc.matmul_params_per_layer
    return math.ceil(desc.matmul_params_per_layer / tp) + other


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
    block = tp_block_params(desc, layout.tp)
    stages = sorted({0, p - 1})
    shapes = []
    for s in stages:
        first, last = s == 0, s == p - 1
        shapes.append(StageShape(
            index=s, first=first, last=last, layers=per_stage[s], block_params=block,
            root_params=_root_params(desc, layout, first, last),
            in_flight=in_flight_micro_batches(layout, s),
            last_in_flight=float(layout.grad_accum) if layout.pp_schedule == "gpipe" and p > 1 else 1.0,
        ))
    return shapes
