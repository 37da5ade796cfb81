"""Interrupted runs end exactly where uninterrupted ones do (same layout, deterministic mode).

The runs are real, with 2 gloo workers under the elastic agent: `meshyard run` in a
subprocess where a worker is killed with SIGKILL or sent a signal by pid, as a cluster
would, and the exit code is checked; ``meshyard.run`` in this process (the same agent and
workers, one interpreter start fewer) for the runs that only train or resume.
"""

from __future__ import annotations

import json
import random
import signal

import pytest

from tests.checkpoint.helpers import (assert_bitwise_equal, finish, latest_checkpoint, losses, model_tensors,
                                      run_here, send, start, wait_for_step)

STEPS = 14


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory):
    run_dir = tmp_path_factory.mktemp("reference") / "run"
    run_here(run_dir, f"--train.steps={STEPS}")
    return run_dir


def test_kill_9_with_restarts_resumes_bit_identically(tmp_path, uninterrupted):
    run_dir = tmp_path / "run"
    proc = start(run_dir, f"--train.steps={STEPS}", "--fault.max_restarts=1")
    kill_at = random.Random().randint(4, 10)
    wait_for_step(run_dir, kill_at, proc)
    send(run_dir, rank=random.Random().choice([0, 1]), sig=signal.SIGKILL)
    code, _, err = finish(proc)
    assert code == 0, err[-3000:]

    restarts = [json.loads(line) for line in (run_dir / "restarts.jsonl").read_text().splitlines()]
    assert len(restarts) == 1 and restarts[0]["restart"] == 1
    resumed = restarts[0]["resumed_step"]
    assert resumed % 3 == 0 and resumed <= restarts[0]["last_recorded_step"]
    assert restarts[0]["steps_lost"] == restarts[0]["last_recorded_step"] - resumed
    # Same per-step losses, each step recorded once, and bit-identical final parameters.
    assert losses(run_dir) == losses(uninterrupted)
    assert_bitwise_equal(model_tensors(latest_checkpoint(run_dir)), model_tensors(latest_checkpoint(uninterrupted)))


def test_sigterm_on_one_rank_saves_and_exits_then_resumes_exactly(tmp_path, uninterrupted, capfd):
    run_dir = tmp_path / "run"
    proc = start(run_dir, f"--train.steps={STEPS}", "--checkpoint.interval=100")
    wait_for_step(run_dir, 5, proc)
    send(run_dir, rank=1, sig=signal.SIGTERM)
    code, _, err = finish(proc)
    assert code == 75, err[-3000:]
    assert "preempted by SIGTERM on rank 1" in err
    record = json.loads((run_dir / "preemption.json").read_text())
    assert record["within_grace"] and record["seconds_from_signal_to_commit"] < 20
    assert record["checkpoint"].endswith(f"step-{record['step']:08d}") and record["step"] < STEPS
    assert latest_checkpoint(run_dir).name == f"step-{record['step']:08d}"  # committed, not partial

    run_here(run_dir, f"--train.steps={STEPS}", "--checkpoint.interval=100")
    out = capfd.readouterr().out
    assert f"resumed from {run_dir}/checkpoints/step-{record['step']:08d}" in out
    assert losses(run_dir) == losses(uninterrupted)
    assert_bitwise_equal(model_tensors(latest_checkpoint(run_dir)), model_tensors(latest_checkpoint(uninterrupted)))


def test_corrupt_latest_checkpoint_falls_back_to_previous(tmp_path, uninterrupted, capfd):
    run_dir = tmp_path / "run"
    run_here(run_dir, "--train.steps=9", "--checkpoint.save_final=false")
    newest = latest_checkpoint(run_dir)
    assert newest.name == "step-00000009"
    shard = next(newest.glob("__1_0.distcp"))
    data = bytearray(shard.read_bytes())
    data[len(data) // 2] ^= 0xFF  # one flipped byte: same size, wrong contents
    shard.write_bytes(bytes(data))

    capfd.readouterr()  # the console of the first run
    run_here(run_dir, f"--train.steps={STEPS}")
    out = capfd.readouterr().out
    assert "step-00000009 is not valid: file __1_0.distcp does not match its SHA-256 checksum" in out
    assert "resumed from" in out and "step-00000006 at step 6" in out
    assert losses(run_dir) == losses(uninterrupted)
    assert_bitwise_equal(model_tensors(latest_checkpoint(run_dir)), model_tensors(latest_checkpoint(uninterrupted)))


@pytest.mark.parametrize("target, sig", [("rank0", signal.SIGUSR1), ("launcher", signal.SIGINT)])
def test_other_stop_signals_save_and_exit_75(tmp_path, target, sig):
    """SIGUSR1 (Slurm's --signal) on a worker, or Ctrl-C / SIGTERM on the launcher, which
    passes it to every worker and waits the grace period."""
    run_dir = tmp_path / "run"
    proc = start(run_dir, "--train.steps=400", "--checkpoint.interval=100")
    wait_for_step(run_dir, 4, proc)
    if target == "launcher":
        proc.send_signal(sig)
    else:
        send(run_dir, rank=0, sig=sig)
    code, _, err = finish(proc)
    assert code == 75, err[-3000:]
    record = json.loads((run_dir / "preemption.json").read_text())
    assert sig.name in record["signal"] and record["within_grace"]
    assert latest_checkpoint(run_dir).name == f"step-{record['step']:08d}"
