"""The scale simulator: throughput and efficiency across cluster sizes, and its plot."""

from __future__ import annotations

from meshyard.models.gpt import GPTShape
from meshyard.plan.hardware import make_cluster
from meshyard.plan.layout import PRECISIONS
from meshyard.plan.model import describe_gpt
from meshyard.plan.scale import plot_scale, simulate_scale
from meshyard.plan.search import PlanRequest

GPT2 = describe_gpt(GPTShape(vocab_size=50257, context_length=1024, n_layer=12, n_head=12, d_model=768))
REQUEST = PlanRequest(global_batch=1024, seq_len=1024, precision=PRECISIONS["bf16"], strategies=("ddp",),
                      tp=(1,), pp=(1,))


def test_weak_scaling_grows_the_global_batch():
    result = simulate_scale(GPT2, make_cluster("h100", 8, 8, "ib-ndr-8x"), [8, 64, 512], REQUEST, per_rank_batch=4)
    assert result.mode == "fixed per-GPU batch"
    assert [p.global_batch for p in result.points] == [32, 256, 2048]
    assert result.points[0].efficiency == 1.0
    assert all(p.candidate is not None for p in result.points)


def test_sizes_the_layout_cannot_use_say_why():
    result = simulate_scale(GPT2, make_cluster("h100", 8, 8, "ib-ndr-8x"), [8, 4096], REQUEST)
    assert result.mode == "fixed global batch"
    assert result.points[1].candidate is None
    assert "not divisible by dp=4096" in result.points[1].reason


def test_plot_is_a_png(tmp_path):
    result = simulate_scale(GPT2, make_cluster("h100", 8, 8, "ib-ndr-8x"), [8, 64, 4096], REQUEST)
    path = plot_scale(result, tmp_path / "sub" / "scale.png", title="gpt2")
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
