"""``meshyard slurm``: the sbatch script's text, its refusals, and jobs on a real one-node
Slurm (scripts/slurm_localhost.sh; those tests skip with its reason where it cannot start):
one that trains to the end, and one that saves on USR1, requeues itself and finishes (the
two run side by side)."""

from __future__ import annotations

import io
import json
import os
import re
import subprocess
import time
from contextlib import redirect_stderr, redirect_stdout
from dataclasses import dataclass
from pathlib import Path

import pytest

from meshyard.cli import main
from meshyard.config.load import ConfigError, load_config
from meshyard.data.sampling import GlobalBatchSampler
from meshyard.jobs.slurm import SlurmOptions, sbatch_script
from meshyard.metrics.records import read_metrics
from tests.checkpoint.recording_dataset import seen_indices

REPO = Path(__file__).resolve().parents[2]
JOB = ["--model.name=gpt-tiny", "--data.seq_len=16", "--train.global_batch=4", "--train.eval_every=0",
       "--optim.warmup_steps=1", "--metrics.progress_bar=false", "--run.nproc=2"]


def _script(capsys, *argv: str) -> str:
    assert main(["slurm", "script", *argv]) == 0
    return capsys.readouterr().out


def _sbatch(text: str) -> list[str]:
    return [line.removeprefix("#SBATCH ") for line in text.splitlines() if line.startswith("#SBATCH")]


def test_the_script_asks_for_what_the_options_say(capsys, tmp_path):
    text = _script(capsys, "--nodes", "4", "--gpus-per-node", "8", "--time", "2:00:00", "--partition", "gpu",
                   "--account", "lab", "--cpus-per-task", "32", "--mem", "200G", "--signal-grace", "120",
                   "--sbatch=--qos=high", f"--run.dir={tmp_path}/runs", "--run.name=exp")
    assert _sbatch(text) == [
        "--job-name=exp", "--nodes=4", "--ntasks-per-node=1", "--gpus-per-node=8", "--cpus-per-task=32",
        "--mem=200G", "--time=2:00:00", "--partition=gpu", "--account=lab", "--signal=B:USR1@120", "--requeue",
        "--open-mode=append", f"--output={tmp_path}/runs/slurm/exp-%j.out", f"--chdir={Path.cwd()}", "--qos=high",
    ]
    # One agent per node, one worker per GPU, meeting at the allocation's first host.
    assert 'head=$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n1)' in text
    step = next(line for line in text.splitlines() if line.startswith("srun "))
    assert step.startswith("srun --kill-on-bad-exit=0 ") and step.endswith(" &")
    assert "port=$((20000 + SLURM_JOB_ID % 10000))" in text  # jobs sharing a first host meet apart
    assert '--cpus-per-task="${SLURM_CPUS_PER_TASK:-$SLURM_CPUS_ON_NODE}"' in step  # srun does not inherit it
    assert ('run "$config" --nnodes 4 --nproc-per-node 8 --rdzv-endpoint "$head:$port" '
            '--rdzv-id "slurm$SLURM_JOB_ID"') in step
    subprocess.run(["bash", "-n"], input=text, text=True, check=True)  # valid shell


def test_a_cpu_job_leaves_out_gpus_and_runs_the_configs_workers(capsys):
    text = _script(capsys, "--run.nproc=4", "--run.device=cpu")
    assert not [line for line in _sbatch(text) if line.startswith(("--gpus", "--time", "--partition", "--mem"))]
    assert "--nnodes 1 --nproc-per-node 4 " in text and "--signal=B:USR1@90" in _sbatch(text)


def test_the_embedded_config_is_the_resolved_one(capsys, tmp_path):
    text = _script(capsys, "--train.steps=7", "--run.dir=relative/runs")
    body = re.search(r"<<'MESHYARD_CONFIG_END'\n(.*?)\nMESHYARD_CONFIG_END\n", text, re.S).group(1)
    (tmp_path / "c.toml").write_text(body)
    config = load_config(tmp_path / "c.toml")
    assert config.train.steps == 7 and config.run.dir == str(Path("relative/runs").resolve())


