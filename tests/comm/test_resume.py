"""Compression state (error-feedback residuals, PowerSGD matrices) is in the checkpoint,
so a resumed run continues exactly where an uninterrupted one would be."""

from __future__ import annotations

import pytest

import meshyard
from meshyard.checkpoint.tools import read_full_state, resolve
from tests.conftest import tiny_config

STEPS, HALF = 8, 4


@pytest.mark.parametrize("method", ["topk", "powersgd"])
def test_resume_with_compression_state_is_exact(tmp_path, method):
    common = [f"--comm.compression={method}", "--comm.warmup_steps=2", "--comm.topk_ratio=0.05",
              "--optim.schedule=constant", "--train.deterministic=true", "--checkpoint.enabled=true",
              "--checkpoint.interval=0", "--checkpoint.async_save=false"]
    whole = meshyard.run(tiny_config(tmp_path / "whole", *common, f"--train.steps={STEPS}"), nproc=2).metrics()
    first = meshyard.run(tiny_config(tmp_path / "first", *common, f"--train.steps={HALF}"), nproc=2)
    second = meshyard.run(tiny_config(tmp_path / "second", *common, f"--train.steps={STEPS}"), nproc=2,
                          resume=str(first.run_dir))
    resumed = second.metrics()
    assert [r["step"] for r in resumed] == list(range(HALF + 1, STEPS + 1))
    assert [r["loss"] for r in resumed] == [r["loss"] for r in whole[HALF:]]
    assert all(r["compression_ratio"] > 1 for r in resumed)
    keys = read_full_state(resolve(str(first.run_dir), {})).keys()
    assert {"comm.rank0", "comm.rank1"} <= set(keys)
