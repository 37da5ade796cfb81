"""The run directory: its layout (the README's table, spelled here as the contract), the
records it owns, and how it is named: after the job, so a restarted job finds its own,
by one rule for the launcher and every rank (``runtime.job``); the run id in one is
decided once, and the same wherever it is derived."""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

from meshyard.config.load import load_config
from meshyard.run_dir import RunDir, derived_run_id, resolve_run_dir, run_id_of
from meshyard.runtime.job import Job


def run_config(tmp_path: Path, *overrides: str):
    return load_config(None, [f"--run.dir={tmp_path}", "--run.name=exp", *overrides]).run


def test_a_job_names_its_run_directory_and_a_job_without_an_id_gets_a_new_one(tmp_path):
    cfg = run_config(tmp_path)
    assert resolve_run_dir(cfg, "slurm42") == resolve_run_dir(cfg, "slurm42") == tmp_path / "exp-slurm42"
    assert resolve_run_dir(cfg, "team/job 1") == tmp_path / "exp-team-job-1"  # a folder name, not a path
    first = resolve_run_dir(cfg)
    first.mkdir()
    assert resolve_run_dir(cfg) not in (first, tmp_path / "exp-slurm42")
    assert resolve_run_dir(run_config(tmp_path, f"--run.run_dir={tmp_path / 'mine'}"), "slurm42") == tmp_path / "mine"


def test_the_run_id_is_kept_and_derived_alike_on_nodes_that_share_no_folder(tmp_path):
    node_a, node_b = tmp_path / "a" / "exp-job-7", tmp_path / "b" / "exp-job-7"
    for folder in (node_a, node_b):
        folder.mkdir(parents=True)
    assert run_id_of(node_a, "job-7") == run_id_of(node_b, "job-7") == derived_run_id("job-7", "exp-job-7")
    assert run_id_of(node_a, "another-job") == run_id_of(node_a) == derived_run_id("job-7", "exp-job-7")  # kept
    assert derived_run_id("job-7", "other-job-7") != derived_run_id("job-7", "exp-job-7")  # another run's folder
    without_job = [tmp_path / "c", tmp_path / "d"]
    for folder in without_job:
        folder.mkdir()
    first, second = (run_id_of(folder) for folder in without_job)
    assert first != second and len(first) == len(second) == 12 and run_id_of(without_job[0]) == first


def restart_advice(cfg, env: dict[str, str]) -> str:
    return Job.detect(env).restart_advice(cfg)


def test_a_job_whose_run_directory_a_restart_would_not_find_is_told_how_to_keep_it(tmp_path):
    cfg = run_config(tmp_path)
    ranks = {"RANK": "0", "WORLD_SIZE": "2", "LOCAL_RANK": "0"}
    static = restart_advice(cfg, {**ranks, "TORCHELASTIC_RUN_ID": "none"})
    assert "no id that survives a restart (torchrun was given no --rdzv-id)" in static
    assert "pass the same --rdzv-id to torchrun on every start, set run.run_dir" in static
    made_up = restart_advice(cfg, {**ranks, "TORCHELASTIC_RUN_ID": "1b4e28ba-2fa1-41d2-883f-0016d3cca427"})
    assert made_up.startswith("meshyard: torchrun made up the rendezvous id 1b4e28ba-2fa1-41d2-883f-0016d3cca427")
    pod = restart_advice(cfg, {"RANK": "1", "WORLD_SIZE": "2", "MASTER_ADDR": "10.0.0.7"})
    assert "(the environment names no job)" in pod and "--rdzv-id" not in pod
    assert restart_advice(cfg, {**ranks, "TORCHELASTIC_RUN_ID": "job-7"}) == ""
    assert restart_advice(cfg, {**ranks, "TORCHELASTIC_RUN_ID": "none", "SLURM_JOB_ID": "42"}) == ""
    assert restart_advice(run_config(tmp_path, "--run.run_dir=x"), {**ranks, "TORCHELASTIC_RUN_ID": "none"}) == ""
    assert restart_advice(cfg, {}) == ""  # meshyard's own launches name their run directory


