"""``meshyard verify``: PASS for a correct layout, FAIL for a broken one, 2 for bad input."""

from __future__ import annotations

from pathlib import Path

import pytest

from meshyard.cli import main
from meshyard.verify import VerifyReport, tolerance_for
from tests.conftest import tiny_config

TINY = ["--model.name=gpt-tiny", "--data.source=random", "--data.seq_len=32", "--data.random_tokens=65536",
        "--train.global_batch=8", "--optim.warmup_steps=2", "--metrics.progress_bar=false"]


def test_pipeline_layout_passes(tmp_path, capsys):
    code = main(["verify", *TINY, "--parallel.strategy=none", "--parallel.pp=2", "--parallel.pp_schedule=1f1b",
                 "--nproc", "2", "--steps", "3", f"--data.cache_dir={tmp_path}", "--workdir", str(tmp_path / "v")])
    out = capsys.readouterr().out
    assert code == 0, out
    assert "PASS" in out and "max parameter difference" in out
    assert out.count("\n    ") >= 3  # one table row per step


USER_MODELS = Path(__file__).resolve().parents[1] / "models" / "user_models.py"


@pytest.mark.parametrize("model, layout", [
    ("nanogpt", ["--parallel.strategy=fsdp"]),
    ("hf_llama", ["--parallel.strategy=none", "--parallel.tp=2"]),
    ("hf_gpt2", ["--parallel.strategy=none", "--parallel.pp=2"]),
], ids=["nanogpt-fsdp", "hf_llama-tp2", "hf_gpt2-pp2"])
def test_users_models_pass(tmp_path, capsys, model, layout):
    """Models meshyard has never seen (nanoGPT-style, Hugging Face GPT-2 and Llama),
    through the real command: both runs, the table and the verdict."""
    if model.startswith("hf_"):
        pytest.importorskip("transformers")
    code = main(["verify", *TINY, f"--model.name={USER_MODELS}:{model}", *layout, "--nproc", "2", "--steps", "2",
                 f"--data.cache_dir={tmp_path}"])
    out = capsys.readouterr().out
    assert code == 0, out
    assert "PASS" in out and "missing" not in out


def test_mis_split_qkv_fails(tmp_path, capsys):
    code = main(["verify", *TINY, "--model.name=tests/verify/broken_model.py:build", "--parallel.strategy=none",
                 "--parallel.tp=2", "--nproc", "2", "--steps", "2", f"--data.cache_dir={tmp_path}"])
    out = capsys.readouterr().out
    assert code == 1, out
    assert "FAIL" in out


def test_bad_input_exits_2(tmp_path, capsys):
    assert main(["verify", *TINY, "--parallel.tp=3", "--nproc", "2"]) == 2
    assert main(["verify", *TINY, "--steps", "0"]) == 2


def test_tolerance_follows_precision(tmp_path):
    name, fp32 = tolerance_for(tiny_config(tmp_path, "--precision.dtype=fp32"))
    assert name == "fp32" and fp32.loss_rel == 1e-5
    _, bf16 = tolerance_for(tiny_config(tmp_path, "--precision.dtype=bf16"))
    assert bf16.loss_rel > fp32.loss_rel and bf16.param_abs > fp32.param_abs


def test_report_fails_on_any_threshold(tmp_path):
    _, tol = tolerance_for(tiny_config(tmp_path, "--precision.dtype=fp32"))
    step = {"step": 1, "loss_single": 2.0, "loss_layout": 2.0, "loss_rel": 0.0, "grad_norm_rel": 0.0}
    assert VerifyReport("fp32", tol, "x", steps=[step]).passed
    assert not VerifyReport("fp32", tol, "x", steps=[{**step, "loss_rel": 1e-3}]).passed
    assert not VerifyReport("fp32", tol, "x", steps=[step], max_param_diff=1.0).passed
    assert not VerifyReport("fp32", tol, "x", steps=[step], missing=["blocks.0.attn.qkv.weight"]).passed
