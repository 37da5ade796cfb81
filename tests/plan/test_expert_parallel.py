"""The planner under expert parallelism: a rank's share of the experts (1/ep, sharded over the
other dp_shard / ep ranks), MoE activations as autograd saves them, the all-to-all dispatch
and combine in the step time, and a search that proposes only what the trainer runs."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from meshyard.config.load import load_config
from meshyard.models.gpt import GPT, GPTShape
from meshyard.models.moe import MoEShape
from meshyard.plan.cli import run
from meshyard.plan.comm import collective_time, place_group
from meshyard.plan.cost import estimate_step
from meshyard.plan.hardware import make_cluster
from meshyard.plan.layout import PRECISIONS, make_layout
from meshyard.plan.memory import estimate_memory
from meshyard.plan.model import describe_gpt
from meshyard.plan.search import PlanRequest, plan
from meshyard.plan.stage import block_params_per_rank, stage_shapes
from meshyard.validate import validate

D, LAYERS, EXPERTS, TOP_K = 1024, 8, 16, 2
MOE = describe_gpt(GPTShape(vocab_size=50257, context_length=2048, n_layer=LAYERS, n_head=16, d_model=D,
                            moe=MoEShape(EXPERTS, TOP_K, shared_experts=1)))
EXPERT_PARAMS = EXPERTS * 2 * D * 4 * D  # w_in and w_out of every routed expert of a block
CLUSTER = make_cluster("h100", n_gpus=16, gpus_per_node=8)


def _layout(ep: int, strategy: str = "fsdp3", n: int = 16, **kwargs):
    return make_layout(strategy, n, ep=ep, micro_batch=2, grad_accum=1, seq_len=2048, precision=PRECISIONS["bf16"],
                       **kwargs)


def test_a_rank_holds_one_ep_th_of_the_experts_and_shards_them_over_the_rest():
    assert MOE.expert_params_per_layer == EXPERT_PARAMS
    whole, split = estimate_memory(MOE, _layout(1)), estimate_memory(MOE, _layout(4))
    (shape,) = stage_shapes(MOE, _layout(4))
    assert shape.expert_params == LAYERS * EXPERT_PARAMS // 4
    layout = _layout(4)
    assert (layout.shard_degree, layout.expert_shard_degree) == (16, 4)
    # Stored states: experts over 16 / 4 ranks, the rest over 16; so as much as without ep.
    dense = shape.params - shape.expert_params
    params = [i for i in split.states if i.name == "parameters"][0]
    assert params.bytes == pytest.approx(4 * (dense / 16 + shape.expert_params / 4))
    assert split.model_state_bytes == pytest.approx(whole.model_state_bytes, rel=1e-6)
    # What FSDP gathers is only this rank's experts: a block's gathered copy shrinks.
    assert split.item("all-gather buffer") < whole.item("all-gather buffer") / 3
    assert split.item("ep all-to-all") == 2 * 2 * 2048 * TOP_K * D * 2 and whole.item("ep all-to-all") == 0


@pytest.mark.parametrize("tp, ep", [(1, 1), (2, 1), (2, 4), (4, 2)])
def test_tensor_parallelism_splits_attention_and_shared_experts_but_not_the_routed_ones(tp, ep):
    """Counted from the module: TP splits the attention and shared-expert matmul weights,
    the router and routed experts stay whole on every tp rank and split over ep."""
    shape = GPTShape(vocab_size=256, context_length=64, n_layer=1, n_head=16, d_model=D,
                     moe=MoEShape(EXPERTS, TOP_K, shared_experts=1))
    with torch.device("meta"):
        block = GPT(shape).blocks[0]
    split_by_tp = ("attn.qkv.weight", "attn.proj.weight", "mlp.shared.fc.weight", "mlp.shared.proj.weight")
    expected = 0
    for name, param in block.named_parameters():
        count = param.numel()
        expected += count // tp if name in split_by_tp else count // ep if name.startswith("mlp.experts") else count
    per_rank, experts = block_params_per_rank(describe_gpt(shape), tp, ep)
    assert (per_rank, experts) == (expected, EXPERT_PARAMS // ep)


def test_moe_activations_are_what_autograd_saves():
    """A MoE block's saved tensors, as the profile counts them: attention's 8 units, top_k x
    (3 + 2r) routed and 2r per shared expert, plus the router's fp32 and int64 bytes."""
    base = dict(vocab_size=256, context_length=64, n_head=2, d_model=64)
    moe = MoEShape(8, 2, shared_experts=1)
    per_block = _saved(GPTShape(n_layer=2, moe=moe, **base)) - _saved(GPTShape(n_layer=1, moe=moe, **base))
    profile = describe_gpt(GPTShape(n_layer=2, moe=moe, **base)).activations
    assert profile.total_units == 8 + 2 * (3 + 2 * 4) + 2 * 4
    expected = 4 * 64 * (profile.total_units * 64 * 4 + profile.fp32_bytes_per_token
                         + profile.fp32_bytes_per_token_sharded)
    assert per_block == pytest.approx(expected, rel=1e-3)


