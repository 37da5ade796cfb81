"""Optional extras: a feature whose package is missing names the extra to install (exit 2).

A package is made missing by setting ``sys.modules[name] = None``, which makes importing
it fail exactly as an absent install does.
"""

from __future__ import annotations

import subprocess
import sys

import pytest

from meshyard.cli import main
from meshyard.extras import EXTRAS, MissingExtra, require

BAD_INPUT = 2


def block(monkeypatch: pytest.MonkeyPatch, *modules: str) -> None:
    for name in modules:
        monkeypatch.setitem(sys.modules, name, None)


def assert_names_extra(err: str, extra: str) -> None:
    assert f"pip install 'meshyard[{extra}]'" in err, err
    assert "Traceback" not in err


@pytest.mark.parametrize("override, module, extra", [
    ("--metrics.prometheus=true", "prometheus_client", "prometheus"),
    ("--metrics.tensorboard=true", "tensorboard", "tensorboard"),
    ("--metrics.wandb=true", "wandb", "wandb"),
    ("--checkpoint.dir=s3://bucket/ckpt", "s3fs", "s3"),
])
def test_run_asking_for_a_missing_extra_exits_2_before_starting(override, module, extra, monkeypatch, capsys,
                                                                 tmp_path):
    block(monkeypatch, module)
    assert main(["run", "--nproc=1", override, f"--run.dir={tmp_path / 'runs'}"]) == BAD_INPUT
    err = capsys.readouterr().err
    assert_names_extra(err, extra)
    assert override.removeprefix("--").split("=")[0] in err
    assert not (tmp_path / "runs").exists()


def test_unclaimed_storage_protocol_is_reported_before_starting(capsys, tmp_path):
    assert main(["run", "--nproc=1", "--checkpoint.dir=nosuchproto://bucket/x", f"--run.dir={tmp_path}"]) == 2
    assert "fsspec knows no storage protocol 'nosuchproto://'" in capsys.readouterr().err


def test_report_without_matplotlib_names_the_report_extra(monkeypatch, capsys, tmp_path):
    block(monkeypatch, "matplotlib", "matplotlib.pyplot")
    monkeypatch.delitem(sys.modules, "meshyard.doctor.report", raising=False)  # import it afresh
    assert main(["report", str(tmp_path)]) == BAD_INPUT
    assert_names_extra(capsys.readouterr().err, "report")


def test_plan_scale_plot_without_matplotlib_names_the_report_extra(monkeypatch, capsys, tmp_path):
    block(monkeypatch, "matplotlib")
    out = tmp_path / "scale.png"
    assert main(["plan", "--model", "gpt2-124m", "--scale", "8,64", "--out", str(out)]) == BAD_INPUT
    assert_names_extra(capsys.readouterr().err, "report")
    assert not out.exists()


def test_bench_without_matplotlib_stops_before_measuring(monkeypatch, capsys, tmp_path):
    block(monkeypatch, "matplotlib")
    assert main(["bench", "comm", "--out", str(tmp_path / "bench")]) == BAD_INPUT
    assert_names_extra(capsys.readouterr().err, "report")
    assert not (tmp_path / "bench").exists()


def test_require_names_the_distribution_and_extra(monkeypatch):
    block(monkeypatch, "prometheus_client")
    with pytest.raises(MissingExtra, match=r"needs the 'prometheus-client' package.*meshyard\[prometheus\]"):
        require("prometheus_client", "metrics.prometheus = true")


def test_every_extra_is_in_the_test_extra():
    """The suite exercises every optional feature, so installing '.[test]' must bring them all."""
    from pathlib import Path

    from meshyard.config.load import tomllib

    project = tomllib.loads((Path(__file__).resolve().parents[1] / "pyproject.toml").read_text())["project"]
    test_extra = " ".join(project["optional-dependencies"]["test"])
    core = " ".join(project["dependencies"])
    for extra, distribution in EXTRAS.values():
        assert distribution in " ".join(project["optional-dependencies"][extra]) and distribution in test_extra
        assert distribution not in core
    assert "torchdata" not in core


def test_core_install_trains_without_any_optional_package(tmp_path):
    """The default job needs none of the extras: train a few steps with all of them missing."""
    blocked = [*EXTRAS, "torchdata"]
    code = (f"import sys; sys.modules.update(dict.fromkeys({blocked!r})); "
            "from meshyard.cli import main; sys.exit(main(sys.argv[1:]))")
    proc = subprocess.run(
        [sys.executable, "-c", code, "run", "--nproc=1", "--model.name=gpt-tiny", "--data.source=random",
         "--data.seq_len=16", "--train.steps=2", "--train.global_batch=4", "--train.eval_every=0",
         "--metrics.progress_bar=false", f"--run.run_dir={tmp_path / 'run'}", f"--data.cache_dir={tmp_path}"],
        capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert (tmp_path / "run" / "summary.json").exists()
