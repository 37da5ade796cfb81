"""The spike and NaN guard across a real crash: ``meshyard run`` is killed with SIGKILL (the
agent and its worker, no chance to save) right after guard.jsonl shows the rollback, and
the same command resumes it. Whatever the newest checkpoint then is (step 20's, saved
before the poison, or a later one carrying the skip list), the resumed run skips exactly
the poisoned samples and ends where the uninterrupted guarded run ends."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from meshyard.checkpoint.manager import read_trainer_state
from meshyard.checkpoint.storage import CheckpointStore
from meshyard.data.sampling import GlobalBatchSampler
from meshyard.metrics.records import read_metrics
from meshyard.run_dir import RunDir
from tests.checkpoint.helpers import REPO
from tests.conftest import tiny_config
from tests.fault.poisoned_dataset import GLOBAL_BATCH, SAMPLES, SEED, poisoned_indices
from tests.inprocess import fit_here
from tests.train.test_guard import CHECKPOINTS, DATA, GUARD, RUN

# A forward slowed to ~30 ms leaves the poll a few steps between the rollback (step 26)
# and the next checkpoint (step 30), so the kill usually lands before it.
SLOW = ("--model.name=tests/fault/faulty_plugins.py:build_model", "--model.options={ rank = 0, sleep_s = 0.03 }")
JOB = (f"--data.source={DATA}:poisoned", *RUN, *GUARD, *SLOW, *CHECKPOINTS, "--checkpoint.interval=10")


def _meshyard_run(cfg_dir: Path) -> subprocess.Popen:
    cfg = tiny_config(cfg_dir, *JOB)
    # What tiny_config adds to the job, for the same run as the in-process reference.
    overrides = [*JOB, f"--run.run_dir={cfg.run.run_dir}", f"--data.cache_dir={cfg.data.cache_dir}",
                 "--metrics.mfu=false", "--train.eval_every=0", "--metrics.progress_bar=false"]
    # Its own session: the kill takes the agent and the worker together, as a lost node would.
    return subprocess.Popen([sys.executable, "-m", "meshyard.cli", "run", "--nproc", "1", *overrides], cwd=REPO,
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, start_new_session=True,
                            env={**os.environ, "OMP_NUM_THREADS": "1"})


def _wait_for_rollback(guard_log: Path, proc: subprocess.Popen, timeout: float = 120) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if guard_log.exists() and '"rollback"' in guard_log.read_text():
            return
        assert proc.poll() is None, proc.stderr.read() if proc.stderr else proc.returncode
        time.sleep(0.01)
    raise AssertionError("no rollback in guard.jsonl")


def test_a_run_killed_after_its_rollback_resumes_skipping_the_same_samples(tmp_path, one_torch_thread):
    uninterrupted = fit_here(tiny_config(tmp_path / "whole", *JOB))
    cfg = tiny_config(tmp_path / "killed", *JOB)
    run_dir = RunDir(Path(cfg.run.run_dir))
    first = _meshyard_run(tmp_path / "killed")
    _wait_for_rollback(run_dir.guard, first)
    os.killpg(first.pid, signal.SIGKILL)
    first.wait(timeout=30)
    killed_at = read_metrics(run_dir.path)[-1]["step"]
    second = _meshyard_run(tmp_path / "killed")  # resume = auto: the run's newest checkpoint
    _, err = second.communicate(timeout=180)
    assert second.returncode == 0, err
    records = read_metrics(run_dir.path)
    assert records[-1]["step"] == 36 and killed_at < 36
    final = read_trainer_state(CheckpointStore(str(run_dir.checkpoints)), "step-00000036")
    sampler = GlobalBatchSampler(SAMPLES, GLOBAL_BATCH, GLOBAL_BATCH, 0, 1, SEED)
    (first_skipped, end), = final["data"]["skipped_steps"]
    assert sorted(i for step in range(first_skipped, end) for i in sampler.global_indices(step)) == poisoned_indices()
    rollbacks = [json.loads(line) for line in run_dir.guard.read_text().splitlines() if '"rollback"' in line]
    assert all(event["skipped_samples"] == poisoned_indices() for event in rollbacks)
    assert abs(records[-1]["loss"] - uninterrupted[-1]["loss"]) < 1e-4 * abs(uninterrupted[-1]["loss"])
