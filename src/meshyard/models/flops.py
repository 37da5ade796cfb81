"""Parameter counts and model FLOPs of meshyard's GPT, in closed form.

The planner (``meshyard.plan.model``) and the training metrics (MFU,
``meshyard.metrics.throughput``) both count with these formulas, so a plan and a run
report the same model FLOPs. Plain arithmetic: the module imports neither torch nor the
model (``GPTShape`` is only a type here).

Conventions:

- Parameter counts are exact and count a tied weight once.
- FLOPs follow PaLM (Chowdhery et al. 2022, appendix B): per token, a forward pass costs
  ``2 x (weights used in matmuls) + 4 x n_layer x seq x d_model`` (the attention score
  and value products, counted in full although a causal mask could skip half). Backward
  costs twice the forward. The output head counts as a matmul even when tied.
- Mixture of experts: FLOPs count the ACTIVE weights, those a token passes through (the
  router, its ``top_k`` routed experts and the shared ones); parameter counts, and so
  memory, count every expert.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # the shape's module builds torch modules; the arithmetic needs none
    from meshyard.models.gpt import GPTShape

TRAINING_PER_FORWARD = 3.0
"""Training FLOPs per forward FLOP: the forward, and a backward that costs twice as much
(recomputation under activation checkpointing is not counted, so figures compare)."""


def layer_forward_flops(matmul_params: int, d_model: int, seq_len: int) -> float:
    """Forward FLOPs of one transformer block per token: its matmuls, plus attention's
    score and value products over ``seq_len`` positions."""
    return 2.0 * matmul_params + 4.0 * seq_len * d_model


def head_forward_flops(head_matmul_params: int) -> float:
    """Forward FLOPs per token of the output projection."""
    return 2.0 * head_matmul_params


@dataclass(frozen=True)
class GPTCounts:
    """Parameters of ``meshyard.models.gpt.GPT(shape)``, by where they sit."""

    layer_params: int
    """One block (all blocks are identical)."""
    embedding_params: int
    """Token and position tables."""
    head_params: int
    """Final norm, and the output projection when it is not tied to the token table."""
    matmul_params_per_layer: int
    """Weights of one block that take part in a matmul."""
    head_matmul_params: int
    """Weights of the output projection (counted for FLOPs even when tied)."""
    mlp_hidden: int
    largest_param: int
    """Elements of the largest single parameter."""
    n_params: int
    """All parameters; equals ``sum(p.numel() for p in GPT(shape).parameters())``."""
    expert_params_per_layer: int = 0
    """Routed experts' weights of one block (MoE; expert parallelism splits them)."""
    active_params: int = 0
    """Parameters one token passes through: all of a dense model's, a MoE model's without
    the routed experts it is not sent to."""


def gpt_counts(shape: GPTShape) -> GPTCounts:
    """Closed-form parameter counts of ``meshyard.models.gpt.GPT(shape)``."""
    d, v, ctx = shape.d_model, shape.vocab_size, shape.context_length
    hidden = shape.mlp_ratio * d
    bias = 1 if shape.bias else 0
    norm = d * (1 + bias)  # LayerNorm weight (+ bias)
    attn_matmul = d * 3 * d + d * d
    mlp_matmul = d * hidden + hidden * d
    mlp_params, active_mlp_matmul, expert_params, largest = mlp_matmul + bias * (hidden + d), mlp_matmul, 0, d * hidden
    if shape.moe is not None:  # router, batched experts (no biases), shared experts
        moe = shape.moe
        router, shared = d * moe.experts, moe.shared_experts * mlp_matmul
        expert_params = moe.experts * mlp_matmul
        mlp_params = router + expert_params + shared
        active_mlp_matmul = router + moe.top_k * mlp_matmul + shared
        largest = max(moe.experts * d * hidden, moe.shared_experts * d * hidden)
    layer = 2 * norm + attn_matmul + bias * (3 * d + d) + mlp_params
    embedding = v * d + ctx * d
    head = norm + (0 if shape.tie_embeddings else v * d)
    n_params = shape.n_layer * layer + embedding + head
    inactive = expert_params - (shape.moe.top_k * mlp_matmul if shape.moe is not None else 0)
    return GPTCounts(
        layer_params=layer,
        embedding_params=embedding,
        head_params=head,
        matmul_params_per_layer=attn_matmul + active_mlp_matmul,
        head_matmul_params=v * d,
        mlp_hidden=hidden,
        largest_param=max(v * d, ctx * d, 3 * d * d, largest),
        n_params=n_params,
        expert_params_per_layer=expert_params,
        active_params=n_params - shape.n_layer * inactive,
    )


def gpt_training_flops_per_token(shape: GPTShape, seq_len: int) -> float:
    """Model FLOPs of one training step per token (the 6N + 12 L d T of PaLM)."""
    counts = gpt_counts(shape)
    forward = (shape.n_layer * layer_forward_flops(counts.matmul_params_per_layer, shape.d_model, seq_len)
               + head_forward_flops(counts.head_matmul_params))
    return TRAINING_PER_FORWARD * forward
