"""Peak memory per device for a layout, with the arithmetic of every line visible.

Notation used in the formulas: Psi = parameters held by one tensor/pipeline rank,
N = ranks the model states are sharded over, p/g = bytes of a parameter/gradient,
K = optimizer bytes per parameter (master copy + moments), c = compute bytes, a =
activation bytes, t = tokens per micro-batch.

Model states follow the ZeRO paper (Rajbhandari et al. 2020, section 5) for the stages
meshyard runs: DDP (p + g + K) Psi; ZeRO-1 (p + g) Psi + K Psi / N; ZeRO-3 (p + g + K)
Psi / N. meshyard's ZeRO-2 is FSDP2 with ``reshard_after_forward=False``: the stored
states are sharded like ZeRO-3 and the whole model is held gathered (c Psi) from
forward to backward, which is where its memory goes.

A step is modelled as three moments and the peak is the largest:

1. start of backward: everything forward saved, plus the loss's gradient buffers;
2. end of backward: all gradients, activations freed;
3. optimizer step: gradients, states and the optimizer's temporaries.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from meshyard.models.linear_cross_entropy import BLOCK_LOGIT_BYTES, block_rows
from meshyard.plan.layout import PlannedLayout
from meshyard.plan.model import ModelDescription
from meshyard.plan.stage import StageShape, stage_shapes
from meshyard.plan.units import fmt_bytes, fmt_count
from meshyard.train.optim import choose_step


@dataclass(frozen=True)
class MemoryItem:
    """One line of the estimate: what it is, its bytes and how they were computed."""

    name: str
    bytes: float
    formula: str


@dataclass(frozen=True)
class MemoryEstimate:
    """Peak device memory of the most loaded pipeline stage, and what it is made of."""

    items: tuple[MemoryItem, ...]
    """The lines present at the peak moment, in display order."""
    peak_bytes: float
    peak_moment: str
    moments: dict[str, float] = field(default_factory=dict)
    """Total bytes at each modelled moment of the step."""
    host_bytes: float = 0.0
    """Bytes kept in host memory by CPU offload."""
    stage: int = 0
    states: tuple[MemoryItem, ...] = ()
    """Parameters, gradients and optimizer states, whether or not all exist at the peak."""

    def item(self, name: str) -> float:
        """Bytes of the named line (0 when absent)."""
        return sum(i.bytes for i in self.items if i.name == name)

    @property
    def model_state_bytes(self) -> float:
        """Bytes of parameters, gradients and optimizer states on the device (ZeRO's
        "model states"), as they stand once the optimizer steps."""
        return sum(i.bytes for i in self.states)


def model_state_items(shape: StageShape, layout: PlannedLayout) -> list[MemoryItem]:
    """Parameters, gradients and optimizer states of one device, per the ZeRO stage. Under
    expert parallelism the experts a rank holds (Psi_e, its 1/ep share) are sharded over
    N_e = N / ep ranks, the rest of Psi over N."""
    prec, psi, n, stage = layout.precision, shape.params, layout.shard_degree, layout.zero_stage
    k = prec.optimizer_bytes(layout.n_optimizer_states)
    ps = fmt_count(psi)
    where = "host" if layout.offload else None
    k_text = f"K = {prec.master} master + {layout.n_optimizer_states} x {prec.state}"
    if shape.expert_params and layout.ep > 1:
        n_e, psi_e = layout.expert_shard_degree, fmt_count(shape.expert_params)
        sharded, share = shape.stored_params(n, n_e), "((Psi-Psi_e)/N + Psi_e/N_e)"
        count = f"({ps} - {psi_e}) / {n} + {psi_e} / {n_e}"
        optimizer_text = f"K*{share} ({k_text}) x {count}"
    else:
        sharded, share, count = psi / n, "Psi/N", f"{ps} / {n}"
        optimizer_text = f"K*Psi/{1 if stage == 0 else n} ({k_text}) x {ps}"
    items = []
    if stage >= 2:
        items.append(_item("parameters", prec.param * sharded, f"p*{share} = {prec.param} B x {count}", where))
        items.append(_item("gradients", prec.grad * sharded, f"g*{share} = {prec.grad} B x {count}", where))
    else:
        items.append(MemoryItem("parameters", prec.param * psi, f"p*Psi = {prec.param} B x {ps}"))
        items.append(MemoryItem("gradients", prec.grad * psi, f"g*Psi = {prec.grad} B x {ps}"))
    optimizer = k * psi if stage == 0 else k * sharded
    items.append(_item("optimizer states", optimizer, optimizer_text, where))
    return items


def _item(name: str, value: float, formula: str, where: str | None = None) -> MemoryItem:
    if where == "host":
        return MemoryItem(name, 0.0, f"offloaded to host: {formula}")
    return MemoryItem(name, value, formula)


def activation_bytes_per_layer(desc: ModelDescription, layout: PlannedLayout) -> float:
    """Bytes one block saves for backward for one micro-batch, without checkpointing."""
    prof, tp, t = desc.activations, layout.tp, layout.tokens_per_micro_batch
    if tp > 1 and layout.sequence_parallel:
        replicated = prof.sp_replicated + (prof.replicated - prof.sp_replicated) / tp
        masks = prof.mask_bytes_per_token / tp
    else:
        replicated, masks = prof.replicated, prof.mask_bytes_per_token
    units = replicated + prof.sharded / tp
    per_token = (units * desc.d_model * layout.precision.activation + prof.fp32_bytes_per_token
                 + prof.fp32_bytes_per_token_sharded / tp + masks)
    return per_token * t


def _checkpointed_layer_bytes(desc: ModelDescription, layout: PlannedLayout) -> float:
    """What a checkpointed block keeps: its input (split along the sequence under SP)."""
    split = layout.tp if layout.tp > 1 and layout.sequence_parallel else 1
    return layout.tokens_per_micro_batch * desc.d_model * layout.precision.activation / split


def activation_items(desc: ModelDescription, shape: StageShape, layout: PlannedLayout) -> list[MemoryItem]:
    """Saved activations of the stage's blocks for every micro-batch it holds in flight."""
    full = activation_bytes_per_layer(desc, layout)
    layers, flight = shape.layers, shape.in_flight
    t = layout.tokens_per_micro_batch
    if layout.ac == "none" or layers == 0:
        per_mb, text = layers * full, f"{layers} layers x {fmt_bytes(full)}"
    else:
        ckpt = _checkpointed_layer_bytes(desc, layout)
        recomputed = layers if layout.ac == "full" else layers // 2
        per_mb = recomputed * ckpt + (layers - recomputed) * full
        text = f"{recomputed} checkpointed x {fmt_bytes(ckpt)} + {layers - recomputed} x {fmt_bytes(full)}"
    return [MemoryItem("activations", flight * per_mb,
                       f"{_fmt_flight(flight)} micro-batch x ({text}); per layer "
                       f"{full / t:.0f} B/token at t={t}")]


