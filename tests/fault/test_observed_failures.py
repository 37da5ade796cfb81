"""Failure modes seen from the outside, on 2 gloo ranks: slow data, a straggler, a hang,
non-finite values, an exception in the user's model. Each is caused on purpose by a
test-only plugin."""

from __future__ import annotations

import json
import os
import re
import socket
import subprocess
import sys

import pytest

import meshyard
from meshyard.cli import main
from meshyard.doctor.diagnose import diagnose
from meshyard.launch.local import WorkerFailure
from tests.checkpoint.helpers import JOB, REPO, run
from tests.conftest import tiny_config

PLUGIN = "tests/fault/faulty_plugins.py"
BROKEN = "--model.name=tests/models/user_models.py:broken_forward"
# The elastic agent's and torch's log lines ("E1123 17:37:25.930000 19191 torch/...] ...").
TORCH_LOG_LINE = re.compile(r"^[DIWEF]\d{4} [\d:.]+ \d+ \S+\] ", re.MULTILINE)


def test_slow_data_loader_is_diagnosed_data_bound(tmp_path):
    cfg = tiny_config(tmp_path, f"--data.source={PLUGIN}:slow_dataset", "--train.steps=12", "--data.seq_len=16")
    result = meshyard.run(cfg, nproc=2)
    diagnosis = diagnose(result.run_dir)
    # Found, whatever else a loaded machine adds to it (a rank slowed for a window can
    # also be named a straggler, which the diagnosis ranks first).
    data_bound = [finding for finding in diagnosis.findings if finding.verdict == "data-bound"]
    assert data_bound, diagnosis.to_dict()
    assert any("data.num_workers" in advice for advice in data_bound[0].advice)


def test_sleeping_rank_is_named_straggler(tmp_path):
    cfg = tiny_config(tmp_path, f"--model.name={PLUGIN}:build_model", "--model.options={ rank = 1, sleep_s = 0.15 }",
                      "--train.steps=12", "--metrics.gather_every=3")
    result = meshyard.run(cfg, nproc=2)
    records = result.metrics()
    assert [r["stragglers"] for r in records if "stragglers" in r][1:] == [[1], [1], [1]]
    host = _one_host(json.loads((result.run_dir / "run.json").read_text())["hosts"])
    assert [r["straggler_hosts"] for r in records if "stragglers" in r][1:] == [[host]] * 3
    # Everyone's step takes as long; the straggler is the rank busy, not waiting.
    last = [r for r in records if "ranks" in r][-1]["ranks"]
    assert last["busy_s"][1] > 1.25 * last["busy_s"][0] and last["comm_s"][0] > last["comm_s"][1]
    diagnosis = diagnose(result.run_dir)
    assert diagnosis.verdict == "straggler" and f"rank 1 on {host} was the slowest" in diagnosis.findings[0].evidence[0]
    assert f"straggler at step 6: rank 1 on {host}, " in (result.run_dir / "logs" / "rank0.log").read_text()


def _one_host(hosts: list[str]) -> str:
    """The label both local ranks share: this machine's hostname (its master is reached
    over loopback, so no address is added)."""
    assert len(hosts) == 2 and hosts[0] == hosts[1] and hosts[0].startswith(socket.gethostname()), hosts
    return hosts[0]


