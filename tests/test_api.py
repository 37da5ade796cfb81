"""End to end through ``meshyard.run``: what a run leaves in its directory."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest

import meshyard
from meshyard.config.load import load_config
from meshyard.metrics.records import read_metrics
from tests.conftest import tiny_config

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


# Half precision rounds each matmul result to 8 (bf16) or 11 (fp16) significant bits, a
# relative error of at most u = 2^-8 or 2^-11 per element. The loss and the gradient norm
# are a mean and a norm over thousands of elements whose rounding errors do not line up,
# so a few steps from the same start on the same samples stay within 2u of fp32 (measured
# on these runs: 1e-3 for bf16, 1e-4 for fp16 on the gradient norm, less on the loss).
UNIT_ROUNDOFF = {"bf16": 2.0 ** -8, "fp16": 2.0 ** -11}


def assert_close_to_fp32(records: list[dict], reference: list[dict], dtype: str) -> None:
    assert len(records) == len(reference)
    for got, want in zip(records, reference):
        for key in ("loss", "grad_norm"):
            assert got[key] == pytest.approx(want[key], rel=2 * UNIT_ROUNDOFF[dtype]), (key, got, want)
    # ... and not equal to it: the low precision was really computed in.
    assert any(got["grad_norm"] != want["grad_norm"] for got, want in zip(records, reference))


def fp32_reference(make_config, tmp_path, *overrides: str) -> list[dict]:
    """The same steps in fp32 on one process (layouts agree to 1e-5 in fp32, see tests/parallel)."""
    cfg = make_config("--precision.dtype=fp32", "--parallel.strategy=none", *overrides,
                      f"--run.run_dir={tmp_path / 'fp32'}")
    return meshyard.run(cfg, nproc=1).metrics()


LOW_PRECISION_SHAPE = ("--train.steps=3", "--model.d_model=32")


@pytest.fixture(scope="module")
def fp32_low_precision_reference(tmp_path_factory) -> list[dict]:
    """The fp32 run both half precisions are held against (the same job for each: run once)."""
    root = tmp_path_factory.mktemp("fp32_reference")
    return fp32_reference(lambda *overrides: tiny_config(root, *overrides), root, *LOW_PRECISION_SHAPE)


@pytest.mark.parametrize("dtype", ["bf16", "fp16"])
def test_low_precision_trains(make_config, fp32_low_precision_reference, dtype):
    cfg = make_config(f"--precision.dtype={dtype}", "--parallel.strategy=none", *LOW_PRECISION_SHAPE)
    result = meshyard.run(cfg, nproc=1)
    assert_close_to_fp32(result.metrics(), fp32_low_precision_reference, dtype)
    assert json.loads((result.run_dir / "run.json").read_text())["dtype"] == {"bf16": "bfloat16", "fp16": "float16"}[dtype]


def test_fp16_loss_scale_grows_and_backs_off(make_config):
    """With a growth interval of 1 the scale doubles after every clean step until fp16
    gradients overflow (at 2^20 here; by 2^24 at the latest, where a logit's gradient
    exceeds 65504); that step is reported as non-finite and the scale halves."""
    cfg = make_config("--precision.dtype=fp16", "--parallel.strategy=none", "--train.steps=10", "--model.d_model=32",
                      "--precision.loss_scale_growth_interval=1")
    records = meshyard.run(cfg, nproc=1).metrics()
    before = 2.0 ** 16  # GradScaler's initial scale
    for record in records:
        clean = math.isfinite(record["grad_norm"])
        assert record["loss_scale"] == (2 * before if clean else before / 2), record
        assert clean == ("nonfinite" not in record), record
        before = record["loss_scale"]
    assert {math.isfinite(r["grad_norm"]) for r in records} == {True, False}


def test_fsdp_bf16_mixed_precision_trains(make_config, tmp_path):
    shape = ("--train.steps=2", "--model.d_model=32")
    cfg = make_config("--precision.dtype=bf16", "--parallel.strategy=fsdp", *shape)
    records = meshyard.run(cfg, nproc=2).metrics()
    assert_close_to_fp32(records, fp32_reference(make_config, tmp_path, *shape), "bf16")


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
