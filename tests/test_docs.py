"""The code in docs/architecture.md runs as written."""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_the_in_process_trainer_example_runs(tmp_path):
    text = (ROOT / "docs" / "architecture.md").read_text()
    code = re.search(r"```python\n(.*?)```", text, re.S).group(1)
    code = code.replace('"--train.steps=20"', '"--train.steps=3", "--data.source=random", "--model.name=gpt-tiny"')
    (tmp_path / "examples").mkdir()
    shutil.copy(ROOT / "examples" / "default.toml", tmp_path / "examples" / "default.toml")
    done = subprocess.run([sys.executable, "-c", code + "\nprint(summary['steps'])"], cwd=tmp_path,
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.strip().splitlines()[-1] == "3"
    assert (tmp_path / "runs" / "notebook" / "metrics.jsonl").exists()
