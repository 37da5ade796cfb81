"""The planner: feasible layouts ranked by speed, every rejection with its reason."""

from __future__ import annotations

from dataclasses import replace

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


def test_the_fused_loss_is_offered_only_with_tp_and_pp_1():
    """--fused-loss on: the families with tp or pp > 1 cannot run it and say so; auto
    (the default) plans them with the plain loss."""
    cluster = make_cluster("h100", 8, 8, "ib-ndr-8x")
    request = _request(global_batch=64, seq_len=1024, strategies=("fsdp3",), tp=(1, 2), pp=(1, 2))
    on = plan(GPT2, cluster, replace(request, fused_loss=(True,)))
    assert [(c.layout.tp, c.layout.pp, c.layout.fused_loss) for c in on.feasible] == [(1, 1, True)]
    reasons = " | ".join(r.reason for r in on.rejected)
    assert "the fused loss does not combine with tp=2" in reasons and "with pp=2" in reasons
    auto = plan(GPT2, cluster, request)
    assert len(auto.feasible) == 4 and not any(c.layout.fused_loss for c in auto.feasible)


def test_the_fused_loss_is_offered_only_for_meshyards_gpt():
    """A model whose forward returns logits (a traced custom module) keeps the plain loss."""
    logits_only = replace(GPT2, name="custom", fuses_head_loss=False)
    request = _request(global_batch=8, seq_len=1024, strategies=("none",), tp=(1,), pp=(1,), fused_loss=(True,))
    result = plan(logits_only, make_cluster("h100", 1, 8, "ib-ndr-8x"), request)
    assert not result.feasible
    assert "the fused loss needs meshyard's GPT" in result.rejected[0].reason


def _one_gpu(memory: float):
    return make_cluster("h100", 1, 8, "ib-ndr-8x", memory=memory)


def test_the_fused_loss_is_picked_where_it_makes_the_layout_fit():
    """GPT-2 at 16 x 1024 tokens a micro-batch: the plain loss's 9.9 GB do not fit in 14 GB
    (12.6 usable), the fused loss's 1.9 GB (blocks of 4096 rows on a GPU) do; with the plain
    loss forced, nothing fits."""
    request = _request(global_batch=16, seq_len=1024, strategies=("none",), tp=(1,), pp=(1,), ac=("none",),
                       offload=(False,), micro_batches=(16,))
    result = plan(GPT2, _one_gpu(14e9), request)
    (only,) = result.feasible
    assert only.layout.fused_loss and only.memory.item("loss") < 2e9
    assert "--train.fused_linear_loss=true" in only.layout.config_overrides()
    plain = plan(GPT2, _one_gpu(14e9), replace(request, fused_loss=(False,)))
    assert not plain.feasible and "loss 9.88 GB" in plain.rejected[0].reason


def test_the_plain_loss_is_kept_where_both_fit():
    """Same speed, the fused loss for memory alone: the plain loss wins the tie."""
    request = _request(global_batch=16, seq_len=1024, strategies=("none",), tp=(1,), pp=(1,), ac=("none",),
                       offload=(False,), micro_batches=(16,))
    (only,) = plan(GPT2, _one_gpu(80e9), request).feasible
    assert not only.layout.fused_loss