def block_backward_item(desc: ModelDescription, layout: PlannedLayout) -> MemoryItem:
    """The first block's backward, the last to run: its activations (rebuilt when
    checkpointed) plus the gradients flowing through it, the MLP hidden's (r units,
    split by TP; a MoE block's r per routed assignment, whole, and r per shared expert,
    split) and the residual stream's (1 unit)."""
    full = activation_bytes_per_layer(desc, layout)
    ratio = desc.mlp_hidden / desc.d_model if desc.mlp_hidden else 0.0
    if desc.moe is None:
        units = 1.0 + ratio / layout.tp
    else:  # the routed experts' hidden whole on every tp rank, the shared ones' split
        units = 1.0 + ratio * (desc.moe.top_k + desc.moe.shared_experts / layout.tp)
    grads = units * layout.tokens_per_micro_batch * desc.d_model * layout.precision.activation
    what = "rebuilt activations" if layout.ac != "none" else "activations"
    return MemoryItem("block backward", full + grads,
                      f"one block's {what} {fmt_bytes(full)} + {units:g} x t x d x a of gradients")


def _fmt_flight(flight: float) -> str:
    return f"{flight:g}" if flight == int(flight) else f"{flight:.2f}"


def io_items(desc: ModelDescription, shape: StageShape, layout: PlannedLayout, on_gpu: bool = True) -> list[MemoryItem]:
    """Inputs, targets and the loss: token ids, the final norm, log-softmax and its gradients.

    The loss is computed in fp32 (``logits.float()``); at the start of backward the saved
    log-softmax output, the gradient arriving at it and the gradient it passes to the
    logits coexist: 3 x t x V x 4 bytes (V split by TP when the head is vocab-parallel).
    The fused loss (``layout.fused_loss``) never holds whole logits: ``fused_loss_item``.
    """
    t, items = layout.tokens_per_micro_batch, []
    if shape.first:
        items.append(MemoryItem("inputs", shape.in_flight * t * 8, "int64 token ids saved by the embedding"))
    if shape.last:
        vocab = desc.vocab_size / (layout.tp if layout.vocab_parallel and layout.tp > 1 else 1)
        head = t * (desc.head_saved_units * desc.d_model * layout.precision.activation + 8)
        items.append(MemoryItem("final norm", shape.last_in_flight * head,
                                f"{desc.head_saved_units:g} x d x a per token + int64 targets"))
        if layout.fused_loss:
            items.append(fused_loss_item(desc, layout, on_gpu))
        else:
            items.append(MemoryItem("loss", 3 * t * vocab * 4,
                                    f"3 x t x V = 3 x {t} x {fmt_count(vocab)} x 4 B (fp32 log-softmax and grads)"))
    return items


