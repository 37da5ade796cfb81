"""A job under an external torchrun keeps one run directory across restarts: named after
the rendezvous id, it is found again and the run resumes from its checkpoints, and
``--resume latest`` continues it from another job; without an id that survives a
restart, rank 0 says so once, with the fix."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

from meshyard.config.dump import config_to_toml
from meshyard.config.load import load_config
from meshyard.metrics.records import read_metrics

REPO = Path(__file__).resolve().parents[2]


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def write_config(tmp_path: Path) -> Path:
    """A seconds-long job (tiny GPT, random tokens) with a checkpoint every 2 steps, its
    runs named 'exp' under tmp_path/runs, and no run.run_dir: the job's id names the folder."""
    cfg = load_config(None, [
        "--model.name=gpt-tiny", "--data.source=random", "--data.seq_len=16", "--data.random_tokens=65536",
        "--train.steps=4", "--train.global_batch=4", "--train.eval_every=0", "--optim.warmup_steps=2",
        "--optim.schedule=constant", "--metrics.progress_bar=false", "--checkpoint.interval=2",
        "--checkpoint.async_save=false", "--run.name=exp", f"--run.dir={tmp_path / 'runs'}",
        f"--data.cache_dir={tmp_path / 'cache'}",
    ])
    path = tmp_path / "cfg.toml"
    path.write_text(config_to_toml(cfg))
    return path


def torchrun(rendezvous: list[str], config: Path, *overrides: str) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nnodes", "1", "--nproc-per-node", "2", *rendezvous,
           "-m", "meshyard.cli", "run", str(config), *overrides]
    proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=300,
                          env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    return proc


def test_a_job_restarted_with_the_same_rdzv_id_resumes_in_its_run_directory(tmp_path):
    config = write_config(tmp_path)
    rendezvous = ["--rdzv-backend", "c10d", "--rdzv-endpoint", f"127.0.0.1:{free_port()}", "--rdzv-id", "job-7"]
    first = torchrun(rendezvous, config)
    [run_dir] = (tmp_path / "runs").iterdir()
    assert run_dir.name == "exp-job-7"
    started = json.loads((run_dir / "run.json").read_text())
    assert (started["job_id"], started["checkpoints"]) == ("job-7", str(run_dir / "checkpoints"))
    assert sorted(p.name for p in (run_dir / "checkpoints").glob("step-*")) == ["step-00000002", "step-00000004"]
    assert "resumed from" not in first.stdout + first.stderr

    rendezvous[3] = f"127.0.0.1:{free_port()}"  # a new torchrun, the same job
    again = torchrun(rendezvous, config, "--train.steps=6")
    assert [p.name for p in (tmp_path / "runs").iterdir()] == ["exp-job-7"]
    assert f"resumed from {run_dir}/checkpoints/step-00000004 at step 4" in again.stdout
    [restart] = [json.loads(line) for line in (run_dir / "restarts.jsonl").read_text().splitlines()]
    assert (restart["resumed_step"], restart["steps_lost"]) == (4, 0)
    assert [r["step"] for r in read_metrics(run_dir)] == [1, 2, 3, 4, 5, 6]
    resumed = json.loads((run_dir / "run.json").read_text())
    assert resumed["run_id"] == started["run_id"]  # its checkpoints stay this run's
    newest = json.loads((run_dir / "checkpoints" / "step-00000006" / "manifest.json").read_text())
    assert newest["run_id"] == started["run_id"]

    # Another job continues it with --resume latest: in that run directory, as that run.
    other = ["--rdzv-backend", "c10d", "--rdzv-endpoint", f"127.0.0.1:{free_port()}", "--rdzv-id", "job-8"]
    later = torchrun(other, config, "--train.steps=8", "--resume", "latest")
    assert [p.name for p in (tmp_path / "runs").iterdir()] == ["exp-job-7"]
    assert f"resumed from {run_dir}/checkpoints/step-00000006 at step 6" in later.stdout
    assert json.loads((run_dir / "run.json").read_text())["run_id"] == started["run_id"]
    assert [r["step"] for r in read_metrics(run_dir)] == list(range(1, 9))


def test_a_job_without_a_lasting_id_is_told_once_how_to_keep_its_run_directory(tmp_path):
    config = write_config(tmp_path)
    # torchrun's static rendezvous (a master port, no --rdzv-id): its run id is "none".
    proc = torchrun(["--master-addr", "127.0.0.1", "--master-port", str(free_port())], config,
                    "--train.steps=1", "--checkpoint.enabled=false")
    advice = [line for line in proc.stdout.splitlines() if "survives a restart" in line]
    assert advice == [
        "meshyard: this job has no id that survives a restart (torchrun was given no --rdzv-id), so its run "
        "directory is named by the time it started and a restarted job starts again from step 0; pass the same "
        "--rdzv-id to torchrun on every start, set run.run_dir, or continue the newest run with --resume latest"]
    [run_dir] = (tmp_path / "runs").iterdir()
    assert run_dir.name.startswith("exp-2") and json.loads((run_dir / "run.json").read_text())["job_id"] == ""
