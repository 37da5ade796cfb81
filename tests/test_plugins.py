"""Users' own builders: a plugin that does not import is bad input, reported without a traceback."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from meshyard.cli import main
from meshyard.plugins import PluginError, load_callable

REPO = Path(__file__).resolve().parents[1]

BROKEN = {
    "syntax": ("def build_model(:\n    pass\n", 1, "syntax error", "def build_model(:"),
    "import": ("import torch\nimport no_such_module_for_meshyard\n\ndef build_model():\n    pass\n",
               2, "No module named 'no_such_module_for_meshyard'", "import no_such_module_for_meshyard"),
    "runtime": ("X = 1\nY = undefined_name + X\n\ndef build_model():\n    pass\n", 2, "NameError", "undefined_name"),
}


def write_config(tmp_path: Path, key: str, reference: str) -> Path:
    section, field = key.split(".")
    config = tmp_path / "bad.toml"
    config.write_text(f"[{section}]\n{field} = '{reference}'\n")
    return config


@pytest.mark.parametrize("kind", sorted(BROKEN))
@pytest.mark.parametrize("key", ["model.name", "data.source"])
def test_broken_plugin_file_exits_2_naming_file_and_line(kind, key, tmp_path, capsys, monkeypatch):
    source, line, error, text = BROKEN[kind]
    plugin = tmp_path / "broken_plugin.py"
    plugin.write_text(source)
    monkeypatch.chdir(tmp_path)
    config = write_config(tmp_path, key, "broken_plugin.py:build_model")
    assert main(["run", str(config), "--nproc=1", f"--run.dir={tmp_path / 'runs'}"]) == 2
    err = capsys.readouterr().err
    assert f"{plugin}, line {line}" in err and error in err and text in err, err
    assert key in err and "Traceback" not in err
    assert not (tmp_path / "runs").exists()  # nothing is started for bad input


def test_broken_plugin_module_exits_2_naming_file_and_line(tmp_path, capsys, monkeypatch):
    package = tmp_path / "userpkg_for_meshyard"
    package.mkdir()
    (package / "__init__.py").write_text("")
    (package / "models.py").write_text("import os\nfrom os import no_such_name\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    config = write_config(tmp_path, "model.name", "userpkg_for_meshyard.models:build")
    assert main(["run", str(config), "--nproc=1", f"--run.dir={tmp_path / 'runs'}"]) == 2
    err = capsys.readouterr().err
    assert f"{package / 'models.py'}, line 2" in err and "cannot import name 'no_such_name'" in err, err
    assert "Traceback" not in err
    assert "userpkg_for_meshyard.models" not in sys.modules


def test_missing_module_says_so(tmp_path):
    with pytest.raises(PluginError, match="cannot import module 'no_such_pkg_for_meshyard.models' .No module named"):
        load_callable("no_such_pkg_for_meshyard.models:build")


def test_failed_file_is_not_cached_and_a_fix_is_picked_up(tmp_path):
    plugin = tmp_path / "fixable.py"
    plugin.write_text("def build(:\n")
    before = set(sys.modules)
    with pytest.raises(PluginError, match="line 1"):
        load_callable(f"{plugin}:build")
    assert set(sys.modules) == before
    plugin.write_text("def build():\n    return 42\n")
    assert load_callable(f"{plugin}:build")() == 42


def test_console_script_reports_broken_plugin_without_traceback(tmp_path):
    (tmp_path / "broken_plugin.py").write_text(BROKEN["syntax"][0])
    config = tmp_path / "bad.toml"
    config.write_text(textwrap.dedent(f"""\
        [model]
        name = '{tmp_path / "broken_plugin.py"}:build_model'
        [run]
        dir = '{tmp_path / "runs"}'
    """))
    proc = subprocess.run([str(Path(sys.executable).parent / "meshyard"), "run", str(config)],
                          capture_output=True, text=True, cwd=REPO)
    assert proc.returncode == 2, proc.stderr
    assert f"{tmp_path / 'broken_plugin.py'}, line 1" in proc.stderr and "syntax error" in proc.stderr
    assert "Traceback" not in proc.stderr
