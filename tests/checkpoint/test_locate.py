"""One resolver for user-given locations: ``--resume`` and ``meshyard ckpt`` pick the same
checkpoint for every kind of location, in the order ``locate`` documents."""

from __future__ import annotations

import hashlib
import json
import os
import uuid
from pathlib import Path

import fsspec
import pytest

from meshyard.api import _resume_target
from meshyard.checkpoint.locate import LocationError, Runs, find_checkpoints, latest_run_dir, locate
from meshyard.checkpoint.manager import checkpoint_name
from meshyard.checkpoint.manifest import MANIFEST, build_manifest
from meshyard.checkpoint.resume import ResumeError, checkpoint_root, choose_resume_point, find_explicit
from meshyard.checkpoint.storage import CheckpointStore
from meshyard.checkpoint.tools import list_checkpoints, resolve
from meshyard.cli import main
from meshyard.config.load import ConfigError, load_config

CFG = load_config(None, []).checkpoint


def write_checkpoint(root: str, step: int, valid: bool = True, manifest: bool = True, **facts) -> str:
    """A small checkpoint in the real layout (one shard and a manifest), without DCP:
    resolving reads manifests and file sizes only. ``valid=False`` makes the manifest
    disagree with the shard's size; ``manifest=False`` is a save that never finished.
    ``facts`` go into the manifest (``created``: the commit time, ``run_id``)."""
    store = CheckpointStore(root)
    directory = store.path(checkpoint_name(step))
    store.makedirs(directory)
    payload = f"weights of step {step}".encode()
    with store.open(f"{directory}/shard.bin", "wb") as handle:
        handle.write(payload)
    if manifest:
        entry = {"size": len(payload) + (0 if valid else 1), "sha256": hashlib.sha256(payload).hexdigest(), "rank": 0}
        store.write_text(f"{directory}/{MANIFEST}", json.dumps(build_manifest({"shard.bin": entry}, {"step": step, **facts})))
    return f"{root.rstrip('/')}/{checkpoint_name(step)}"


def a_run(run_dir: Path, *steps: int, created: float | None = None) -> Path:
    for step in steps:
        write_checkpoint(str(run_dir / "checkpoints"), step, **({"created": created} if created else {}))
    return run_dir


def a_run_with_checkpoint_dir(run_dir: Path, folder: Path, run_id: str) -> Path:
    """A run directory as the worker records one whose checkpoints go to ``checkpoint.dir``."""
    run_dir.mkdir(parents=True)
    (run_dir / "run.json").write_text(json.dumps({"run_id": run_id, "checkpoints": str(folder)}))
    return run_dir


def age(*paths: Path) -> None:
    """Folder times that contradict the commit times: the first is the oldest."""
    for n, path in enumerate(paths):
        os.utime(path, (1e9 + n, 1e9 + n))


def both(location: str, options: dict | None = None, messages: list[str] | None = None) -> str:
    """The checkpoint ``--resume location`` and ``meshyard ckpt ... location`` take, once
    checked to be the same one."""
    sink = messages if messages is not None else []
    resumed = find_explicit(location, CFG, sink.append)
    tool = resolve(location, options or {}, report=sink.append)
    assert (resumed.root, resumed.name, resumed.manifest) == (tool.root, tool.name, tool.manifest)
    return resumed.location


@pytest.mark.parametrize("kind", ["checkpoint", "checkpoint folder", "run directory", "file URL", "trailing slash"])
def test_each_kind_of_location_names_the_same_checkpoint_for_both_entry_points(tmp_path, kind):
    run_dir = a_run(tmp_path / "run", 1, 2, 3)
    location, expected = {
        "checkpoint": (f"{run_dir}/checkpoints/step-00000002", "step-00000002"),
        "checkpoint folder": (f"{run_dir}/checkpoints", "step-00000003"),
        "run directory": (str(run_dir), "step-00000003"),
        "file URL": (f"file://{run_dir}", "step-00000003"),
        "trailing slash": (f"{run_dir}/", "step-00000003"),
    }[kind]
    assert both(location).endswith(f"/checkpoints/{expected}")
    # The worker resumes from what rank 0 chooses, through the same resolver.
    point = choose_resume_point(location, str(tmp_path / "fresh" / "checkpoints"), CFG, False, print)
    assert point is not None and point.name == expected