def _saved(shape: GPTShape, batch: int = 4) -> int:
    """Bytes a forward and loss save for backward (parameters left out)."""
    torch.manual_seed(0)
    model = GPT(shape)
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    saved: dict[int, int] = {}

    def pack(t):
        if t.untyped_storage().data_ptr() not in params:
            saved[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t

    tokens = torch.randint(0, shape.vocab_size, (batch, shape.context_length + 1))
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        F.cross_entropy(model(tokens[:, :-1]).flatten(0, 1), tokens[:, 1:].flatten())
    return sum(saved.values())


@pytest.mark.parametrize("ep", [2, 4, 8])
def test_dispatch_and_combine_are_four_all_to_alls_per_moe_block(ep):
    step = estimate_step(MOE, _layout(ep), CLUSTER)
    t = 2 * 2048
    one = collective_time(CLUSTER, "all_to_all", t * TOP_K * D * 2, place_group(ep, 1, 8))
    assert step.seconds("ep all-to-all") == pytest.approx(LAYERS * 4 * one)
    assert estimate_step(MOE, _layout(1), CLUSTER).seconds("ep all-to-all") == 0
    # Each rank sends (ep - 1) / ep of its tokens' copies.
    latency = CLUSTER.intra.latency
    assert (one - latency) * CLUSTER.intra.bandwidth * CLUSTER.link_efficiency == pytest.approx(
        t * TOP_K * D * 2 * (ep - 1) / ep)


def test_the_all_to_all_costs_more_across_nodes_and_recomputation_repeats_dispatch():
    slow = make_cluster("h100", n_gpus=16, gpus_per_node=8, inter_bandwidth=50e9)
    within, across = (estimate_step(MOE, _layout(ep), slow).seconds("ep all-to-all") for ep in (8, 16))
    assert across > 2 * within
    recomputed = estimate_step(MOE, _layout(8, ac="full"), slow).seconds("ep all-to-all")
    assert recomputed == pytest.approx(within * 6 / 4)


def test_every_tp_rank_computes_the_routed_experts():
    one, two = (estimate_step(MOE, _layout(1, tp=tp), CLUSTER).seconds("compute") for tp in (1, 2))
    dense = describe_gpt(GPTShape(vocab_size=50257, context_length=2048, n_layer=LAYERS, n_head=16, d_model=D))
    dense_one, dense_two = (estimate_step(dense, _layout(1, tp=tp), CLUSTER).seconds("compute") for tp in (1, 2))
    assert dense_two == pytest.approx(dense_one / 2, rel=0.01)
    assert one / 2 < two < one


def test_layout_names_and_runs_ep():
    layout = _layout(4)
    assert layout.describe().endswith("ep=4") and "--parallel.ep=4" in layout.config_overrides()
    with pytest.raises(ValueError, match="ep=4 does not divide the sharded data-parallel degree dp_shard=1"):
        _layout(4, strategy="ddp")


def test_the_search_explores_ep_and_rejects_what_the_trainer_refuses():
    request = PlanRequest(global_batch=32, seq_len=2048, precision=PRECISIONS["bf16"], strategies=("fsdp3", "ddp"),
                          tp=(1,), pp=(1, 2), cp=(1, 2), ac=("none",), offload=(False,))
    result = plan(MOE, CLUSTER, request)
    degrees = {c.layout.ep for c in result.feasible}
    assert degrees == {1, 2, 4, 8, 16}
    assert all(c.layout.pp == 1 and c.layout.cp == 1 for c in result.feasible)
    reasons = {r.label: r.reason for r in result.rejected}
    assert "does not combine with pp=2" in reasons["fsdp dp=8 tp=1 pp=2"]
    assert "does not combine with cp=2" in reasons["fsdp dp=8 tp=1 pp=1 cp=2"]
    assert not any("ep=" in label and label.startswith("ddp") for label in reasons)  # not asked: not listed
    asked = plan(MOE, CLUSTER, PlanRequest(global_batch=32, seq_len=2048, precision=PRECISIONS["bf16"],
                                           strategies=("ddp",), tp=(1,), pp=(1,), ep=(2,), ac=("none",)))
    assert "needs fsdp" in {r.label: r.reason for r in asked.rejected}["ddp dp=16 tp=1 pp=1 ep=2"]


def test_what_the_planner_proposes_for_a_moe_model_the_trainer_accepts():
    small = describe_gpt(GPTShape(vocab_size=256, context_length=128, n_layer=4, n_head=4, d_model=128,
                                  moe=MoEShape(8, 2)), name="gpt-mini")
    cluster = make_cluster("h100", n_gpus=8, gpus_per_node=8)
    result = plan(small, cluster, PlanRequest(global_batch=16, seq_len=128, precision=PRECISIONS["bf16"],
                                              tp=(1, 2, 4), pp=(1, 2), ac=("none",), offload=(False,)))
    assert {c.layout.ep for c in result.feasible} >= {1, 2, 8} and {c.layout.tp for c in result.feasible} >= {2}
    for candidate in result.feasible:
        overrides = [o for o in candidate.layout.config_overrides()
                     if not o.startswith(("--nnodes", "--nproc", "--parallel.cpu_offload"))]
        config = load_config(None, ["--model.name=gpt-mini", "--model.moe_experts=8", "--data.source=random",
                                    "--data.random_tokens=20000", "--precision.dtype=fp32", *overrides])
        validate(config, 8)  # raises ConfigError with every problem where the trainer refuses it


def test_the_command_line_takes_experts_and_ep_degrees(capsys):
    assert run(["--model", "gpt-mini", "--moe-experts", "8", "--gpus", "8", "--seq-len", "256", "--ep", "2,8",
                "--strategy", "fsdp", "--tp", "1", "--pp", "1", "--explain", "1"]) == 0
    out = capsys.readouterr().out
    assert "8 experts a block (top-2" in out and "ep=8" in out and "ep all-to-all" in out
    assert run(["--model", "gpt-mini", "--gpus", "8", "--ep", "2"]) == 2
    assert "has none; give it experts with --moe-experts" in capsys.readouterr().err
    assert run(["--model", "gpt-mini", "--moe-experts", "8", "--moe-top-k", "9", "--gpus", "8"]) == 2
    assert "--moe-top-k 9 must be between 1 and the 8 experts" in capsys.readouterr().err