def fused_loss_item(desc: ModelDescription, layout: PlannedLayout, on_gpu: bool = True) -> MemoryItem:
    """The fused loss (``meshyard.models.linear_cross_entropy``) at its peak, inside its
    forward: ``fused_loss_bytes`` for its blocks (``block_rows``: on a GPU at least 4096
    rows), plus the head's compute-dtype cast where the loss makes one (``_loss_casts_head``)."""
    t, vocab, d, c = layout.tokens_per_micro_batch, desc.vocab_size, desc.d_model, layout.precision.compute
    rows = min(t, block_rows(vocab, "cuda" if on_gpu else "cpu"))
    cast = vocab * d * c if _loss_casts_head(layout) else 0
    cast_text = f"head cast c x V x d = {fmt_bytes(cast)} + " if cast else ""
    return MemoryItem("loss", cast + fused_loss_bytes(t, vocab, d, rows),
                      f"fused: {cast_text}G + {BLOCK_LOGIT_BYTES} B x b; G = (t + V) x d x 4 B = "
                      f"{fmt_bytes((t + vocab) * d * 4)} (fp32 gradients kept), b = {rows} x {fmt_count(vocab)} "
                      "logits a block")


def fused_loss_bytes(tokens: int, vocab: int, d_model: int, rows: int) -> float:
    """Peak bytes of the fused loss's forward over ``tokens`` rows, ``rows`` at a time (the
    head's cast aside): the fp32 gradients of the hidden states and of the head's weight it
    keeps for backward, G = (t + V) x d x 4 bytes, beside ``BLOCK_LOGIT_BYTES`` for each of
    the b = rows x V logits of the block being processed, whatever the compute dtype."""
    rows = min(rows, tokens)
    return (tokens + vocab) * d_model * 4 + BLOCK_LOGIT_BYTES * rows * vocab


def _loss_casts_head(layout: PlannedLayout) -> bool:
    """Whether the fused loss casts the head's weight to the compute dtype itself: where
    parameters are stored wider than they compute (autocast), not where FSDP2's
    mixed-precision policy gathers them in the compute dtype. The cast is then the loss's,
    held while it runs, and not one autocast saves for backward (``gathered_items``)."""
    prec = layout.precision
    return layout.fused_loss and prec.compute < prec.param and layout.zero_stage < 2


def gathered_items(desc: ModelDescription, shape: StageShape, layout: PlannedLayout) -> list[MemoryItem]:
    """Full-size parameter copies that exist during forward and backward.

    FSDP2 ZeRO-3 keeps the root (embeddings, head) gathered from forward to backward and
    up to two blocks at a time (the current one and the prefetched next); ZeRO-2 keeps
    every block. DDP under autocast keeps the low-precision weight casts that matmuls
    saved for backward (the head's but where the fused loss casts it).
    """
    prec, c = layout.precision, layout.precision.compute
    if layout.zero_stage >= 2:
        if layout.zero_stage == 2:
            return [MemoryItem("gathered parameters", c * shape.params,
                               f"c*Psi = {c} B x {fmt_count(shape.params)} held from forward to backward")]
        blocks = min(2, shape.layers)
        count = shape.root_params + blocks * shape.block_params
        return [MemoryItem("gathered parameters", c * count,
                           f"c x (root {fmt_count(shape.root_params)} + {blocks} blocks x "
                           f"{fmt_count(shape.block_params)})")]
    if c < prec.param:
        head = desc.vocab_size * desc.d_model if _loss_casts_head(layout) else 0
        count = f"({fmt_count(shape.params)} - {fmt_count(head)} head, the fused loss's)" if head \
            else fmt_count(shape.params)
        return [MemoryItem("gathered parameters", c * (shape.params - head),
                           f"autocast weight casts saved for backward: {c} B x {count}")]
    return []