def test_latest_is_the_run_of_the_name_whose_checkpoints_were_committed_last(tmp_path, capsys):
    runs = tmp_path / "runs"
    older, newest = a_run(runs / "exp-1", 1, created=2e9), a_run(runs / "exp-2", 4, 5, created=3e9)
    (runs / "exp-3" / "checkpoints").mkdir(parents=True)  # started, never saved
    a_run(runs / "other-1", 9, created=4e9)  # another name
    a_run(runs / "experiment", 9, created=4e9)  # a name that only starts like it
    age(newest, runs / "exp-3", older)  # a folder touched later (a log, a copy) is not a newer run

    tool = resolve("latest", {}, Runs(str(runs), "exp"))
    config, resume = _resume_target(load_config(None, [f"--run.dir={runs}", "--run.name=exp"]), "latest")
    assert (Path(config.run.run_dir), resume) == (newest, "auto")  # continues that run, in place
    own_root = checkpoint_root(config.checkpoint, Path(config.run.run_dir))
    point = choose_resume_point(resume, own_root, config.checkpoint, False, print)
    assert point.location == tool.location == f"{newest}/checkpoints/step-00000005"

    assert main(["ckpt", "list", "latest", "--runs-dir", str(runs), "--run-name", "exp"]) == 0
    out = capsys.readouterr().out
    assert "step-00000004" in out and "step-00000005" in out and "step-00000001" not in out


def test_checkpoints_kept_in_checkpoint_dir_are_found_for_the_run_and_for_latest(tmp_path):
    runs, folder = tmp_path / "runs", tmp_path / "elsewhere"
    for step in (2, 4):
        write_checkpoint(str(folder), step, run_id="a", created=2e9 + step)
    run_dir = a_run_with_checkpoint_dir(runs / "exp-job-1", folder, "a")
    older = a_run(runs / "exp-job-0", 9, created=1e9)
    age(run_dir, older)
    assert both(str(run_dir)) == f"{folder}/step-00000004"
    assert resolve("latest", {}, Runs(str(runs), "exp")).location == f"{folder}/step-00000004"
    config, resume = _resume_target(load_config(None, [f"--run.dir={runs}", "--run.name=exp",
                                                       f"--checkpoint.dir={folder}"]), "latest")
    assert (Path(config.run.run_dir), resume) == (run_dir, "auto")
    own_root = checkpoint_root(config.checkpoint, run_dir)
    assert choose_resume_point(resume, own_root, config.checkpoint, False, print).name == "step-00000004"


def test_of_runs_sharing_a_checkpoint_dir_latest_is_the_one_that_saved_its_newest_checkpoint(tmp_path):
    """One checkpoint.dir for every run of a config: the runs continue one line of steps,
    and the run continued is the one whose newest checkpoint it is."""
    runs, shared = tmp_path / "runs", tmp_path / "shared"
    first = a_run_with_checkpoint_dir(runs / "exp-1", shared, "run-1")
    second = a_run_with_checkpoint_dir(runs / "exp-2", shared, "run-2")
    write_checkpoint(str(shared), 2, run_id="run-1", created=1e9)
    write_checkpoint(str(shared), 4, run_id="run-2", created=2e9)  # the second run resumed from step 2
    age(second, first)
    assert latest_run_dir(Runs(str(runs), "exp")) == second
    write_checkpoint(str(shared), 6, run_id="run-1", created=3e9)  # and then the first from step 4
    age(first, second)
    assert latest_run_dir(Runs(str(runs), "exp")) == first
    assert resolve("latest", {}, Runs(str(runs), "exp")).location == f"{shared}/step-00000006"


def test_latest_without_a_run_is_a_clear_error(tmp_path, capsys):
    with pytest.raises(ConfigError, match="no run directory named 'exp'.*--resume none"):
        _resume_target(load_config(None, [f"--run.dir={tmp_path}", "--run.name=exp"]), "latest")
    assert main(["ckpt", "inspect", "latest", "--runs-dir", str(tmp_path), "--run-name", "exp"]) == 2
    assert "no run directory named 'exp'" in capsys.readouterr().err
    with pytest.raises(LocationError, match="give a path"):
        locate("latest", {})  # no runs to look in


@pytest.fixture
def bucket():
    name = f"locate-{uuid.uuid4().hex[:8]}"
    yield f"memory://{name}"
    fs = fsspec.filesystem("memory")
    if fs.exists(f"/{name}"):
        fs.rm(f"/{name}", recursive=True)


def test_memory_url(bucket):
    run = f"{bucket}/run"
    for step in (2, 4):
        write_checkpoint(f"{run}/checkpoints", step)
    assert both(run) == both(f"{run}/checkpoints") == f"{run}/checkpoints/step-00000004"
    assert both(f"{run}/checkpoints/step-00000002") == f"{run}/checkpoints/step-00000002"
    assert [row["name"] for row in list_checkpoints(run, {})] == ["step-00000002", "step-00000004"]
    with pytest.raises(ResumeError, match=f"--resume {bucket}/elsewhere does not exist"):
        find_explicit(f"{bucket}/elsewhere", CFG, print)


