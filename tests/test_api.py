"""End to end through ``meshyard.run``: what a run leaves in its directory."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

import meshyard
from meshyard.config.load import load_config
from meshyard.metrics.records import read_metrics

REPO = Path(__file__).resolve().parents[1]


def test_two_workers_on_stdlib_learn_and_record_everything(make_config):
    cfg = make_config("--data.source=stdlib", "--data.max_tokens=2000000", "--train.steps=30",
                      "--train.eval_every=15", "--train.global_batch=16", "--optim.lr=3e-3",
                      "--optim.warmup_steps=5", "--model.name=gpt-tiny")
    result = meshyard.run(cfg, nproc=2)
    run_dir = result.run_dir
    # The resolved config reloads to the same object.
    assert load_config(run_dir / "config.toml") == cfg
    records = read_metrics(run_dir)
    assert [r["step"] for r in records] == list(range(1, 31))
    first, last = records[0]["loss"], records[-1]["loss"]
    assert first > 5.0 and last < 0.75 * first, (first, last)  # ln(256) = 5.55 at start
    assert [r["step"] for r in records if "eval_loss" in r] == [15, 30]
    for key in ("lr", "grad_norm", "step_time_s", "data_time_s", "tokens_per_s", "samples_per_s", "tokens_seen"):
        assert all(key in r for r in records), key
    assert records[-1]["tokens_seen"] == 30 * 16 * 32
    for rank in (0, 1):
        log = (run_dir / "logs" / f"rank{rank}.log").read_text()
        assert "step 30 local_loss" in log
    facts = json.loads((run_dir / "run.json").read_text())
    assert facts["world_size"] == 2 and facts["strategy"] == "ddp" and facts["backend"] == "gloo"
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary == json.loads(json.dumps(result.summary))
    assert summary["final_loss"] == last and summary["steps"] == 30


def test_single_process_custom_model_and_dataset(make_config):
    cfg = make_config("--model.name=examples/custom_model.py:build_model", "--model.options={hidden = 32}",
                      "--data.source=examples/custom_model.py:build_dataset", "--train.steps=25",
                      "--optim.lr=1e-2", "--train.eval_every=25", "--parallel.strategy=none")
    cwd = os.getcwd()
    os.chdir(REPO)
    try:
        result = meshyard.run(cfg, nproc=1)
    finally:
        os.chdir(cwd)
    records = result.metrics()
    assert records[-1]["loss"] < 0.5 * records[0]["loss"]
    assert "eval_loss" in records[-1]


@pytest.mark.parametrize("dtype", ["bf16", "fp16"])
def test_low_precision_trains(make_config, dtype):
    cfg = make_config(f"--precision.dtype={dtype}", "--parallel.strategy=none", "--train.steps=3",
                      "--model.d_model=32")
    result = meshyard.run(cfg, nproc=1)
    losses = [r["loss"] for r in result.metrics()]
    assert all(0 < loss < 10 for loss in losses)
    assert json.loads((result.run_dir / "run.json").read_text())["dtype"] == {"bf16": "bfloat16", "fp16": "float16"}[dtype]


def test_fsdp_bf16_mixed_precision_trains(make_config):
    cfg = make_config("--precision.dtype=bf16", "--parallel.strategy=fsdp", "--train.steps=2", "--model.d_model=32")
    losses = [r["loss"] for r in meshyard.run(cfg, nproc=2).metrics()]
    assert len(losses) == 2 and all(0 < loss < 10 for loss in losses)


def test_inside_torchrun_the_process_is_a_rank(tmp_path):
    """Under torchrun (as under Slurm or Kubeflow) meshyard runs the worker directly."""
    run_dir = tmp_path / "run"
    cmd = [
        sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2",
        "-m", "meshyard.cli", "run", "--run.nproc=5",  # ignored: the world size is torchrun's
        "--model.name=gpt-tiny", "--data.source=random", "--data.seq_len=16", "--train.steps=3",
        "--train.global_batch=4", "--train.eval_every=0", f"--run.run_dir={run_dir}",
        f"--data.cache_dir={tmp_path}",
    ]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300,
                          env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert len(read_metrics(run_dir)) == 3
    facts = json.loads((run_dir / "run.json").read_text())
    assert facts["world_size"] == 2
    assert sorted(p.name for p in (run_dir / "logs").iterdir()) == ["rank0.log", "rank1.log"]


def test_worker_failure_is_reported_with_rank(make_config, tmp_path):
    bad = tmp_path / "broken.py"
    bad.write_text("def build(vocab_size):\n    raise RuntimeError('boom in the model builder')\n")
    cfg = make_config(f"--model.name={bad}:build")
    with pytest.raises(meshyard.api.WorkerFailure, match="boom in the model builder"):
        meshyard.run(cfg, nproc=2)
