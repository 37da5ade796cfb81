"""Sanity of the cost model against the shape of published results.

The model is not fitted to any measurement; these tests check that its assumptions
(docs/plan.md) reproduce qualitative findings that hold across the literature:

- near-linear data-parallel weak scaling at small node counts (Li et al. 2020, PyTorch
  DDP: near-linear to 256 GPUs with NCCL over InfiniBand);
- falling efficiency when the global batch is fixed and the cluster grows (Goyal et
  al. 2017; the reason large runs grow the batch with the cluster);
- slower networks scale worse (Li et al. 2020, NCCL vs. slower transports);
- tensor parallelism belongs inside a node (Narayanan et al. 2021, "Efficient
  large-scale language model training on GPU clusters", takeaway #1);
- the pipeline bubble is (p - 1) / (m + p - 1) of a GPipe/1F1B step and shrinks as
  micro-batches are added (Huang et al. 2019; Narayanan et al. 2021);
- ZeRO-3 moves 1.5x the bytes of data parallelism (Rajbhandari et al. 2020, 7.2.1).
"""

from __future__ import annotations

import pytest

from meshyard.models.gpt import GPTShape
from meshyard.plan.cost import estimate_step
from meshyard.plan.hardware import make_cluster
from meshyard.plan.layout import PRECISIONS, make_layout
from meshyard.plan.model import describe_gpt
from meshyard.plan.scale import simulate_scale
from meshyard.plan.search import PlanRequest

GPT2 = describe_gpt(GPTShape(vocab_size=50257, context_length=1024, n_layer=12, n_head=12, d_model=768))
GPT_1B = describe_gpt(GPTShape(vocab_size=50257, context_length=2048, n_layer=24, n_head=16, d_model=2048))
BF16 = PRECISIONS["bf16"]


def _request(strategy: str, global_batch: int = 512, seq_len: int = 1024, tp: int = 1, pp: int = 1) -> PlanRequest:
    return PlanRequest(global_batch=global_batch, seq_len=seq_len, precision=BF16, strategies=(strategy,),
                       tp=(tp,), pp=(pp,), ac=("none",), offload=(False,))


def _efficiencies(desc, sizes, request, interconnect="ib-ndr-8x", per_rank_batch=0):
    cluster = make_cluster("h100", sizes[0], 8, interconnect)
    result = simulate_scale(desc, cluster, list(sizes), request, per_rank_batch=per_rank_batch)
    assert all(p.candidate is not None for p in result.points), [p.reason for p in result.points]
    return [p.efficiency for p in result.points]


@pytest.mark.parametrize("desc", [GPT2, GPT_1B], ids=["124M", "1.3B"])
@pytest.mark.parametrize("strategy", ["ddp", "fsdp3"])
def test_weak_scaling_is_near_linear_at_small_node_counts(desc, strategy):
    """8 samples of 1024 tokens per GPU, 1 to 8 nodes of H100s on 8 x NDR InfiniBand.
    Sharded states slightly exceed linear: each GPU's optimizer step shrinks with the
    cluster (the ZeRO paper's super-linear speed-up has the same cause)."""
    eff = _efficiencies(desc, [8, 16, 32, 64], _request(strategy, seq_len=1024), per_rank_batch=8)
    assert all(0.95 <= e <= 1.05 for e in eff), eff


def test_fixed_global_batch_loses_efficiency_as_the_cluster_grows():
    eff = _efficiencies(GPT2, [8, 32, 128, 512], _request("ddp", global_batch=512))
    assert eff == sorted(eff, reverse=True) and eff[0] == 1.0
    assert eff[1] > 0.9  # a few nodes: still near-linear
    assert eff[-1] < 0.7  # one sample per GPU: the gradient all-reduce dominates


def test_slower_networks_scale_worse():
    """A 1.3B model's 5 GB of fp32 gradients per step: hidden behind backward on
    InfiniBand, dominant over one 100 Gb/s Ethernet port per node."""
    request, sizes = _request("ddp", seq_len=1024), [8, 64]
    fast = _efficiencies(GPT_1B, sizes, request, "ib-ndr-8x", per_rank_batch=8)[-1]
    slow = _efficiencies(GPT_1B, sizes, request, "eth-100g", per_rank_batch=8)[-1]
    assert slow < 0.5 < 0.95 < fast


