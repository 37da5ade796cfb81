"""Numerics on a GPU: bf16 autocast against fp32, and bit-reproducible deterministic runs."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

import meshyard
from meshyard.config.dump import config_to_toml
from meshyard.metrics.records import read_metrics

pytestmark = pytest.mark.gpu

# bf16 keeps 8 significant bits (a relative rounding error of 2^-9, about 0.2 %) and the
# loss itself is computed in fp32 from bf16 logits; over eight steps, in which the two
# runs' weights drift apart slightly, every loss stays within 1 % of fp32's.
BF16_TOLERANCE = 0.01


def _losses(make_config, tmp_path, dtype: str) -> list[float]:
    cfg = make_config("--run.device=cuda", f"--precision.dtype={dtype}", "--train.steps=8",
                      f"--run.run_dir={tmp_path / dtype}")
    result = meshyard.run(cfg, nproc=1)
    expected = {"bf16": "bfloat16", "fp32": "float32"}[dtype]
    assert json.loads((result.run_dir / "run.json").read_text())["dtype"] == expected
    return [record["loss"] for record in result.metrics()]


def test_bf16_autocast_loss_matches_fp32(make_config, tmp_path):
    fp32, bf16 = _losses(make_config, tmp_path, "fp32"), _losses(make_config, tmp_path, "bf16")
    assert len(fp32) == len(bf16) == 8
    for step, (reference, low) in enumerate(zip(fp32, bf16), start=1):
        assert abs(low - reference) <= BF16_TOLERANCE * abs(reference), (step, reference, low)
    assert fp32 != bf16  # bf16 really computed something else


def _deterministic_run(make_config, tmp_path, name: str) -> list[float]:
    """A fresh process without CUBLAS_WORKSPACE_CONFIG, as a user starts one: meshyard
    must set it before CUDA starts, or PyTorch refuses cuBLAS in deterministic mode."""
    cfg = make_config("--run.device=cuda", "--train.deterministic=true", "--train.steps=5",
                      f"--run.run_dir={tmp_path / name}")
    path = tmp_path / f"{name}.toml"
    path.write_text(config_to_toml(cfg))
    env = {key: value for key, value in os.environ.items() if key != "CUBLAS_WORKSPACE_CONFIG"}
    proc = subprocess.run([sys.executable, "-m", "meshyard.cli", "run", str(path), "--nproc=1"],
                          env=env, capture_output=True, text=True, timeout=540)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return [record["loss"] for record in read_metrics(tmp_path / name)]


def test_deterministic_cuda_runs_are_bit_identical(make_config, tmp_path):
    first = _deterministic_run(make_config, tmp_path, "first")
    assert len(first) == 5
    assert _deterministic_run(make_config, tmp_path, "second") == first


def test_the_fused_head_loss_trains_as_the_logits_do_in_bf16(make_config, tmp_path):
    """train.fused_linear_loss on CUDA in bf16: blocks of at least 4096 rows there (here
    fewer tokens than that: one block), losses within bf16's tolerance of the logits' path."""
    plain = _losses(make_config, tmp_path, "bf16")
    cfg = make_config("--run.device=cuda", "--precision.dtype=bf16", "--train.steps=8",
                      "--train.fused_linear_loss=true", f"--run.run_dir={tmp_path / 'fused'}")
    fused = [record["loss"] for record in meshyard.run(cfg, nproc=1).metrics()]
    assert len(fused) == 8
    for step, (reference, value) in enumerate(zip(plain, fused), start=1):
        assert abs(value - reference) <= BF16_TOLERANCE * abs(reference), (step, reference, value)