def buffer_items(desc: ModelDescription, shape: StageShape, layout: PlannedLayout) -> list[MemoryItem]:
    """Communication buffers in flight: FSDP2 reduce-scatter, TP, PP and expert-parallel
    transfers."""
    items, prec = [], layout.precision
    act = layout.tokens_per_micro_batch * desc.d_model * prec.activation
    if layout.zero_stage >= 2 and layout.shard_degree > 1:
        block = fmt_count(shape.block_params)
        # FSDP2 keeps the last all-gather's output until the next one is copied out, so
        # the CPU cannot run ahead of the collectives.
        items.append(MemoryItem("all-gather buffer", prec.compute * shape.block_params,
                                f"c x {block} (one block, held until the next all-gather)"))
        # Unsharded gradients of one block plus the flat copy reduce-scatter reads.
        items.append(MemoryItem("reduce-scatter", 2 * prec.grad * shape.block_params,
                                f"2 x g x {block} (one block's gradients and their flat copy)"))
    if layout.tp > 1:
        items.append(MemoryItem("tp collectives", 2 * act, "2 x t x d x a (gathered input, reduced output)"))
    if layout.pp > 1:
        items.append(MemoryItem("pp transfers", 2 * act, "2 x t x d x a (activation sent, gradient received)"))
    if layout.ep > 1 and desc.moe is not None:
        # The tokens a rank's experts received and the outputs it sends back (top_k a token).
        routed = desc.moe.top_k * act
        items.append(MemoryItem("ep all-to-all", 2 * routed,
                                f"2 x t x top_k x d x a (tokens received, outputs sent back; top_k = "
                                f"{desc.moe.top_k})"))
    if layout.cp > 1:
        # Keys and values of the block being attended and of the one arriving (fp32 in the
        # ring's arithmetic), and in backward their gradients travelling the other way.
        ring = 2 * 2 * layout.tokens_per_micro_batch * desc.d_model * 4
        items.append(MemoryItem("cp ring", 2 * ring, "2 x (k, v held + arriving) x t x d x 4 B, and their gradients"))
    return items


OPTIMIZER_TEMPORARIES = {
    "fused": "none (in place)",
    "foreach": "4 B x Psi/N (foreach)",
    "for-loop": "2 x 4 B x largest parameter",
}
"""The optimizer step's scratch memory per implementation (``train.optim.step_implementation``)."""


def planned_optimizer_step(layout: PlannedLayout, on_gpu: bool = True) -> str:
    """The step the trainer takes for ``layout`` (``train.optim.choose_step`` on what the layout
    makes of meshyard's GPT): its parameters are DTensors under ZeRO-2/3 and tensor
    parallelism, where the norms stay plain without sequence parallelism, and fp16's loss
    scaling is sharded wherever gradients are split over ranks."""
    dtensors = layout.zero_stage >= 2 or layout.tp > 1
    kinds = {True, False} if layout.tp > 1 and not layout.sequence_parallel else {dtensors}
    sharded_fp16 = layout.precision.name == "fp16" and (dtensors or layout.pp > 1)
    return choose_step({"cuda" if on_gpu else "cpu"}, kinds, sharded_loss_scaling=sharded_fp16,
                       optimizer=layout.optimizer)


def optimizer_temp_bytes(desc: ModelDescription, shape: StageShape, layout: PlannedLayout,
                         optimizer_step: str) -> float:
    """Scratch memory of the optimizer step.

    The fused step (what the trainer runs wherever the parameters are floats on one device
    type) updates each parameter in place; torch's foreach AdamW builds one fp32 temporary
    per parameter it updates; the single-tensor loop only two of the largest tensor.
    """
    local = shape.stored_params(layout.shard_degree, layout.expert_shard_degree) if layout.zero_stage >= 1 \
        else shape.params
    if layout.offload or optimizer_step == "fused":
        return 0.0
    if optimizer_step == "foreach":
        return 4.0 * local
    largest = min(desc.largest_param / layout.tp, local) if desc.largest_param else local
    return 2 * 4.0 * largest