def test_usr1_is_passed_to_the_step_and_the_requeue_is_bounded(capsys):
    text = _script(capsys, "--fault.max_requeues=2")
    assert "trap '" in text and 'kill -USR1 "$step"' in text.split("trap '")[1].splitlines()[0]
    # The trap runs only while the shell waits, so the step runs in the background.
    assert 'while kill -0 "$step" 2>/dev/null; do wait "$step"; done' in text
    assert 'if [ "$rc" -eq 75 ] && [ "${SLURM_RESTART_COUNT:-0}" -lt 2 ]; then' in text
    assert 'scontrol requeue "$SLURM_JOB_ID"' in text and text.rstrip().endswith("exit $rc")


def test_no_requeue_never_requeues(capsys):
    text = _script(capsys, "--no-requeue")
    assert "--no-requeue" in _sbatch(text) and "--requeue" not in _sbatch(text)
    assert "scontrol requeue" not in text and "--signal=B:USR1@90" in _sbatch(text)


@pytest.mark.parametrize("argv, expected", [
    (["--nodes", "0"], "--nodes 0: a job needs at least one node"),
    (["--gpus-per-node", "8", "--run.device=cpu"], "asks for GPUs but the config runs on the CPU"),
    (["--run.device=cuda"], "no GPUs are asked for: add --gpus-per-node G"),
    (["--fault.signals=[\"SIGTERM\"]"], "fault.signals lacks SIGUSR1"),
    (["--fault.max_requeues=-1"], "fault.max_requeues = -1 must not be negative"),
])
def test_bad_requests_exit_2_naming_the_problem(capsys, argv, expected):
    assert main(["slurm", "script", *argv]) == 2
    captured = capsys.readouterr()
    assert expected in captured.err and captured.out == ""


def test_the_library_refuses_the_same(tmp_path):
    with pytest.raises(ConfigError, match="at least one node"):
        sbatch_script(load_config(None), SlurmOptions(nodes=0))


# ---- against a real Slurm ----------------------------------------------------------


def _submit(folder: Path, *overrides: str) -> tuple[str, Path]:
    """Submit a tiny 2-process job through ``meshyard slurm submit`` (the command's own
    ``main``, from the repository root, so the job runs where a user's would); its job id
    and run directory. sbatch hands the job this environment, less any SLURM_ variable
    of an enclosing job, with one thread per worker."""
    out, err = io.StringIO(), io.StringIO()
    with pytest.MonkeyPatch.context() as patch:
        for name in [name for name in os.environ if name.startswith("SLURM_")]:
            patch.delenv(name)
        patch.setenv("OMP_NUM_THREADS", "1")
        patch.chdir(REPO)
        with redirect_stdout(out), redirect_stderr(err):
            code = main(["slurm", "submit", *JOB, f"--run.dir={folder / 'runs'}", f"--data.cache_dir={folder / 'seen'}",
                         *overrides])
    assert code == 0, err.getvalue()
    job_id = out.getvalue().strip()
    assert job_id.isdigit() and f"submitted job {job_id}" in err.getvalue()
    assert list((folder / "runs" / "slurm").glob("meshyard-*.sbatch"))
    return job_id, folder / "runs" / f"meshyard-slurm{job_id}"


def _job(job_id: str) -> dict[str, str]:
    shown = subprocess.run(["scontrol", "-o", "show", "job", job_id], capture_output=True, text=True, check=True)
    return dict(field.split("=", 1) for field in shown.stdout.split() if "=" in field)


def _wait(job_id: str, until, what: str, limit_s: float = 240) -> dict[str, str]:
    deadline = time.monotonic() + limit_s
    while time.monotonic() < deadline:
        job = _job(job_id)
        if until(job):
            return job
        time.sleep(0.2)
    subprocess.run(["scancel", job_id])
    raise AssertionError(f"job {job_id}: {what} did not happen: {_job(job_id)}")


def _output(folder: Path, job_id: str) -> str:
    return (folder / "runs" / "slurm" / f"meshyard-{job_id}.out").read_text()


def _finished(job_id: str) -> dict[str, str]:
    return _wait(job_id, lambda job: job["JobState"] in ("COMPLETED", "FAILED", "CANCELLED", "TIMEOUT"), "the end")


@dataclass
class Submitted:
    folder: Path
    job_id: str
    run_dir: Path
    ended: dict[str, str]  # the job's last ``scontrol show job`` fields


# At half a second a step in its first run (slurm_requeue_dataset), the requeued job would
# need half a minute to finish there: the signal lands well before the end.
REQUEUED_STEPS, REQUEUED_BATCH = 60, 4