def test_every_path_of_a_run_directory_is_where_the_readme_says(tmp_path):
    run = RunDir(str(tmp_path))  # a string is taken as a path
    assert run.path == tmp_path and run == RunDir(tmp_path)
    top = {run.config: "config.toml", run.run_facts: "run.json", run.summary: "summary.json",
           run.metrics: "metrics.jsonl", run.restarts: "restarts.jsonl", run.preemption: "preemption.json",
           run.checkpoints: "checkpoints", run.logs: "logs", run.hang: "hang", run.run_id_file: "run_id",
           run.report: "report.html", run.prometheus: "prometheus.json", run.tensorboard: "tensorboard"}
    assert {path: str(path.relative_to(tmp_path)) for path in top} == top
    under = {run.rank_log(3): "logs/rank3.log", run.agent_log: "logs/agent.log",
             run.rank_preemption(1): "logs/preemption-rank1.json", run.failures: "logs/failures",
             run.failure_record(2, 5): "logs/failures/restart2-rank5.json",
             run.bad_input_record(0): "logs/failures/bad-input-rank0.json",
             run.hang_stacks(1): "hang/rank1.txt", run.hang_report(1): "hang/report-rank1.json"}
    assert {path: path.relative_to(tmp_path).as_posix() for path in under} == under
    assert (RunDir.CONFIG, RunDir.METRICS, RunDir.CHECKPOINTS) == ("config.toml", "metrics.jsonl", "checkpoints")


def test_failure_records_are_found_by_attempt_and_bad_input_apart(tmp_path):
    run = RunDir(tmp_path)
    assert run.failure_records(0) == [] and run.bad_input_records() == []  # no logs/ yet
    run.failures.mkdir(parents=True)
    for path in (run.failure_record(0, 0), run.failure_record(0, 1), run.failure_record(1, 0), run.bad_input_record(2)):
        path.write_text("{}")
    assert sorted(run.failure_records(0)) == [run.failure_record(0, 0), run.failure_record(0, 1)]
    assert run.failure_records(1) == [run.failure_record(1, 0)]
    assert run.bad_input_records() == [run.bad_input_record(2)]


def test_the_json_records_read_back_what_was_written(tmp_path):
    run = RunDir(tmp_path)
    assert run.read_run_facts() == {} and run.read_restarts() == []  # a run that recorded none
    run.write_run_facts({"run_id": "abc", RunDir.CHECKPOINTS_FACT: "/ckpt"})
    assert json.loads((tmp_path / "run.json").read_text()) == run.read_run_facts() == {"run_id": "abc",
                                                                                          "checkpoints": "/ckpt"}
    run.write_summary({"final_loss": 2.5})
    assert run.read_summary() == json.loads((tmp_path / "summary.json").read_text()) == {"final_loss": 2.5}
    run.append_restart({"restart": 1, "steps_lost": 3})
    run.append_restart({"restart": 2, "steps_lost": 0})
    assert (tmp_path / "restarts.jsonl").read_text().count("\n") == 2
    assert [entry["restart"] for entry in run.read_restarts()] == [1, 2]


def test_the_preemption_record_is_rank_0s_else_a_ranks_copy_and_only_a_new_one(tmp_path):
    run = RunDir(tmp_path)
    assert run.read_preemption() is None
    run.write_preemption({"step": 7, "from": "rank 1"}, rank=1)  # a node without rank 0: logs/ made
    assert json.loads((tmp_path / "logs" / "preemption-rank1.json").read_text())["step"] == 7
    assert run.read_preemption() == {"step": 7, "from": "rank 1"}
    run.write_preemption({"step": 8, "from": "rank 0"})
    assert run.read_preemption() == {"step": 8, "from": "rank 0"}
    old = time.time() - 3600
    for path in (run.preemption, run.rank_preemption(1)):
        os.utime(path, (old, old))
    assert run.read_preemption(since=time.time() - 60) is None  # an earlier launch's
    run.preemption.write_text("{not json")
    os.utime(run.rank_preemption(1), None)
    assert run.read_preemption(since=time.time() - 60) == {"step": 7, "from": "rank 1"}  # unreadable: skipped


def test_the_job_is_read_once_and_names_the_run_directory_for_launcher_and_ranks_alike(tmp_path):
    cfg = run_config(tmp_path)
    slurm_rank = {"SLURM_PROCID": "1", "SLURM_STEP_ID": "0", "SLURM_NTASKS": "2", "SLURM_JOB_ID": "42"}
    job = Job.detect(slurm_rank)
    assert job.environment is not None and job.environment.rank == 1 and job.id == "slurm42"
    assert job.run_dir(cfg) == job.run_dir(cfg) == RunDir(tmp_path / "exp-slurm42")  # every rank, every restart
    assert job.run_dir(cfg, str(tmp_path / "given")).path == tmp_path / "given"  # meshyard's launcher decided
    by_hand = Job.detect({})
    assert by_hand.environment is None and by_hand.id == ""
    launched = by_hand.named("my-job-1")  # run.rdzv_id names a launch of meshyard's own
    assert launched.id == "my-job-1" and by_hand.named("") is by_hand
    assert launched.run_dir(cfg).path == tmp_path / "exp-my-job-1"
    assert by_hand.run_dir(run_config(tmp_path, f"--run.run_dir={tmp_path / 'mine'}")).path == tmp_path / "mine"
