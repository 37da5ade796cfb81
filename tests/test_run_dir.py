"""Run directories are named after the job, so a restarted job finds its own; the run id
in one is decided once, and the same wherever it is derived."""

from __future__ import annotations

from pathlib import Path

from meshyard.config.load import load_config
from meshyard.run_dir import derived_run_id, resolve_run_dir, restart_advice, run_id_of


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
