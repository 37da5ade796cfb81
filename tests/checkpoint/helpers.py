"""Running meshyard as a user does (a subprocess, or the Python API), watching it, and
reading its checkpoints."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

import meshyard
from meshyard.checkpoint.tools import model_state, resolve

REPO = Path(__file__).resolve().parents[2]

# A deterministic job slow enough (tens of ms per step) to be interrupted mid-run.
# Dropout is on so that the RNG state matters for exactness; a constant schedule lets a
# shorter run be a prefix of a longer one.
JOB = [
    "--model.name=gpt-tiny", "--model.dropout=0.1", "--data.source=random", "--data.seq_len=32",
    "--data.random_tokens=200000", "--train.global_batch=16", "--train.eval_every=0",
    "--train.deterministic=true", "--optim.warmup_steps=2", "--optim.schedule=constant", "--metrics.progress_bar=false",
    "--checkpoint.interval=3", "--fault.grace_period_s=20",
]


def start(run_dir: Path, *overrides: str, nproc: int = 2, cache: Path | None = None) -> subprocess.Popen:
    cmd = [sys.executable, "-m", "meshyard.cli", "run", "--nproc", str(nproc), *JOB,
           f"--run.run_dir={run_dir}", f"--data.cache_dir={cache or run_dir.parent / 'cache'}", *overrides]
    return subprocess.Popen(cmd, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env={**os.environ, "OMP_NUM_THREADS": "1"})


def finish(proc: subprocess.Popen, timeout: float = 240) -> tuple[int, str, str]:
    out, err = proc.communicate(timeout=timeout)
    return proc.returncode, out, err


def run(run_dir: Path, *overrides: str, nproc: int = 2) -> tuple[int, str, str]:
    return finish(start(run_dir, *overrides, nproc=nproc))


def run_here(run_dir: Path, *overrides: str, nproc: int = 2) -> meshyard.RunResult:
    """The job of ``start`` through ``meshyard.run`` in this process: the same agent and
    workers (in the same environment, so the same numbers) without a command's own
    interpreter start. For runs whose signals and exit code are not under test; the
    workers' console lines reach this process's stdout (pytest's ``capfd``)."""
    paths = [f"--run.run_dir={run_dir}", f"--data.cache_dir={run_dir.parent / 'cache'}"]
    config = meshyard.load_config(None, [*JOB, *paths, *overrides])
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("OMP_NUM_THREADS", "1")
        return meshyard.run(config, nproc=nproc)


def wait_for_step(run_dir: Path, step: int, proc: subprocess.Popen, timeout: float = 120) -> None:
    path = run_dir / "metrics.jsonl"
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if path.exists():
            lines = path.read_text().splitlines()
            if lines and json.loads(lines[-1])["step"] >= step:
                return
        if proc.poll() is not None:
            raise AssertionError(f"run ended before step {step}: {proc.stderr.read()[-2000:]}")
        time.sleep(0.005)
    raise AssertionError(f"step {step} not reached in {timeout}s")


def worker_pid(run_dir: Path, rank: int) -> int:
    """The pid a rank logged when it (last) started."""
    text = (run_dir / "logs" / f"rank{rank}.log").read_text()
    return int(re.findall(r"started: pid (\d+)", text)[-1])


def send(run_dir: Path, rank: int, sig: signal.Signals) -> None:
    os.kill(worker_pid(run_dir, rank), sig)


def losses(run_dir: Path) -> list[tuple[int, float]]:
    lines = (run_dir / "metrics.jsonl").read_text().splitlines()
    return [(r["step"], r["loss"]) for r in map(json.loads, lines)]


def model_tensors(checkpoint: Path) -> dict[str, torch.Tensor]:
    """The model entries of a DCP checkpoint, loaded without a process group."""
    return model_state(resolve(str(checkpoint), {}))


def latest_checkpoint(run_dir: Path) -> Path:
    root = run_dir / "checkpoints"
    return root / (root / "latest").read_text().strip()


def assert_bitwise_equal(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> None:
    assert a.keys() == b.keys() and a
    for key in a:
        assert torch.equal(a[key], b[key]), f"{key} differs"