def test_a_checkpoint_folder_that_is_a_whole_bucket(bucket):
    write_checkpoint(bucket, 1)
    assert both(bucket) == f"{bucket}/step-00000001"


def test_missing_or_empty_locations_fail_naming_the_location_and_the_fix(tmp_path, capsys):
    missing = tmp_path / "nowhere"
    with pytest.raises(ResumeError, match=f"--resume {missing} does not exist; give a checkpoint"):
        find_explicit(str(missing), CFG, print)
    run_dir = tmp_path / "run"
    assert main(["run", "--resume", str(missing), f"--run.run_dir={run_dir}", "--data.source=random"]) == 2
    assert f"--resume {missing} does not exist" in capsys.readouterr().err and not run_dir.exists()
    with pytest.raises(LocationError, match="holds no checkpoint: it has no manifest.json"):
        resolve(str(tmp_path), {})
    for command in ("list", "inspect", "export"):
        extra = ["--out", str(tmp_path / "model.pt")] if command == "export" else []
        assert main(["ckpt", command, str(missing), *extra]) == 2
        err = capsys.readouterr().err
        assert f"meshyard ckpt: {missing} does not exist; give a checkpoint" in err and "Traceback" not in err


def test_an_invalid_checkpoint_is_skipped_for_an_older_one(tmp_path):
    folder = str(tmp_path / "checkpoints")
    write_checkpoint(folder, 1)
    write_checkpoint(folder, 2, valid=False)
    write_checkpoint(folder, 3, manifest=False)  # a save that never finished
    messages: list[str] = []
    assert both(folder, messages=messages) == f"{folder}/step-00000001"
    assert any("step-00000003 is not valid: no manifest" in m for m in messages)
    assert any("step-00000002 is not valid: file shard.bin has" in m for m in messages)
    # Named exactly, a damaged checkpoint is never swapped for another: resuming refuses
    # it, the tools show it as it is.
    with pytest.raises(ResumeError, match="step-00000002 is a checkpoint but not a valid one: file shard.bin"):
        find_explicit(f"{folder}/step-00000002", CFG, print)
    assert resolve(f"{folder}/step-00000003", {}).name == "step-00000003"
    with pytest.raises(ResumeError, match="not a valid one: no manifest"):
        find_explicit(f"{folder}/step-00000003", CFG, print)


def test_a_folder_of_invalid_checkpoints_fails(tmp_path):
    folder = str(tmp_path / "checkpoints")
    write_checkpoint(folder, 1, valid=False)
    with pytest.raises(ResumeError, match="none of the 1 checkpoints in .* is valid"):
        find_explicit(str(tmp_path), CFG, print)
    with pytest.raises(LocationError, match="none of the 1 checkpoints"):
        resolve(str(tmp_path), {}, report=print)


def test_checksum_failures_found_at_resume_are_skipped(tmp_path):
    folder = str(tmp_path / "checkpoints")
    newest = [write_checkpoint(folder, step) for step in (1, 2)][-1]
    rejected = {newest: "file shard.bin does not match its SHA-256 checksum"}
    assert find_explicit(str(tmp_path), CFG, print, rejected).name == "step-00000001"
    assert choose_resume_point("auto", folder, CFG, False, print, rejected).name == "step-00000001"
    with pytest.raises(ResumeError, match="SHA-256"):
        find_explicit(newest, CFG, print, rejected)


def test_an_ambiguous_folder_is_read_in_the_documented_order(tmp_path, monkeypatch):
    # A folder that holds checkpoints and also a 'checkpoints' folder of them: its own win.
    folder = tmp_path / "both"
    write_checkpoint(str(folder), 5)
    a_run(folder, 9)
    assert find_checkpoints(str(folder), {}).root == str(folder)
    assert both(str(folder)) == f"{folder}/step-00000005"
    # A checkpoint is itself before anything found below it.
    checkpoint = Path(write_checkpoint(str(tmp_path / "one"), 7))
    a_run(checkpoint, 9)
    assert both(str(checkpoint)) == str(checkpoint)
    # The word 'latest' is the keyword; './latest' is a path.
    a_run(tmp_path / "latest", 3)
    monkeypatch.chdir(tmp_path)
    assert both("./latest") == "./latest/checkpoints/step-00000003"
