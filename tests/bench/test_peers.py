"""``benchmarks/peers.py`` at its smallest size: one round of 3 steps per contender, and
the printed table and JSON record hold every figure it promises."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "peers.py"
TINY = ["--rounds", "1", "--steps", "3", "--warmup", "1", "--model", "gpt-tiny", "--seq-len", "32",
        "--global-batch", "4", "--random-tokens", "8192"]


def load_script(monkeypatch):
    spec = importlib.util.spec_from_file_location("peers_benchmark", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, spec.name, module)  # its dataclasses look themselves up there
    spec.loader.exec_module(module)
    return module


def run_script(tmp_path: Path, contenders: str) -> tuple[str, dict]:
    out = tmp_path / "peers.json"
    proc = subprocess.run([sys.executable, str(SCRIPT), *TINY, "--contenders", contenders, "--out", str(out)],
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return proc.stdout, json.loads(out.read_text())


def check_contender(record: dict, name: str) -> None:
    figures = record["contenders"][name]
    assert figures["median_step_s"] > 0 and figures["median_in_step_s"] > 0 and figures["median_job_s"] > 0
    assert len(figures["round_medians_s"]) == 1 and figures["ratio_to_fastest"] >= 1.0
    assert 5.0 < figures["mean_loss"] < 6.0  # random tokens over 256 ids: about ln(256) = 5.55
    assert len(record["rounds"][name]) == 1 and len(record["rounds"][name][0]["periods_s"]) == 2


def test_plain_ddp_and_meshyard(tmp_path):
    printed, record = run_script(tmp_path, "ddp,meshyard")
    assert "plain torch DDP" in printed and "x fastest" in printed
    assert "meshyard / plain torch DDP" in printed and "1.03 target" in printed
    assert set(record["contenders"]) == {"ddp", "meshyard"} and record["fastest"] in {"ddp", "meshyard"}
    for name in ("ddp", "meshyard"):
        check_contender(record, name)
    target = record["targets"]["meshyard"]
    assert target["fastest_peer"] == "ddp" and target["ratio"] > 0 and len(target["round_ratios"]) == 1
    assert record["settings"]["model"] == "gpt-tiny" and record["environment"]["torch"]


@pytest.mark.parametrize("name, module", [("accelerate", "accelerate"), ("fabric", "lightning")])
def test_framework_peer(tmp_path, name, module):
    try:
        importlib.import_module(module)
    except ImportError as exc:
        pytest.skip(f"{module} is not installed ({exc}); pip install -e '.[bench]' adds it")
    _, record = run_script(tmp_path, name)
    check_contender(record, name)
    assert record["environment"][module]


def test_missing_peer_is_named_and_skipped(monkeypatch, capsys):
    script = load_script(monkeypatch)
    monkeypatch.setitem(sys.modules, "accelerate", None)  # importing it now raises ImportError
    assert script.main([*TINY, "--contenders", "accelerate"]) == 2
    printed = capsys.readouterr()
    assert "skipping HF Accelerate: accelerate is not installed" in printed.out
    assert "pip install -e '.[bench]'" in printed.out and "nothing left to measure" in printed.err