def estimate_memory(
    desc: ModelDescription, layout: PlannedLayout, optimizer_step: str | None = None, stage: int | None = None,
    on_gpu: bool = True,
) -> MemoryEstimate:
    """Peak memory of the busiest pipeline stage (or of ``stage``) for ``layout``.
    ``optimizer_step`` (a key of ``OPTIMIZER_TEMPORARIES``; by default the trainer's choice,
    ``planned_optimizer_step``) chooses the optimizer's temporaries; ``on_gpu`` those and the
    fused loss's blocks, as the trainer would on a GPU, or on a CPU when false."""
    optimizer_step = optimizer_step or planned_optimizer_step(layout, on_gpu)
    shapes = stage_shapes(desc, layout)
    if stage is not None:
        return _estimate_stage(desc, layout, shapes[stage], optimizer_step, on_gpu)
    estimates = [_estimate_stage(desc, layout, s, optimizer_step, on_gpu) for s in shapes]
    return max(estimates, key=lambda e: e.peak_bytes)


def _gradients_during_forward(shape: StageShape, layout: PlannedLayout,
                              gradients: MemoryItem) -> tuple[list[MemoryItem], list[MemoryItem]]:
    """(stored gradients, accumulation buffers) that exist while forward runs.

    DDP's buckets are the gradients and persist across steps; with accumulation the
    earlier micro-batches' gradients exist too, FSDP2 keeping them unsharded until the
    last micro-batch's reduce-scatter.
    """
    if layout.grad_accum > 1 and layout.zero_stage >= 2:
        grad = layout.precision.grad
        return [], [MemoryItem("accumulated gradients", grad * shape.params,
                               f"unsharded g*Psi = {grad} B x {fmt_count(shape.params)} between reduce-scatters")]
    if layout.grad_accum > 1 or layout.strategy in ("ddp", "zero1"):
        return [gradients], []
    return [], []


def _total(items: list[MemoryItem]) -> float:
    return sum(i.bytes for i in items)


def _estimate_stage(desc: ModelDescription, layout: PlannedLayout, shape: StageShape, optimizer_step: str,
                    on_gpu: bool) -> MemoryEstimate:
    states = model_state_items(shape, layout)
    params, grads, optim = states
    grads_fwd, accum = _gradients_during_forward(shape, layout, grads)
    gathered = gathered_items(desc, shape, layout)
    buffers = buffer_items(desc, shape, layout)
    # The first block's backward runs last, when nearly every gradient exists; under
    # ZeRO-2 the gathered blocks have been freed one by one by then.
    block = [block_backward_item(desc, layout)] if shape.layers else []
    gathered_end = gathered if layout.zero_stage != 2 else []
    temp = MemoryItem("optimizer temporaries", optimizer_temp_bytes(desc, shape, layout, optimizer_step),
                      OPTIMIZER_TEMPORARIES[optimizer_step])
    lines = {
        "start of backward": [params, *grads_fwd, optim, *accum, *activation_items(desc, shape, layout),
                              *io_items(desc, shape, layout, on_gpu), *gathered, *buffers],
        "end of backward": [*states, *accum, *gathered_end, *buffers, *block],
        "optimizer step": [*states, temp],
    }
    moments = {name: _total(items) for name, items in lines.items()}
    moment = max(moments, key=moments.__getitem__)
    host = 0.0
    if layout.offload:
        prec = layout.precision
        per_param = prec.param + prec.grad + prec.optimizer_bytes(layout.n_optimizer_states)
        host = per_param * shape.stored_params(layout.shard_degree, layout.expert_shard_degree)
    return MemoryEstimate(items=tuple(lines[moment]), peak_bytes=moments[moment], peak_moment=moment,
                          moments=moments, host_bytes=host, stage=shape.index, states=tuple(states))


def usable_bytes(device_bytes: float, headroom: float) -> float:
    """Bytes a layout may use on a device of ``device_bytes`` keeping ``headroom`` free."""
    return math.floor(device_bytes * (1.0 - headroom))
