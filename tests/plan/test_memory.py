"""Memory formulas: ZeRO closed forms, tensor/pipeline splits, checkpointing, offload, the fused loss."""

from __future__ import annotations

import itertools

import pytest

from meshyard.models.gpt import GPTShape
from meshyard.plan.layout import PRECISIONS, make_layout
from meshyard.plan.memory import (
    OPTIMIZER_TEMPORARIES, activation_bytes_per_layer, estimate_memory, fused_loss_bytes, gathered_items,
    model_state_items, optimizer_temp_bytes, planned_optimizer_step,
)
from meshyard.plan.model import describe_gpt
from meshyard.plan.stage import StageShape, block_params_per_rank, in_flight_micro_batches, stage_shapes

GPT2 = describe_gpt(GPTShape(vocab_size=50257, context_length=1024, n_layer=12, n_head=12, d_model=768))
WORLD_SIZES = (1, 2, 4, 8, 64, 1024)


def _states(strategy: str, n: int, precision: str, psi: int = GPT2.n_params) -> tuple[float, float, float]:
    layout = make_layout(strategy, n, precision=PRECISIONS[precision])
    shape = StageShape(index=0, first=True, last=True, layers=0, block_params=0, root_params=psi,
                       in_flight=1, last_in_flight=1)
    params, grads, optim = (item.bytes for item in model_state_items(shape, layout))
    return params, grads, optim


@pytest.mark.parametrize("n", WORLD_SIZES)
@pytest.mark.parametrize("precision", ["fp32", "bf16", "bf16-master"])
def test_model_states_match_the_zero_closed_forms(n, precision):
    """Rajbhandari et al. 2020, section 5: with p, g bytes per parameter and gradient and
    K optimizer bytes, DDP holds (p + g + K) Psi, ZeRO-1 (p + g) Psi + K Psi / N and
    ZeRO-3 (p + g + K) Psi / N. Mixed-precision Adam is 2 + 2 + 12 = 16 bytes/param."""
    prec = PRECISIONS[precision]
    p, g, k, psi = prec.param, prec.grad, prec.optimizer_bytes(2), GPT2.n_params
    assert p + g + k == 16  # every preset keeps 16 bytes per parameter with Adam
    if n == 1:
        assert sum(_states("ddp", 1, precision)) == pytest.approx(16 * psi)
        return
    assert sum(_states("ddp", n, precision)) == pytest.approx((p + g + k) * psi)
    assert sum(_states("zero1", n, precision)) == pytest.approx((p + g) * psi + k * psi / n)
    assert sum(_states("fsdp3", n, precision)) == pytest.approx((p + g + k) * psi / n)


@pytest.mark.parametrize("n", WORLD_SIZES[1:])
def test_fsdp2_zero2_holds_the_gathered_model_between_forward_and_backward(n):
    """meshyard's ZeRO-2 is FSDP2 with reshard_after_forward=False: states are stored
    sharded, (p + g + K) Psi / N, and the compute copy c Psi stays gathered from forward
    to backward. With DeepSpeed-style bf16 parameters (p = c = 2) that is the paper's
    2 Psi + 14 Psi / N plus the 2 Psi / N shard FSDP2 keeps beside the gathered copy."""
    layout = make_layout("fsdp2", n, precision=PRECISIONS["bf16-master"], micro_batch=1, seq_len=8)
    memory = estimate_memory(GPT2, layout)
    (shape,) = stage_shapes(GPT2, layout)
    psi = GPT2.n_params
    assert memory.model_state_bytes == pytest.approx(16 * psi / n)
    assert sum(i.bytes for i in gathered_items(GPT2, shape, layout)) == pytest.approx(2 * psi)
    zero3 = gathered_items(GPT2, shape, layout.with_(strategy="fsdp3"))
    assert sum(i.bytes for i in zero3) == pytest.approx(2 * (shape.root_params + 2 * shape.block_params))