@pytest.fixture(scope="module")
def jobs(slurm_localhost, tmp_path_factory) -> dict[str, Submitted]:
    """Two jobs, run side by side on the node's two CPUs: ``requeued`` is sent USR1 once it
    trained 3 steps (it saves, requeues itself and finishes in its rerun); ``plain`` trains
    4 steps to the end. The plain one is submitted once the signal is sent, so that it runs
    while the other saves and waits out the pause Slurm puts before a requeued job starts
    again (the credential lifetime), instead of after it."""
    requeued = tmp_path_factory.mktemp("requeued")
    requeued_id, requeued_run = _submit(requeued, "--data.source=tests/jobs/slurm_requeue_dataset.py:build",
                                        f"--train.steps={REQUEUED_STEPS}", "--fault.max_requeues=1",
                                        "--checkpoint.interval=0")
    _wait(requeued_id, lambda job: job["JobState"] == "RUNNING" and (requeued_run / "metrics.jsonl").exists()
          and len(read_metrics(requeued_run)) >= 3, "training")
    # Only a RUNNING job: a signal sent to a pending one is delivered to its next run.
    subprocess.run(["scancel", "--signal=USR1", "--batch", requeued_id], check=True, timeout=30)

    plain = tmp_path_factory.mktemp("plain")
    plain_id, plain_run = _submit(plain, "--data.source=random", "--data.random_tokens=65536", "--train.steps=4",
                                  "--checkpoint.enabled=false")
    plain_end = _finished(plain_id)
    requeued_end = _wait(requeued_id, lambda job: job["JobState"] in ("COMPLETED", "FAILED", "CANCELLED")
                         and job.get("Restarts") == "1", "the requeued run's end")
    return {"plain": Submitted(plain, plain_id, plain_run, plain_end),
            "requeued": Submitted(requeued, requeued_id, requeued_run, requeued_end)}


def test_a_submitted_job_trains_to_the_end(jobs):
    plain = jobs["plain"]
    job, run_dir = plain.ended, plain.run_dir
    assert job["JobState"] == "COMPLETED" and job["ExitCode"] == "0:0", _output(plain.folder, plain.job_id)
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["steps"] == 4 and summary["world_size"] == 2
    assert [r["step"] for r in read_metrics(run_dir)] == [1, 2, 3, 4]
    assert f"records in {run_dir}" in _output(plain.folder, plain.job_id)


def test_usr1_saves_requeues_and_the_rerun_finishes_every_step_once(jobs):
    requeued = jobs["requeued"]
    job, run_dir, steps, batch = requeued.ended, requeued.run_dir, REQUEUED_STEPS, REQUEUED_BATCH
    output = _output(requeued.folder, requeued.job_id)
    assert job["JobState"] == "COMPLETED", output
    assert "requeueing (restart 0 of at most 1)" in output  # the first run's log, kept by --open-mode=append
    stopped = json.loads((run_dir / "preemption.json").read_text())
    assert stopped["signal"].startswith("SIGUSR1") and 3 <= stopped["step"] < steps
    restarts = [json.loads(line) for line in (run_dir / "restarts.jsonl").read_text().splitlines()]
    assert len(restarts) == 1 and restarts[0]["resumed_step"] == stopped["step"] and restarts[0]["steps_lost"] == 0
    assert restarts[0]["requeue"] == 1  # SLURM_RESTART_COUNT of the requeued run
    assert [r["step"] for r in read_metrics(run_dir)] == list(range(1, steps + 1))
    sampler = GlobalBatchSampler(2048, batch, batch, 0, 1, seed=1234)  # the default train.seed
    expected = [index for step in range(steps) for part in sampler.step_indices(step) for index in part]
    reads = seen_indices(requeued.folder / "seen")
    assert set(reads) == set(expected), "a sample was skipped or a foreign one read"
    # At most the batch being read when the signal came is read again after the resume.
    assert len(reads) - len(expected) <= batch


def test_an_srun_task_told_to_launch_a_node_starts_its_workers_instead_of_being_a_rank():
    from meshyard.api import _launches_nodes_in_slurm
    from meshyard.config.load import load_config

    node = load_config(None, ["--run.nnodes=2", "--run.rdzv_endpoint=head:29400", "--run.rdzv_id=slurm7"])
    assert _launches_nodes_in_slurm(node, "slurm")
    assert not _launches_nodes_in_slurm(load_config(None, []), "slurm")  # plain `srun meshyard run`: one rank each
    assert not _launches_nodes_in_slurm(node, "torchrun")  # a torchrun worker never starts an agent
