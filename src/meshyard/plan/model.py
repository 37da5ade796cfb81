"""What the planner needs to know about a model: parameters, FLOPs and activations.

A ``ModelDescription`` is pure arithmetic, built either in closed form from a GPT shape
(``describe_gpt``) or by tracing any module built on the meta device
(``meshyard.plan.trace.describe_module``). Everything downstream (memory, cost, search)
reads only this object, never the module.

Conventions:

- Parameter counts and FLOPs are those of ``meshyard.models.flops`` (exact counts, a
  tied weight once; FLOPs by the PaLM convention), the formulas training's MFU uses too.
- Activations are the bytes autograd saves for backward, per token, in "units" of
  ``d_model`` elements so that the dtype and tensor-parallel degree can be applied
  later. The split into ``replicated`` and ``sharded`` units is what tensor parallelism
  divides (Korthikanti et al. 2022, "Reducing Activation Recomputation").
"""

from __future__ import annotations

from dataclasses import dataclass

from meshyard.models.flops import TRAINING_PER_FORWARD, gpt_counts, head_forward_flops, layer_forward_flops
from meshyard.models.gpt import GPT, GPTShape
from meshyard.models.moe import MoEShape


@dataclass(frozen=True)
class ActivationProfile:
    """Bytes saved for backward by one block, per token, split by how TP treats them.

    With tensor parallelism of degree ``tp`` (and optionally sequence parallelism) a
    block saves ``(replicated + sharded / tp) x d_model`` elements per token, where
    ``replicated`` becomes ``sp_replicated + (replicated - sp_replicated) / tp`` under
    sequence parallelism.
    """

    replicated: float
    """Units (of d_model elements) every TP rank holds in full: norm inputs and outputs."""
    sharded: float
    """Units TP splits across ranks: qkv, attention output, MLP hidden and its activation."""
    sp_replicated: float
    """Units still held in full under sequence parallelism: the gathered norm outputs that
    the column-parallel linears save as their input."""
    fp32_bytes_per_token: float
    """Bytes kept whatever the compute dtype: fp32 norm statistics (mean/rstd) and, in a
    mixture-of-experts block, the router's fp32 logits and the int64 routing indices."""
    fp32_bytes_per_token_sharded: float
    """fp32 statistics split by TP (attention log-sum-exp, one per head)."""
    mask_bytes_per_token: float
    """Dropout masks (one byte per element) when dropout > 0."""

    @property
    def total_units(self) -> float:
        return self.replicated + self.sharded


@dataclass(frozen=True)
class ModelDescription:
    """Sizes and costs of one model, independent of how it is laid out on devices."""

    name: str
    n_params: int
    n_layer: int
    d_model: int
    n_head: int
    vocab_size: int
    context_length: int
    layer_params: int
    """Parameters of one repeated block (all blocks are identical)."""
    embedding_params: int
    """Parameters outside the blocks used on the first pipeline stage (token/position tables)."""
    head_params: int
    """Parameters outside the blocks used on the last pipeline stage (final norm, untied head)."""
    matmul_params_per_layer: int
    """Weights of one block that take part in a matmul (FLOPs = 2 per weight per token)."""
    head_matmul_params: int
    """Weights of the output projection (counted for FLOPs even when tied)."""
    activations: ActivationProfile
    head_saved_units: float
    """Units of d_model saved per token after the last block (final norm input and output)."""
    largest_param: int = 0
    """Elements of the largest single parameter (bounds per-tensor optimizer temporaries)."""
    tied_embeddings: bool = True
    mlp_hidden: int = 0
    tp_capable: bool = True
    """Whether the block layout is known well enough to split it with tensor parallelism."""
    fuses_head_loss: bool = False
    """Whether the model's forward can compute its loss from the final hidden states, without
    logits (``train.fused_linear_loss``): the ``fuses_head_loss`` of meshyard's GPT, which the
    trainer asks the module for too."""
    traced_seq_len: int = 0
    """Non-zero for traced models: the sequence length their FLOPs were counted at."""
    traced_layer_flops: float = 0.0
    """Traced models: forward FLOPs of one block per token at ``traced_seq_len``."""
    traced_head_flops: float = 0.0
    """Traced models: forward FLOPs per token outside the blocks at ``traced_seq_len``."""
    moe: MoEShape | None = None
    """The experts of every block's mixture-of-experts feed-forward (None: dense blocks)."""
    expert_params_per_layer: int = 0
    """Routed experts' weights of one block: expert parallelism splits them over its ranks;
    tensor parallelism leaves them whole on every rank."""

    @property
    def block_params(self) -> int:
        return self.n_layer * self.layer_params

    @property
    def experts(self) -> int:
        """Routed experts per block (0 for a dense model)."""
        return self.moe.experts if self.moe is not None else 0

    @property
    def router_params_per_layer(self) -> int:
        """The router's weights of one block, whole on every tensor-parallel rank."""
        return self.d_model * self.experts

    def tp_whole_forward_flops_per_token(self) -> float:
        """Forward FLOPs of one block per token that tensor parallelism does not split: a
        MoE block's router and the ``top_k`` routed experts each token passes through, which
        every tp rank runs on the same tokens (0 for a dense block)."""
        if self.moe is None:
            return 0.0
        per_expert = self.expert_params_per_layer / self.moe.experts
        return 2.0 * (self.router_params_per_layer + self.moe.top_k * per_expert)

    def forward_flops_per_token(self, seq_len: int) -> float:
        """Model FLOPs of one forward pass per token (PaLM convention, ``meshyard.models.flops``)."""
        return self.n_layer * self.layer_forward_flops_per_token(seq_len) + self.head_forward_flops_per_token()

    def training_flops_per_token(self, seq_len: int) -> float:
        """Forward plus backward (twice the forward): the 6N + 12 L d T of PaLM."""
        return TRAINING_PER_FORWARD * self.forward_flops_per_token(seq_len)

    def layer_forward_flops_per_token(self, seq_len: int) -> float:
        """Forward FLOPs of one block per token: its matmuls plus attention's two products."""
        if self.traced_seq_len:
            return self.traced_layer_flops
        return layer_forward_flops(self.matmul_params_per_layer, self.d_model, seq_len)

    def head_forward_flops_per_token(self) -> float:
        """Forward FLOPs per token outside the blocks: the output projection."""
        if self.traced_seq_len:
            return self.traced_head_flops
        return head_forward_flops(self.head_matmul_params)


