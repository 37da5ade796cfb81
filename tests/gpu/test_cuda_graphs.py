"""train.cuda_graphs on a GPU: the compiled step replayed as CUDA graphs trains as without them."""

from __future__ import annotations

import json

import pytest

import meshyard

pytestmark = pytest.mark.gpu

# The graphs replay the kernels the compiled step launches; what differs is only where the
# allocator puts their tensors, so the losses agree far inside bf16's own tolerance.
GRAPHS_TOLERANCE = 1e-3
STEPS = 8


def _run(make_config, tmp_path, name: str, *overrides: str) -> tuple[list[dict], dict]:
    cfg = make_config("--run.device=cuda", "--precision.dtype=bf16", f"--train.steps={STEPS}", "--train.compile=true",
                      "--parallel.strategy=none", f"--run.run_dir={tmp_path / name}", *overrides)
    result = meshyard.run(cfg, nproc=1)
    return result.metrics(), json.loads((result.run_dir / "run.json").read_text())


def test_cuda_graphs_train_as_the_compiled_step_does(make_config, tmp_path, monkeypatch):
    # Inductor's own statistics and its graph manager: no public accessor for either.
    from torch._dynamo.utils import counters
    from torch._inductor import cudagraph_trees

    plain, _ = _run(make_config, tmp_path, "compiled")
    recordings = []
    record = cudagraph_trees.CUDAGraphTreeManager.record_function
    monkeypatch.setattr(cudagraph_trees.CUDAGraphTreeManager, "record_function",
                        lambda self, *args, **kwargs: recordings.append(1) or record(self, *args, **kwargs))
    # A region left out of the graphs whole bumps "cudagraph_skips"; one split into graphed
    # and ungraphed partitions (an op the graphs cannot hold), "cudagraph_partitions".
    before = {key: counters["inductor"][key] for key in ("cudagraph_skips", "cudagraph_partitions")}
    graphed, facts = _run(make_config, tmp_path, "graphed", "--train.cuda_graphs=true")
    assert facts["compiled"] == "the model and its loss (CUDA graphs)"
    assert {key: counters["inductor"][key] for key in before} == before, "Inductor left part of the step ungraphed"
    # Forward and backward recorded once each, then replayed: not recorded again every step.
    assert 1 <= len(recordings) <= 4, len(recordings)
    assert len(graphed) == len(plain) == STEPS
    for step, (reference, record_) in enumerate(zip(plain, graphed), start=1):
        assert abs(record_["loss"] - reference["loss"]) <= GRAPHS_TOLERANCE * abs(reference["loss"]), step
    assert graphed[2]["compiled_graphs"] == graphed[-1]["compiled_graphs"]  # and Dynamo compiled nothing new