def test_zero_paper_example_7_5b_on_64_gpus():
    """The paper's figure 1: 7.5B parameters, Adam, N = 64 -> 120 GB, 31.4 GB, 1.88 GB."""
    psi = 7_500_000_000
    assert sum(_states("ddp", 64, "bf16-master", psi)) / 1e9 == pytest.approx(120)
    assert sum(_states("zero1", 64, "bf16-master", psi)) / 1e9 == pytest.approx(31.4, abs=0.05)
    assert sum(_states("fsdp3", 64, "bf16-master", psi)) / 1e9 == pytest.approx(1.875)


def test_hsdp_shards_within_the_shard_group_only():
    layout = make_layout("hsdp", 64, shard=8, precision=PRECISIONS["bf16"], micro_batch=1, seq_len=8)
    memory = estimate_memory(GPT2, layout)
    assert layout.dp_replicate == 8 and layout.shard_degree == 8
    assert memory.model_state_bytes == pytest.approx(16 * GPT2.n_params / 8)


@pytest.mark.parametrize("tp", [1, 2, 4])
def test_tensor_parallel_splits_matmul_weights_and_vocabulary(tp):
    layout = make_layout("none", tp, tp=tp, micro_batch=1, seq_len=1024)
    block, _ = block_params_per_rank(GPT2, tp)
    other = GPT2.layer_params - GPT2.matmul_params_per_layer
    assert block == GPT2.matmul_params_per_layer // tp + other
    (shape,) = stage_shapes(GPT2, layout)
    vocab = 50257 * 768
    assert shape.root_params == -(-vocab // tp) + 1024 * 768 + 2 * 768  # positions and final norm replicated
    assert shape.params == 12 * block + shape.root_params


@pytest.mark.parametrize("tp", [1, 2, 4, 8])
def test_activation_units_under_tensor_and_sequence_parallelism(tp):
    """Korthikanti et al. 2022 split per-layer activations into a replicated part (norm
    inputs and outputs: 4 units here) and a part TP divides (12 units); sequence
    parallelism also splits the norm inputs, leaving the gathered norm outputs (2)."""
    base = make_layout("none", tp, tp=tp, micro_batch=2, seq_len=512, precision=PRECISIONS["bf16"])
    extras = GPT2.activations.fp32_bytes_per_token + GPT2.activations.fp32_bytes_per_token_sharded / tp
    tokens, d = 2 * 512, 768
    no_sp = activation_bytes_per_layer(GPT2, base.with_(sequence_parallel=False))
    sp = activation_bytes_per_layer(GPT2, base.with_(sequence_parallel=True))
    assert no_sp == pytest.approx(tokens * ((4 + 12 / tp) * d * 2 + extras))
    expected_sp = (4 + 12 / tp) if tp == 1 else (2 + 2 / tp + 12 / tp)
    assert sp == pytest.approx(tokens * (expected_sp * d * 2 + extras))


def test_pipeline_in_flight_micro_batches():
    """1F1B: stage s of p holds min(m, p - s); GPipe holds all m; interleaved with v chunks
    holds p (1 + (p - 1) / (p v)) on the first stage."""
    layout = make_layout("none", 4, pp=4, grad_accum=16)
    assert [in_flight_micro_batches(layout, s) for s in range(4)] == [4, 3, 2, 1]
    assert in_flight_micro_batches(layout.with_(pp_schedule="gpipe"), 0) == 16
    interleaved = layout.with_(pp_schedule="interleaved", pp_virtual=2)
    assert in_flight_micro_batches(interleaved, 0) == pytest.approx(4 * (1 + 3 / 8))
    assert in_flight_micro_batches(layout.with_(grad_accum=2), 0) == 2


def test_pipeline_stage_holds_its_share_of_layers():
    layout = make_layout("none", 4, pp=4, micro_batch=1, grad_accum=8, seq_len=1024)
    first, last = stage_shapes(GPT2, layout)
    assert first.layers == last.layers == 3
    assert first.in_flight == 4 and last.in_flight == 1
    # A tied head on another stage keeps its own copy of the vocabulary table.
    assert last.root_params == 50257 * 768 + 2 * 768


def test_full_checkpointing_keeps_one_unit_per_layer():
    layout = make_layout("ddp", 8, micro_batch=4, seq_len=1024, precision=PRECISIONS["bf16"])
    none = estimate_memory(GPT2, layout, stage=0)
    full = estimate_memory(GPT2, layout.with_(ac="full"), stage=0)
    selective = estimate_memory(GPT2, layout.with_(ac="selective"), stage=0)
    tokens = 4 * 1024
    assert none.item("activations") == pytest.approx(12 * activation_bytes_per_layer(GPT2, layout))
    assert full.moments["start of backward"] - none.moments["start of backward"] == pytest.approx(
        12 * tokens * 768 * 2 - none.item("activations"))
    assert full.peak_bytes < selective.peak_bytes < none.peak_bytes


def test_offload_moves_sharded_states_to_the_host():
    layout = make_layout("fsdp3", 8, micro_batch=1, seq_len=1024, precision=PRECISIONS["bf16"])
    on_device = estimate_memory(GPT2, layout)
    offloaded = estimate_memory(GPT2, layout.with_(offload=True))
    assert offloaded.model_state_bytes == 0
    assert offloaded.host_bytes == pytest.approx(16 * GPT2.n_params / 8)
    assert offloaded.peak_bytes < on_device.peak_bytes


GPT2_PADDED = describe_gpt(GPTShape(vocab_size=50304, context_length=1024, n_layer=12, n_head=12, d_model=768))


def test_fused_loss_holds_blocks_and_fp32_gradients_not_whole_logits():
    """GPT-2 124M at 16 x 1024 tokens, vocabulary 50304, bf16 on one GPU (fp32 parameters
    under autocast). Plain: 3 x t x V x 4 B = 9.89 GB. Fused: blocks of 4096 rows on a GPU
    (2^25 // 50304 = 667 on a CPU), 8 B a logit; G = (t + V) x d x 4 fp32 gradients; plus
    the head's bf16 cast V x d x 2, which the loss makes (autocast no longer saves one)."""
    t, vocab, d = 16 * 1024, 50304, 768
    layout = make_layout("none", 1, micro_batch=16, seq_len=1024, precision=PRECISIONS["bf16"])
    plain, fused = (estimate_memory(GPT2_PADDED, layout.with_(fused_loss=f)) for f in (False, True))
    assert plain.item("loss") == 3 * t * vocab * 4 == 9_890_168_832
    grads, cast = (t + vocab) * d * 4, vocab * d * 2
    assert (grads, cast) == (204_865_536, 77_266_944)
    assert fused.item("loss") == cast + grads + 8 * 4096 * vocab == 1_930_493_952
    on_cpu = estimate_memory(GPT2_PADDED, layout.with_(fused_loss=True), on_gpu=False)
    assert on_cpu.item("loss") == cast + grads + 8 * 667 * vocab == 550_554_624
    assert plain.item("gathered parameters") - fused.item("gathered parameters") == cast
    assert plain.peak_bytes - fused.peak_bytes == pytest.approx(9_890_168_832 - 1_853_227_008)


def test_fused_loss_under_fsdp_has_no_cast_of_its_own():
    """FSDP2's mixed-precision policy gathers the head in bf16: the loss casts nothing."""
    layout = make_layout("fsdp3", 8, micro_batch=16, seq_len=1024, precision=PRECISIONS["bf16"], fused_loss=True)
    memory = estimate_memory(GPT2_PADDED, layout)
    assert memory.item("loss") == 1_853_227_008  # G + 8 b, as above
    plain = estimate_memory(GPT2_PADDED, layout.with_(fused_loss=False))
    assert memory.item("gathered parameters") == plain.item("gathered parameters")


@pytest.mark.parametrize("tokens, vocab, d_model, rows, expected", [
    (1024, 4096, 64, 4096, (1024 + 4096) * 64 * 4 + 8 * 1024 * 4096),  # one block (rows capped at the tokens)
    (1024, 4096, 64, 256, (1024 + 4096) * 64 * 4 + 8 * 256 * 4096),  # several blocks
    (1024, 4096, 512, 64, (1024 + 4096) * 512 * 4 + 8 * 64 * 4096),  # G large
])
def test_fused_loss_bytes_by_hand(tokens, vocab, d_model, rows, expected):
    assert fused_loss_bytes(tokens, vocab, d_model, rows) == expected


LAYOUTS = [
    make_layout(strategy, 8, tp=tp, pp=pp, micro_batch=mb, grad_accum=accum, seq_len=512, ac=ac,
                precision=PRECISIONS[prec])
    for strategy, tp, pp, mb, accum, ac, prec in itertools.product(
        ("ddp", "zero1", "fsdp2", "fsdp3"), (1, 2), (1, 2), (1, 8), (1, 4), ("none", "full"), ("fp32", "bf16"))
]


FUSED_LAYOUTS = [layout.with_(fused_loss=True) for layout in LAYOUTS if layout.tp == layout.pp == 1]


@pytest.mark.parametrize("layout", LAYOUTS + FUSED_LAYOUTS,
                         ids=lambda l: f"{l.describe()} mb{l.micro_batch}x{l.grad_accum} {l.ac} {l.precision.name}"
                                       f"{' fused' if l.fused_loss else ''}")
def test_listed_items_add_up_to_the_peak(layout):
    memory = estimate_memory(GPT2, layout)
    assert sum(item.bytes for item in memory.items) == pytest.approx(memory.peak_bytes)
    assert memory.peak_bytes == max(memory.moments.values())


def test_optimizer_temporaries_follow_the_step_implementation():
    """The trainer's fused step updates in place; foreach and the loop need scratch memory,
    and only the optimizer step's moment holds it."""
    layout = make_layout("ddp", 1, micro_batch=1, seq_len=8)
    (shape,) = stage_shapes(GPT2, layout)
    assert optimizer_temp_bytes(GPT2, shape, layout, "fused") == 0
    assert optimizer_temp_bytes(GPT2, shape, layout, "foreach") == 4.0 * shape.params
    assert optimizer_temp_bytes(GPT2, shape, layout, "for-loop") == 2 * 4.0 * GPT2.largest_param
    moments = {step: estimate_memory(GPT2, layout, optimizer_step=step).moments["optimizer step"]
               for step in OPTIMIZER_TEMPORARIES}
    assert moments["foreach"] - moments["fused"] == pytest.approx(4.0 * shape.params)
    assert moments["for-loop"] - moments["fused"] == pytest.approx(8.0 * GPT2.largest_param)


def test_the_planned_optimizer_step_is_the_trainers_choice():
    """Fused, except where the trainer cannot fuse (train.optim.step_implementation): TP
    without sequence parallelism mixes plain norms with DTensors (the loop); fp16 with
    split gradients and SGD over DTensors take PyTorch's default (foreach on a GPU)."""
    fsdp = make_layout("fsdp3", 2, micro_batch=1, seq_len=8)
    tp = make_layout("ddp", 2, tp=2, micro_batch=1, seq_len=8)
    assert planned_optimizer_step(fsdp) == planned_optimizer_step(tp) == "fused"
    assert planned_optimizer_step(make_layout("ddp", 2, micro_batch=1, seq_len=8, precision=PRECISIONS["fp16"])) \
        == "fused"  # DDP's gradients are whole on every rank
    assert planned_optimizer_step(tp.with_(sequence_parallel=False)) == "for-loop"
    assert planned_optimizer_step(fsdp.with_(precision=PRECISIONS["fp16"])) == "foreach"
    assert planned_optimizer_step(fsdp.with_(optimizer="sgd")) == "foreach"
    assert planned_optimizer_step(fsdp.with_(optimizer="sgd"), on_gpu=False) == "for-loop"
    fp16 = fsdp.with_(precision=PRECISIONS["fp16"])
    assert estimate_memory(GPT2, fp16).moments["optimizer step"] == \
        estimate_memory(GPT2, fp16, optimizer_step="foreach").moments["optimizer step"]