def gpt_activation_profile(shape: GPTShape) -> ActivationProfile:
    """Saved tensors of one ``meshyard.models.gpt.Block`` per token, in d_model units.

    Counted from what autograd keeps (checked against ``saved_tensors_hooks`` in tests):
    ln_1 input (the residual) 1, ln_1 output 1 (saved by qkv), qkv output 3 (q, k, v for
    attention backward), attention output 1 (SDPA's output, whose transposed view is the
    projection's input), ln_2 input 1, ln_2 output 1 (saved by fc), fc output r (saved
    by GELU) and GELU output r (saved by the MLP projection), r = mlp_ratio. That is
    ``4 + 4 + 2r`` = 16 units for r = 4; Korthikanti et al. count 17 with a separate
    copy of the attention output and dropout masks. Fused (flash) attention stores a
    log-sum-exp per head and no T x T scores. A mixture-of-experts block saves, in place of
    the MLP's 2r, ``top_k x (3 + 2r)`` units that tensor parallelism does not split (each
    tp rank runs the routed experts on all its tokens) and ``2 r s`` for s shared experts,
    which it does.
    """
    r = shape.mlp_ratio
    dropout = shape.dropout > 0
    moe = shape.moe
    if moe is None:
        replicated, sharded, sp_replicated, routing_bytes, residual_dropouts = 4.0, 4.0 + 2.0 * r, 2.0, 0.0, 2
    else:
        # Per assignment (top_k a token): its gathered input, the expert's hidden before and
        # after GELU (r each), the expert's output and its weighted copy; whole on every tp
        # rank, like the router's fp32 logits and probabilities (E each), its log-sum-exp and
        # the weights' sum, the chosen weights twice (fp32) and three int64 index tensors.
        routed = moe.top_k * (3.0 + 2.0 * r)
        replicated, sp_replicated = 4.0 + routed, 2.0 + routed
        sharded = 4.0 + 2.0 * r * moe.shared_experts
        routing_bytes = 2 * 4.0 * moe.experts + 2 * 4.0 + moe.top_k * (2 * 4.0 + 3 * 8.0)
        residual_dropouts = 1  # the MoE feed-forward has no dropout of its own
    return ActivationProfile(
        replicated=replicated,
        sharded=sharded,
        sp_replicated=sp_replicated,
        fp32_bytes_per_token=2 * 2 * 4.0 + routing_bytes,  # two LayerNorms x (mean, rstd) x fp32
        fp32_bytes_per_token_sharded=4.0 * shape.n_head,  # log-sum-exp per head, fp32
        # Residual dropouts after attention and MLP, and attention-probability dropout
        # is regenerated from the RNG state by fused kernels (no mask kept).
        mask_bytes_per_token=residual_dropouts * shape.d_model if dropout else 0.0,
    )


def describe_gpt(shape: GPTShape, name: str = "gpt") -> ModelDescription:
    """Closed-form description of ``meshyard.models.gpt.GPT(shape)``.

    ``n_params`` equals ``sum(p.numel() for p in GPT(shape).parameters())`` exactly.
    """
    counts = gpt_counts(shape)
    return ModelDescription(
        name=name,
        n_params=counts.n_params,
        n_layer=shape.n_layer,
        d_model=shape.d_model,
        n_head=shape.n_head,
        vocab_size=shape.vocab_size,
        context_length=shape.context_length,
        layer_params=counts.layer_params,
        embedding_params=counts.embedding_params,
        head_params=counts.head_params,
        matmul_params_per_layer=counts.matmul_params_per_layer,
        head_matmul_params=counts.head_matmul_params,
        activations=gpt_activation_profile(shape),
        head_saved_units=2.0,  # ln_f input, ln_f output (saved by lm_head)
        largest_param=counts.largest_param,
        tied_embeddings=shape.tie_embeddings,
        mlp_hidden=counts.mlp_hidden,
        fuses_head_loss=GPT.fuses_head_loss,
        moe=shape.moe,
        expert_params_per_layer=counts.expert_params_per_layer,
    )
