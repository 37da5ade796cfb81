"""The planner under context parallelism: a long sequence's activations fall about 1/cp,
the ring's transfers are a term of the step time, and the search explores the cp degrees asked."""

from __future__ import annotations

import pytest

from meshyard.models.gpt import GPTShape
from meshyard.plan.cost import estimate_step
from meshyard.plan.hardware import make_cluster
from meshyard.plan.layout import PRECISIONS, make_layout
from meshyard.plan.memory import estimate_memory
from meshyard.plan.model import describe_gpt
from meshyard.plan.search import PlanRequest, plan

SEQ = 32768
LONG = describe_gpt(GPTShape(vocab_size=50257, context_length=SEQ, n_layer=12, n_head=12, d_model=768))


def _layout(cp: int, n: int = 8, **kwargs):
    return make_layout("fsdp3", n, cp=cp, micro_batch=1, seq_len=SEQ, precision=PRECISIONS["bf16"], **kwargs)


@pytest.mark.parametrize("cp", [2, 4, 8])
def test_activations_of_a_long_sequence_fall_about_one_over_cp(cp):
    whole, split = estimate_memory(LONG, _layout(1)), estimate_memory(LONG, _layout(cp))
    ratio = split.item("activations") / whole.item("activations")
    assert ratio == pytest.approx(1 / cp, rel=0.01)
    assert split.item("loss") == pytest.approx(whole.item("loss") / cp)
    assert split.item("cp ring") > 0 and whole.item("cp ring") == 0
    assert split.peak_bytes < whole.peak_bytes


def test_cp_ranks_shard_the_model_states_and_are_not_data_parallel():
    layout = _layout(4)
    assert (layout.dp, layout.cp, layout.shard_degree, layout.world_size) == (2, 4, 8, 8)
    assert layout.tokens_per_micro_batch == SEQ // 4
    assert "--parallel.cp=4" in layout.config_overrides() and layout.describe().endswith("cp=4")


def test_the_ring_is_a_term_of_the_step_and_costs_more_across_nodes():
    one_node = make_cluster("h100", n_gpus=8, gpus_per_node=8, interconnect="ib-ndr-8x", inter_bandwidth=1e9)
    two_nodes = make_cluster("h100", n_gpus=8, gpus_per_node=4, interconnect="ib-ndr-8x", inter_bandwidth=1e9)
    within, across = (estimate_step(LONG, _layout(8), cluster) for cluster in (one_node, two_nodes))
    assert across.seconds("cp ring") > within.seconds("cp ring") >= 0
    assert "cp ring" in [item.name for item in across.items]
    # Without cp no ring; with it each rank computes 1/cp of the tokens.
    plain = estimate_step(LONG, _layout(1), one_node)
    assert plain.seconds("cp ring") == 0
    assert within.seconds("compute") == pytest.approx(plain.seconds("compute") / 8, rel=0.01)


def test_the_search_explores_the_cp_degrees_asked_and_rejects_what_cp_cannot_combine_with():
    cluster = make_cluster("h100", n_gpus=8, gpus_per_node=8)
    result = plan(LONG, cluster, PlanRequest(global_batch=8, seq_len=SEQ, precision=PRECISIONS["bf16"],
                                             strategies=("fsdp3", "zero1"), tp=(1,), pp=(1,), cp=(1, 2, 8),
                                             ac=("none",), offload=(False,)))
    labels = {c.layout.describe() for c in result.feasible} | {r.label for r in result.rejected}
    assert "fsdp dp=1 tp=1 pp=1 cp=8" in labels and "fsdp dp=4 tp=1 pp=1 cp=2" in labels
    zero1 = [r for r in result.rejected if r.label.startswith("zero1") and "cp=2" in r.label]
    assert zero1 and "ddp or fsdp" in zero1[0].reason