def test_tensor_parallelism_across_nodes_is_much_slower():
    """The same 8-way TP group inside one DGX A100 (NVLink 3) or across two 4-GPU nodes
    with one 200 Gb/s NIC per GPU: TP's per-layer all-reduces sit on the critical path."""
    layout = make_layout("none", 8, tp=8, micro_batch=4, grad_accum=8, seq_len=2048, precision=BF16)
    inside = estimate_step(GPT_1B, layout, make_cluster("a100", 8, 8, "ib-hdr-8x"))
    across = estimate_step(GPT_1B, layout, make_cluster("a100", 8, 4, "ib-hdr-8x", inter_bandwidth=100e9))
    assert across.seconds("tp comm") > 2.5 * inside.seconds("tp comm")
    assert across.step_time > 1.15 * inside.step_time


@pytest.mark.parametrize("micro_batches", [4, 8, 32])
def test_pipeline_bubble_fraction(micro_batches):
    p = 4
    layout = make_layout("none", p, pp=p, micro_batch=1, grad_accum=micro_batches, seq_len=1024, precision=BF16)
    step = estimate_step(GPT_1B, layout, make_cluster("h100", p, 8, "ib-ndr-8x"))
    pipeline = sum(step.seconds(n) for n in ("compute", "pp transfers", "pipeline bubble"))
    assert step.seconds("pipeline bubble") / pipeline == pytest.approx((p - 1) / (micro_batches + p - 1))
    interleaved = estimate_step(GPT_1B, layout.with_(pp_schedule="interleaved", pp_virtual=2),
                                make_cluster("h100", p, 8, "ib-ndr-8x"))
    assert interleaved.seconds("pipeline bubble") < step.seconds("pipeline bubble")


def test_more_micro_batches_amortise_the_bubble():
    per_token = []
    for m in (4, 8, 16, 64):
        layout = make_layout("none", 4, pp=4, micro_batch=1, grad_accum=m, seq_len=1024, precision=BF16)
        step = estimate_step(GPT_1B, layout, make_cluster("h100", 4, 8, "ib-ndr-8x"))
        per_token.append(step.step_time / m)
    assert per_token == sorted(per_token, reverse=True)


def test_zero3_moves_one_and_a_half_times_the_bytes_of_ddp():
    """Bandwidth-bound regime (latency negligible): all-gather twice plus reduce-scatter
    = 3 (n - 1) / n Psi against the all-reduce's 2 (n - 1) / n Psi."""
    cluster = make_cluster("h100", 64, 8, "eth-25g")
    fp32 = PRECISIONS["fp32"]  # gradients and gathered parameters of the same size
    ddp = estimate_step(GPT_1B, make_layout("ddp", 64, micro_batch=1, seq_len=2048, precision=fp32), cluster)
    zero3 = estimate_step(GPT_1B, make_layout("fsdp3", 64, micro_batch=1, seq_len=2048, precision=fp32), cluster)
    assert zero3.seconds("dp comm") / ddp.seconds("dp comm") == pytest.approx(1.5, rel=0.02)


def test_mfu_is_bounded_by_the_achievable_efficiency():
    cluster = make_cluster("h100", 8, 8, "ib-ndr-8x", compute_efficiency=0.45)
    step = estimate_step(GPT_1B, make_layout("fsdp3", 8, micro_batch=4, grad_accum=4, seq_len=2048,
                                             precision=BF16), cluster)
    assert 0.4 < step.mfu <= 0.45
    assert step.tokens_per_step == 8 * 4 * 4 * 2048


def test_checkpointing_costs_a_forward_pass():
    cluster = make_cluster("h100", 8, 8, "ib-ndr-8x")
    layout = make_layout("ddp", 8, micro_batch=4, seq_len=2048, precision=BF16)
    plain = estimate_step(GPT_1B, layout, cluster)
    full = estimate_step(GPT_1B, layout.with_(ac="full"), cluster)
    block_share = 24 * GPT_1B.layer_forward_flops_per_token(2048) / GPT_1B.forward_flops_per_token(2048)
    assert full.seconds("recompute") == pytest.approx(plain.seconds("compute") / 3 * block_share)
