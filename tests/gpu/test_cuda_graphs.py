"""train.cuda_graphs on a GPU: the compiled step replayed as CUDA graphs trains as without them."""

from __future__ import annotations

import json

import pytest

import meshyard

pytestmark = pytest.mark.gpu

# The graphs replay the kernels the compiled step launches; what differs is only where the
# allocator puts their tensors, so the losses agree far inside bf16's own tolerance.
GRAPHS_TOLERANCE = 1e-3


def _run(make_config, tmp_path, name: str, *overrides: str) -> tuple[list[dict], dict]:
    cfg = make_config("--run.device=cuda", "--precision.dtype=bf16", "--train.steps=8", "--train.compile=true",
                      "--parallel.strategy=none", f"--run.run_dir={tmp_path / name}", *overrides)
    result = meshyard.run(cfg, nproc=1)
    return result.metrics(), json.loads((result.run_dir / "run.json").read_text())


def test_cuda_graphs_train_as_the_compiled_step_does(make_config, tmp_path):
    from torch._dynamo.utils import counters  # Inductor's own statistics; no public accessor

    plain, _ = _run(make_config, tmp_path, "compiled")
    skips_before = counters["inductor"]["cudagraph_skips"]
    graphed, facts = _run(make_config, tmp_path, "graphed", "--train.cuda_graphs=true")
    assert facts["compiled"] == "the model and its loss (CUDA graphs)"
    assert counters["inductor"]["cudagraph_skips"] == skips_before, "Inductor ran the region without graphs"
    assert len(graphed) == len(plain) == 8
    for step, (reference, record) in enumerate(zip(plain, graphed), start=1):
        assert abs(record["loss"] - reference["loss"]) <= GRAPHS_TOLERANCE * abs(reference["loss"]), step
    # Recorded once, then replayed: no graph compiled after the first steps.
    assert graphed[2]["compiled_graphs"] == graphed[-1]["compiled_graphs"]
