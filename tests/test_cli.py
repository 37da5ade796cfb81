"""The command line: exit codes, messages, overrides and help."""

from __future__ import annotations

import subprocess
import sys

import pytest

from meshyard.cli import main
from meshyard.config.load import load_config


def test_config_show_prints_documented_toml_that_reloads(tmp_path, capsys):
    assert main(["config", "show", "--train.steps=11", "--model.name", "gpt-small"]) == 0
    out = capsys.readouterr().out
    assert "# Optimizer steps to run." in out and "steps = 11" in out
    path = tmp_path / "shown.toml"
    path.write_text(out)
    assert load_config(path) == load_config(None, ["--train.steps=11", "--model.name=gpt-small"])


@pytest.mark.parametrize(
    "argv, fragment",
    [
        (["config", "show", "--train.stesp=3"], "did you mean 'steps'"),
        (["config", "show", "--train.steps=many"], "train.steps = 'many' should be int"),
        (["config", "show", "/no/such/file.toml"], "does not exist"),
        (["run", "--nproc", "2", "--parallel.strategy=none"], "'none' runs one process"),
        (["run", "--nproc", "2", "--train.global_batch=9"], "not divisible by the data-parallel size 2"),
        (["run", "--nproc", "3", "--parallel.strategy=fsdp", "--parallel.dp_replicate=2"], "do not multiply"),
        (["run", "--nproc", "1", "--data.source=text", "--data.paths=/no/such/*.txt"], "matches no file"),
        (["run", "--nproc", "1", "--model.name=/no/such/model.py:build"], "does not exist"),
        (["run", "--nproc", "1", "--run.gpu_hour_price=-1"], "run.gpu_hour_price = -1.0 must be a price"),
    ],
)
def test_bad_input_exits_2_with_message(argv, fragment, capsys, tmp_path):
    argv = [*argv, f"--run.dir={tmp_path}"] if argv[0] == "run" else argv
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert fragment in err
    assert "Traceback" not in err


def test_unknown_flag_is_a_usage_error(capsys):
    with pytest.raises(SystemExit) as info:
        main(["run", "--nprocs", "2"])
    assert info.value.code == 2
    assert "unrecognized arguments: --nprocs" in capsys.readouterr().err


def test_console_script_reports_bad_config_without_traceback(tmp_path):
    bad = tmp_path / "bad.toml"
    bad.write_text("[parallel]\nstrategy = 'zero9'\n[train]\nsteps = -1\n")
    proc = subprocess.run([sys.executable, "-m", "meshyard.cli", "run", str(bad)], capture_output=True, text=True)
    assert proc.returncode == 2
    assert "2 problems" in proc.stderr and "zero9" in proc.stderr and "train.steps = -1" in proc.stderr
    assert "Traceback" not in proc.stderr


@pytest.mark.parametrize("argv", [["--help"], ["run", "--help"], ["config", "show", "--help"]])
def test_help_is_useful(argv, capsys):
    with pytest.raises(SystemExit) as info:
        main(argv)
    assert info.value.code == 0
    out = capsys.readouterr().out
    assert "usage: meshyard" in out
    if argv[0] == "run":
        assert "--section.field=value" in out and "torchrun" in out
