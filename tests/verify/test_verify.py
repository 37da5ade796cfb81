"""``meshyard verify``: PASS for a correct layout, FAIL for a broken one, 2 for bad input."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

import meshyard
from meshyard.cli import main
from meshyard.validate import load_and_validate
from meshyard.config.sections import PrecisionConfig, RunConfig
from meshyard.verify import VerifyReport, tolerance_for
from meshyard.verify.compare import _for_comparison, compare_runs, describe_layout, dropout_notes, single_process
from tests.conftest import tiny_config
from tests.inprocess import fit_on_ranks
from tests.pipeline_masks import can_train, skip_unless_trainable

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


USERS_LAYOUTS = {
    "nanogpt-fsdp": ("nanogpt", ["--parallel.strategy=fsdp"]),
    "hf_llama-tp2": ("hf_llama", ["--parallel.strategy=none", "--parallel.tp=2"]),
    "hf_gpt2-pp2": ("hf_gpt2", ["--parallel.strategy=none", "--parallel.pp=2"]),
    "hf_opt-fsdp": ("hf_opt", ["--parallel.strategy=fsdp"]),  # its default dropout 0.1 left on
}
USERS_STEPS = 2


@pytest.fixture(scope="module")
def users_reports(tmp_path_factory) -> dict[str, VerifyReport]:
    """``meshyard verify``'s two runs and comparison for each user model: the configs the
    command makes from the same arguments (``--nproc 2 --steps 2``), the one-process run
    as the command runs it, and the three layout runs in one spawn of 2 ranks rather than
    a launch each (the command itself is run by the tests around this one)."""
    root = tmp_path_factory.mktemp("users")
    has_transformers = importlib.util.find_spec("transformers") is not None
    wanted = {case: spec for case, spec in USERS_LAYOUTS.items()
              if (has_transformers or not spec[0].startswith("hf_")) and can_train(*spec)}
    reports, layout_runs = {}, []
    for case, (model, layout) in wanted.items():
        config, checked = load_and_validate(None, [*TINY, f"--model.name={USER_MODELS}:{model}", *layout,
                                                   "--run.nproc=2", f"--data.cache_dir={root / 'cache'}"])
        precision, tolerance = tolerance_for(config.run, config.precision)
        reports[case] = VerifyReport(precision, tolerance, describe_layout(config.parallel, 2, checked.dims),
                                     notes=dropout_notes(config))
        single = _for_comparison(single_process(config, checked.batch.micro_batch), USERS_STEPS, root / case / "single")
        meshyard.run(single, nproc=1, resume="none")
        layout_runs.append(_for_comparison(config, USERS_STEPS, root / case / "layout"))
    fit_on_ranks(layout_runs, world_size=2)
    return {case: compare_runs(root / case / "single", root / case / "layout", report)
            for case, report in reports.items()}


@pytest.mark.parametrize("case", list(USERS_LAYOUTS))
def test_users_models_pass(users_reports, case):
    """Models meshyard has never seen (nanoGPT-style, Hugging Face GPT-2 and Llama) train
    the same under FSDP, tensor and pipeline parallelism as on one process: the verdict
    ``meshyard verify`` prints, over both runs."""
    if USERS_LAYOUTS[case][0].startswith("hf_"):
        pytest.importorskip("transformers")
    skip_unless_trainable(*USERS_LAYOUTS[case])
    report = users_reports[case]
    assert report.passed and not report.missing, report.format()
    assert len(report.steps) == USERS_STEPS and "PASS" in report.format()


def test_a_model_s_own_dropout_is_switched_off_and_said_so(users_reports):
    """OPT applies dropout 0.1 (rates its layers hold, not nn.Dropout modules): masks drawn
    per layout would fail the comparison with nothing saying why. Switched off in both
    runs, it passes, and the report names what was switched off."""
    pytest.importorskip("transformers")
    report = users_reports["hf_opt-fsdp"]
    text = report.format()
    assert report.passed, text
    assert ("dropout switched off in both runs: model.decoder.dropout = 0.1, model.decoder.layers.*.dropout = 0.1"
            in text)
    assert not users_reports["hf_llama-tp2"].notes  # no dropout on: nothing said


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
    name, fp32 = tolerance_for(RunConfig(), PrecisionConfig(dtype="fp32"))
    assert name == "fp32" and fp32.loss_rel == 1e-5
    _, bf16 = tolerance_for(RunConfig(), PrecisionConfig(dtype="bf16"))
    assert bf16.loss_rel > fp32.loss_rel and bf16.param_abs > fp32.param_abs


def test_report_fails_on_any_threshold(tmp_path):
    _, tol = tolerance_for(RunConfig(), PrecisionConfig(dtype="fp32"))
    step = {"step": 1, "loss_single": 2.0, "loss_layout": 2.0, "loss_rel": 0.0, "grad_norm_rel": 0.0}
    assert VerifyReport("fp32", tol, "x", steps=[step]).passed
    assert not VerifyReport("fp32", tol, "x", steps=[{**step, "loss_rel": 1e-3}]).passed
    assert not VerifyReport("fp32", tol, "x", steps=[step], max_param_diff=1.0).passed
    assert not VerifyReport("fp32", tol, "x", steps=[step], missing=["blocks.0.attn.qkv.weight"]).passed


def test_randomness_beyond_dropout_is_said_not_hidden(tmp_path):
    from meshyard.verify.compare import randomness_notes

    noisy = tiny_config(tmp_path, "--model.name=tests/verify/noisy_model.py:build")
    [note] = randomness_notes(noisy)
    assert note.startswith("the model's forward is random in training even with dropout off")
    assert randomness_notes(tiny_config(tmp_path, "--model.dropout=0.1")) == []  # dropout alone: switched off
