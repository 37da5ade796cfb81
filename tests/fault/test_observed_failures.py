"""Failure modes seen from the outside, on 2 gloo ranks: slow data, a straggler, a hang,
non-finite values. Each is caused on purpose by a test-only plugin."""

from __future__ import annotations

import json

import pytest

import meshyard
from meshyard.doctor.diagnose import diagnose
from meshyard.launch.local import WorkerFailure
from tests.conftest import tiny_config

PLUGIN = "tests/fault/faulty_plugins.py"


def test_slow_data_loader_is_diagnosed_data_bound(tmp_path):
    cfg = tiny_config(tmp_path, f"--data.source={PLUGIN}:slow_dataset", "--train.steps=12", "--data.seq_len=16")
    result = meshyard.run(cfg, nproc=2)
    diagnosis = diagnose(result.run_dir)
    assert diagnosis.verdict == "data-bound", diagnosis.to_dict()
    assert any("data.num_workers" in advice for advice in diagnosis.findings[0].advice)


def test_sleeping_rank_is_named_straggler(tmp_path):
    cfg = tiny_config(tmp_path, f"--model.name={PLUGIN}:build_model", "--model.options={ rank = 1, sleep_s = 0.06 }",
                      "--train.steps=12", "--metrics.gather_every=3")
    result = meshyard.run(cfg, nproc=2)
    records = result.metrics()
    assert [r["stragglers"] for r in records if "stragglers" in r][1:] == [[1], [1], [1]]
    # Everyone's step takes as long; the straggler is the rank busy, not waiting.
    last = [r for r in records if "ranks" in r][-1]["ranks"]
    assert last["busy_s"][1] > 1.25 * last["busy_s"][0] and last["comm_s"][0] > last["comm_s"][1]
    diagnosis = diagnose(result.run_dir)
    assert diagnosis.verdict == "straggler" and "rank 1" in diagnosis.findings[0].evidence[0]
    assert "straggler at step" in (result.run_dir / "logs" / "rank0.log").read_text()


def test_hang_watchdog_names_the_rank_that_never_arrived(tmp_path):
    cfg = tiny_config(tmp_path, f"--model.name={PLUGIN}:build_model", "--model.options={ rank = 1, hang_at = 4 }",
                      "--train.steps=50", "--fault.hang_timeout_s=3", "--fault.hang_abort=true")
    with pytest.raises(WorkerFailure) as failure:
        meshyard.run(cfg, nproc=2)
    assert 124 in failure.value.exit_codes
    hang = tmp_path / "run" / "hang"
    report = json.loads((hang / "report-rank0.json").read_text())
    assert report["behind"] == [1]
    assert report["positions"]["1"]["phase"] == "forward" and report["positions"]["1"]["step"] == 4
    assert report["positions"]["0"]["phase"] == "backward"  # waiting in the gradient all-reduce
    assert "gradient all-reduce" in " ".join(report["others_wait_in"])
    for rank in (0, 1):
        stacks = (hang / f"rank{rank}.txt").read_text()
        assert "made no progress" in stacks and "File " in stacks
    assert "time.sleep" in (hang / "rank1.txt").read_text() or "faulty_plugins.py" in (hang / "rank1.txt").read_text()
    log = (tmp_path / "run" / "logs" / "rank0.log").read_text()
    assert "for rank 1 (step 4, forward)" in log


def test_nonfinite_loss_is_reported_with_step_and_rank(tmp_path):
    cfg = tiny_config(tmp_path, f"--model.name={PLUGIN}:build_model", "--model.options={ rank = 1, nan_at = 3 }",
                      "--train.steps=4")
    records = meshyard.run(cfg, nproc=2).metrics()
    flagged = [r for r in records if "nonfinite" in r]
    assert flagged[0]["step"] == 3
    assert {"rank": 1, "what": "loss", "value": "nan"} in flagged[0]["nonfinite"]
    assert "non-finite values at step 3: loss nan on rank 1" in (tmp_path / "run" / "logs" / "rank0.log").read_text()

    stop = tiny_config(tmp_path / "stop", f"--model.name={PLUGIN}:build_model",
                       "--model.options={ rank = 1, nan_at = 2 }", "--train.steps=4", "--fault.on_nonfinite=stop")
    with pytest.raises(WorkerFailure, match="non-finite values at step 2"):
        meshyard.run(stop, nproc=2)