def test_hang_watchdog_names_the_rank_that_never_arrived(tmp_path):
    cfg = tiny_config(tmp_path, f"--model.name={PLUGIN}:build_model", "--model.options={ rank = 1, hang_at = 4 }",
                      "--train.steps=50", "--fault.hang_timeout_s=3", "--fault.hang_abort=true")
    with pytest.raises(WorkerFailure) as failure:
        meshyard.run(cfg, nproc=2)
    assert 124 in failure.value.exit_codes
    assert re.match(r"rank \d exited with code 124, stopped by the hang watchdog", str(failure.value)), failure.value
    hang = tmp_path / "run" / "hang"
    report = json.loads((hang / "report-rank0.json").read_text())
    assert report["behind"] == [1]
    assert report["positions"]["1"]["phase"] == "forward" and report["positions"]["1"]["step"] == 4
    assert report["positions"]["0"]["phase"] == "backward"  # waiting in the gradient all-reduce
    assert "gradient all-reduce" in " ".join(report["others_wait_in"])
    host = _one_host(report["hosts"])
    for rank in (0, 1):
        stacks = (hang / f"rank{rank}.txt").read_text()
        assert "made no progress" in stacks and "File " in stacks
    assert "time.sleep" in (hang / "rank1.txt").read_text() or "faulty_plugins.py" in (hang / "rank1.txt").read_text()
    log = (tmp_path / "run" / "logs" / "rank0.log").read_text()
    assert f"for rank 1 on {host} (step 4, forward)" in log


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


def assert_one_paragraph(err: str, rank: int, log) -> None:
    """The console holds this rank's failure as one line, the place in the user's code,
    and nothing of the tracebacks (they are in the log)."""
    [line] = [line for line in err.splitlines() if line.startswith("meshyard: rank")]
    assert line.startswith(f"meshyard: rank {rank} failed: ValueError: broken on purpose: a batch of shape "), err
    assert line.endswith(f"(at user_models.py:{_raise_line()} in _check_batch); full traceback in {log}"), line
    assert "Traceback" not in err and "second line" not in err and not TORCH_LOG_LINE.search(err), err
    text = log.read_text()
    assert "Traceback (most recent call last)" in text and "second line, not shown on the console" in text


def _raise_line() -> int:
    source = (REPO / "tests" / "models" / "user_models.py").read_text().splitlines()
    return next(n for n, line in enumerate(source, 1) if "raise ValueError(f\"broken on purpose" in line)


def test_exception_in_a_users_model_is_one_paragraph_naming_the_first_rank(tmp_path):
    """Rank 1's forward raises; rank 0 then loses its peer in the gradient all-reduce and
    fails too. The console names rank 1's exception, once when the agent restarts the
    workers and once when it gives up, not the agent's tracebacks: those go to
    logs/agent.log."""
    run_dir = tmp_path / "run"
    code, out, err = run(run_dir, BROKEN, "--model.options={ rank = 1 }", "--fault.max_restarts=1")
    assert code == 1, err[-3000:]
    assert_one_paragraph(err, 1, run_dir / "logs" / "rank1.log")
    [restart] = [line for line in (out + err).splitlines() if "restart 1" in line]
    assert restart.startswith("meshyard: restart 1 of fault.max_restarts = 1, after rank 1 failed: ValueError: ")
    assert "failed (exitcode: 1)" in (run_dir / "logs" / "agent.log").read_text()


def test_exception_in_one_process_run_is_one_paragraph(tmp_path, capsys):
    run_dir = tmp_path / "run"
    code = main(["run", "--nproc=1", "--parallel.strategy=none", *JOB, BROKEN, f"--run.run_dir={run_dir}",
                 f"--data.cache_dir={tmp_path / 'cache'}"])
    assert code == 1
    assert_one_paragraph(capsys.readouterr().err, 0, run_dir / "logs" / "rank0.log")


def test_exception_in_a_rank_under_torchrun_is_one_paragraph(tmp_path):
    """torchrun starts the rank; meshyard's part of its output is the same paragraph
    (what torchrun's own agent prints after it is torchrun's)."""
    run_dir = tmp_path / "run"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=1",
           "-m", "meshyard.cli", "run", "--parallel.strategy=none", *JOB, BROKEN, f"--run.run_dir={run_dir}",
           f"--data.cache_dir={tmp_path / 'cache'}"]
    proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=300,
                          env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert proc.returncode == 1, proc.stderr[-3000:]
    torchrun_says = TORCH_LOG_LINE.search(proc.stderr)  # its agent's record of the exit, then its traceback
    mine = proc.stderr[: torchrun_says.start()] if torchrun_says else proc.stderr
    assert_one_paragraph(mine, 0, run_dir / "logs" / "rank0.log")
