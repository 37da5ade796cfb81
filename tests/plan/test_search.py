"""The planner: feasible layouts ranked by speed, every rejection with its reason."""

from __future__ import annotations

from meshyard.models.gpt import GPTShape
from meshyard.plan.hardware import make_cluster
from meshyard.plan.layout import PRECISIONS
from meshyard.plan.model import describe_gpt
from meshyard.plan.search import PlanRequest, plan

GPT_7B = describe_gpt(GPTShape(vocab_size=50257, context_length=4096, n_layer=32, n_head=32, d_model=4096))
GPT2 = describe_gpt(GPTShape(vocab_size=50257, context_length=1024, n_layer=12, n_head=12, d_model=768))


def _request(**kwargs) -> PlanRequest:
    base = dict(global_batch=256, seq_len=4096, precision=PRECISIONS["bf16"])
    return PlanRequest(**{**base, **kwargs})


def test_7b_on_eight_40gb_gpus_needs_sharding():
    """16 bytes/param x 6.7B = 107 GB of model states: DDP and ZeRO-1 cannot fit in
    40 GB; ZeRO-3 (16 Psi / 8 = 13 GB) can."""
    result = plan(GPT_7B, make_cluster("a100-40gb", 8, 8, "ib-hdr-8x"), _request(tp=(1,), pp=(1,)))
    feasible = {c.layout.strategy for c in result.feasible}
    rejected = {r.label.split()[0]: r.reason for r in result.rejected}
    assert "fsdp3" in feasible
    assert "ddp" in rejected and "zero1" in rejected
    assert rejected["ddp"].startswith("out of memory") and "optimizer states" in rejected["ddp"]
    for cand in result.feasible:
        assert cand.memory.peak_bytes <= result.usable_bytes


def test_ranked_fastest_first_and_one_entry_per_family():
    result = plan(GPT_7B, make_cluster("h100", 64, 8, "ib-ndr-8x"), _request())
    speeds = [c.step.tokens_per_second for c in result.feasible]
    assert speeds == sorted(speeds, reverse=True)
    families = [(c.layout.strategy, c.layout.tp, c.layout.pp) for c in result.feasible]
    assert len(families) == len(set(families))
    assert result.feasible[0].step.mfu > 0.3


def test_structural_rejections_explain_themselves():
    result = plan(GPT2, make_cluster("h100", 16, 8, "ib-ndr-8x"), _request(seq_len=1024, tp=(1, 8, 16), pp=(1, 16)))
    reasons = " | ".join(r.reason for r in result.rejected)
    assert "n_head=12 is not divisible by tp=8" in reasons
    assert "tp=16 spans nodes" in reasons
    assert "pp=16 exceeds the 12 layers" in reasons


def test_batch_that_does_not_split_is_rejected():
    result = plan(GPT2, make_cluster("h100", 8, 8, "ib-ndr-8x"), _request(seq_len=1024, global_batch=12,
                                                                          strategies=("ddp",), tp=(1,), pp=(1,)))
    assert not result.feasible
    assert "global batch 12 is not divisible by dp=8" in result.rejected[0].reason


def test_nothing_fits_reports_the_smallest_attempt():
    result = plan(GPT_7B, make_cluster("l4", 8, 8, "eth-100g"), _request(strategies=("ddp",), tp=(1,), pp=(1,)))
    assert not result.feasible
    assert "even with micro-batch 1, ac=full" in result.rejected[0].reason


def test_filters_restrict_the_search():
    request = _request(seq_len=1024, strategies=("fsdp3",), tp=(1,), pp=(1,), ac=("full",), offload=(False,),
                       micro_batches=(2,))
    result = plan(GPT2, make_cluster("h100", 8, 8, "ib-ndr-8x"), request)
    (only,) = result.feasible
    assert (only.layout.strategy, only.layout.ac, only.layout.micro_batch, only.layout.grad_accum) == \
        ("fsdp3", "full", 2, 16)


def test_the_planner_offers_zero1_only_where_the_trainer_runs_it():
    result = plan(GPT2, make_cluster("h100", 8, 8, "ib-ndr-8x"), _request(global_batch=64, seq_len=1024,
                                                                          strategies=("zero1",)))
    assert result.feasible and all((c.layout.tp, c.layout.pp) == (1, 1) for c in result.feasible)
    assert any("zero1 runs without tensor and pipeline parallelism" in r.reason for r in result.rejected)
