"""The checkpoint manager in one process: commit protocol, retention, failures, verification,
and several runs sharing one checkpoint folder; on two ranks, the one run id of a job."""

from __future__ import annotations

import errno
import hashlib
import json

import fsspec
import pytest
import torch
import torch.distributed as dist
from fsspec.implementations.memory import MemoryFileSystem

from meshyard.checkpoint.manager import CheckpointManager, find_latest_valid
from meshyard.checkpoint.manifest import verify
from meshyard.checkpoint.state import tensor_state
from meshyard.checkpoint.storage import CheckpointStore
from meshyard.config.load import load_config
from tests.ranks import run_on_ranks


@pytest.fixture
def one_rank():
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    yield
    dist.destroy_process_group()


def make_manager(root: str, *overrides: str, messages: list[str] | None = None,
                 run_id: str = "run-a") -> CheckpointManager:
    cfg = load_config(None, list(overrides)).checkpoint
    sink = messages if messages is not None else []
    return CheckpointManager(cfg, CheckpointStore(root, cfg.storage_options), rank=0, report=sink.append,
                             facts={"world_size": 1}, run_id=run_id)


def state(model, optimizer):
    return tensor_state(model, optimizer, rank=0)


@pytest.fixture
def model_and_optimizer():
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 3)
    optimizer = torch.optim.AdamW(model.parameters())
    model(torch.randn(2, 4)).sum().backward()
    optimizer.step()
    return model, optimizer


def save(manager, step, model, optimizer, eval_loss=None, blocking=False):
    manager.save(step, state(model, optimizer), {"progress": {"step": step}}, {"eval_loss": eval_loss},
                 blocking=blocking)


@pytest.mark.parametrize("async_save", [True, False])
def test_commit_protocol_and_retention(one_rank, tmp_path, model_and_optimizer, async_save):
    model, optimizer = model_and_optimizer
    manager = make_manager(str(tmp_path), "--checkpoint.keep_last=2", f"--checkpoint.async_save={async_save}")
    losses = {1: 3.0, 2: 1.0, 3: 2.0, 4: 2.5, 5: 2.4}  # the best (step 2) is not among the newest
    for step, loss in losses.items():
        save(manager, step, model, optimizer, eval_loss=loss)
        manager.poll()
    manager.wait()
    names = sorted(p.name for p in tmp_path.iterdir())
    assert names == ["latest", "step-00000002", "step-00000004", "step-00000005"]
    assert (tmp_path / "latest").read_text().strip() == "step-00000005"
    manifest = json.loads((tmp_path / "step-00000005" / "manifest.json").read_text())
    assert manifest["step"] == 5 and manifest["world_size"] == 1 and manifest["eval_loss"] == 2.4
    assert manifest["run_id"] == "run-a"
    assert {".metadata", "trainer_state.json", "__0_0.distcp"} == set(manifest["files"])
    # The sums, taken by the writing rank, are those of the files as published.
    for name, entry in manifest["files"].items():
        data = (tmp_path / "step-00000005" / name).read_bytes()
        assert entry == {"size": len(data), "sha256": hashlib.sha256(data).hexdigest(), "rank": 0}
    published = sorted(p.name for p in (tmp_path / "step-00000005").iterdir())
    assert published == sorted([*manifest["files"], "manifest.json"])  # no checksum records left behind
    assert [o.step for o in manager.outcomes if o.name] == [1, 2, 3, 4, 5]


@pytest.mark.parametrize("where", ["local", "memory://copy-ahead"])
def test_async_writes_of_host_staged_state_take_no_device_copy_ahead(one_rank, tmp_path, model_and_optimizer, where):
    """An async save writes the staged host copy: DCP's serial loader (copy-ahead 0), not its
    overlapping one, which synchronizes the CUDA stream from the writer thread. Blocking
    saves keep DCP's default."""
    manager = make_manager(str(tmp_path) if where == "local" else where, "--checkpoint.async_save=true")
    writers = []
    build = manager.store.dcp_writer
    manager.store.dcp_writer = lambda *args, **kwargs: writers.append(build(*args, **kwargs)) or writers[-1]
    save(manager, 1, *model_and_optimizer)
    save(manager, 2, *model_and_optimizer, blocking=True)
    manager.wait()
    manager.close()
    assert [o.step for o in manager.outcomes if o.name] == [1, 2]
    assert writers[0].per_thread_copy_ahead == 0
    assert writers[1].per_thread_copy_ahead > 0


def test_half_written_checkpoint_is_never_valid(one_rank, tmp_path, model_and_optimizer):
    model, optimizer = model_and_optimizer
    manager = make_manager(str(tmp_path), "--checkpoint.async_save=false")
    save(manager, 3, model, optimizer)
    # A crash mid-save leaves a staging folder: ignored by readers, removed by the next
    # manager of the same run; another run's (maybe in progress) stays.
    for partial in ("step-00000006.run-a.partial", "step-00000006.run-b.partial"):
        (tmp_path / partial).mkdir()
        (tmp_path / partial / "__0_0.distcp").write_bytes(b"partial")
    (tmp_path / "latest.run-a.0123abcd.tmp").write_text("step-00000006")
    (tmp_path / "latest.run-b.4567cdef.tmp").write_text("step-00000006")
    # A published folder without its manifest (a remote store mid-write) is not valid either.
    (tmp_path / "step-00000009").mkdir()
    messages: list[str] = []
    store = CheckpointStore(str(tmp_path))
    name, _ = find_latest_valid(store, report=messages.append)
    assert name == "step-00000003"
    assert "step-00000009 is not valid: no manifest" in messages[0]
    make_manager(str(tmp_path))
    assert not (tmp_path / "step-00000006.run-a.partial").exists()
    assert not (tmp_path / "latest.run-a.0123abcd.tmp").exists()
    assert (tmp_path / "step-00000006.run-b.partial" / "__0_0.distcp").exists()
    assert (tmp_path / "latest.run-b.4567cdef.tmp").exists()


def test_verify_detects_truncation_and_missing_files(one_rank, tmp_path, model_and_optimizer):
    model, optimizer = model_and_optimizer
    manager = make_manager(str(tmp_path), "--checkpoint.async_save=false")
    save(manager, 1, model, optimizer)
    store, directory = CheckpointStore(str(tmp_path)), str(tmp_path / "step-00000001")
    assert verify(store, directory)[1] is None
    shard = tmp_path / "step-00000001" / "__0_0.distcp"
    shard.write_bytes(shard.read_bytes()[:-10])
    assert "bytes, the manifest says" in verify(store, directory)[1]
    shard.unlink()
    assert verify(store, directory)[1] == "file __0_0.distcp is missing"


class FullDiskFS(MemoryFileSystem):
    """An in-memory store whose writes fail with ENOSPC once ``full`` is set."""

    protocol = "fulldisk"
    full = False

    def _open(self, path, mode="rb", **kwargs):
        if FullDiskFS.full and ("w" in mode or "a" in mode):
            raise OSError(errno.ENOSPC, "No space left on device", path)
        return super()._open(path, mode, **kwargs)


@pytest.mark.parametrize("async_save", [True, False])
def test_storage_error_keeps_previous_checkpoint(one_rank, model_and_optimizer, async_save):
    fsspec.register_implementation("fulldisk", FullDiskFS, clobber=True)
    model, optimizer = model_and_optimizer
    root = f"fulldisk://bucket-{async_save}"
    messages: list[str] = []
    manager = make_manager(root, f"--checkpoint.async_save={async_save}", messages=messages)
    FullDiskFS.full = False
    save(manager, 1, model, optimizer)
    manager.wait()
    FullDiskFS.full = True
    try:
        save(manager, 2, model, optimizer)
        manager.wait()
    finally:
        FullDiskFS.full = False
    assert len(messages) == 1
    assert "checkpoint of step 2 failed" in messages[0] and "No space left on device" in messages[0]
    assert "earlier checkpoints are intact" in messages[0] and "Traceback" not in messages[0]
    assert [o.error is not None for o in manager.outcomes] == [False, True]
    store = CheckpointStore(root)
    assert find_latest_valid(store, report=messages.append)[0] == "step-00000001"


def test_time_based_saving_is_decided_by_rank_0_clock(one_rank, tmp_path):
    manager = make_manager(str(tmp_path), "--checkpoint.interval_minutes=0.001", "--checkpoint.interval=0")
    assert not manager.due(5)  # step-based saving is off
    import time

    time.sleep(0.1)
    assert manager.time_due()
    manager.rank = 1
    assert not manager.time_due()  # other ranks follow rank 0 through the step's all-reduce


@pytest.mark.parametrize("async_save", [True, False])
def test_runs_sharing_a_folder_delete_only_their_own(one_rank, tmp_path, model_and_optimizer, async_save):
    model, optimizer = model_and_optimizer
    mode = f"--checkpoint.async_save={async_save}"
    run_a = make_manager(str(tmp_path), "--checkpoint.keep_last=2", mode, run_id="run-a")
    for step in (1, 2, 3):
        save(run_a, step, model, optimizer, eval_loss=float(step))
    run_a.wait()
    (tmp_path / "step-00000009.run-a.partial").mkdir()  # run A is mid-save
    # Run B starts in the same folder (its cleanup runs now) and saves more often than it keeps.
    messages: list[str] = []
    run_b = make_manager(str(tmp_path), "--checkpoint.keep_last=1", mode, run_id="run-b", messages=messages)
    for step in (4, 5, 6):
        save(run_b, step, model, optimizer, eval_loss=9.0)
        run_b.poll()
    run_b.wait()
    names = sorted(p.name for p in tmp_path.iterdir() if p.name.startswith("step-"))
    # A's retained checkpoints (its best and newest two) and its partial survive B's cleanup
    # and retention; B keeps its newest and (keep_best) its first, all at eval loss 9.0.
    assert names == ["step-00000001", "step-00000002", "step-00000003", "step-00000004", "step-00000006",
                     "step-00000009.run-a.partial"]
    assert [m["run_id"] for _, m in run_b.own_committed()] == ["run-b", "run-b"]
    assert not messages


def test_a_run_never_writes_over_another_runs_checkpoint(one_rank, tmp_path, model_and_optimizer):
    model, optimizer = model_and_optimizer
    run_a = make_manager(str(tmp_path), "--checkpoint.async_save=false", run_id="run-a")
    save(run_a, 3, model, optimizer)
    before = (tmp_path / "step-00000003" / "manifest.json").read_text()
    messages: list[str] = []
    run_b = make_manager(str(tmp_path), "--checkpoint.async_save=false", run_id="run-b", messages=messages)
    save(run_b, 3, model, optimizer)
    assert (tmp_path / "step-00000003" / "manifest.json").read_text() == before
    assert "already holds a checkpoint of another run (run-a)" in messages[0]
    assert [o.name for o in run_b.outcomes] == [None]


def test_in_place_saves_of_two_runs_do_not_collide(one_rank, model_and_optimizer):
    """Object stores have no staging name: an unfinished save is claimed by a marker."""
    model, optimizer = model_and_optimizer
    root = "memory://shared-folder"
    fs = fsspec.filesystem("memory")
    run_a = make_manager(root, "--checkpoint.async_save=false", run_id="run-a")
    run_a._claim("/shared-folder/step-00000007", "/shared-folder/step-00000007")  # A's save is under way
    fs.pipe("/shared-folder/step-00000007/__0_0.distcp", b"A's shard")
    messages: list[str] = []
    run_b = make_manager(root, "--checkpoint.async_save=false", run_id="run-b", messages=messages)
    save(run_b, 7, model, optimizer)
    assert fs.cat("/shared-folder/step-00000007/__0_0.distcp") == b"A's shard"
    assert "another run (run-a)" in messages[0]
    save(run_a, 7, model, optimizer)  # A's own leftover is its to replace
    store = CheckpointStore(root)
    assert verify(store, "/shared-folder/step-00000007")[1] is None
    assert not fs.exists("/shared-folder/step-00000007/run_id.txt")
    fs.rm("/shared-folder", recursive=True)


def _save_without_a_run_id(rank: int, world_size: int, root: str) -> str:
    cfg = load_config(None, ["--checkpoint.async_save=false"]).checkpoint
    manager = CheckpointManager(cfg, CheckpointStore(root), rank, facts={"world_size": world_size})
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 3)
    manager.save(1, state(model, torch.optim.AdamW(model.parameters())), {"step": 1}, {})
    return manager.run_id


def test_ranks_given_no_run_id_take_one_between_them(tmp_path):
    """Ranks stage their shards under the run id: two ids in one job would split a save."""
    ids = run_on_ranks(_save_without_a_run_id, str(tmp_path))
    assert ids[0] == ids[1] and len(ids[0]) == 12
    manifest, problem = verify(CheckpointStore(str(tmp_path)), str(tmp_path / "step-00000001"))
    assert problem is None and manifest["run_id"] == ids[0] and manifest["world_size"] == 2
    assert sorted({entry["rank"] for entry in manifest["files"].values()}) == [0, 1]


@pytest.mark.parametrize("disk", ["fine", "full"])
def test_async_saves_shorten_gil_turns_until_their_commit(one_rank, model_and_optimizer, disk):
    """The save's background Python shares the GIL with the training thread: turns are short
    from the save call to the end of its commit (runtime/gil_turns.py), also when it fails."""
    import sys

    from meshyard.runtime.gil_turns import BACKGROUND_SWITCH_INTERVAL_S

    fsspec.register_implementation("fulldisk", FullDiskFS, clobber=True)
    messages: list[str] = []
    manager = make_manager(f"fulldisk://turns-{disk}", "--checkpoint.async_save=true", messages=messages)
    seen = []
    write = manager._commit_when_written
    manager._commit_when_written = lambda *args: seen.append(sys.getswitchinterval()) or write(*args)
    before = sys.getswitchinterval()
    FullDiskFS.full = disk == "full"
    try:
        save(manager, 1, *model_and_optimizer)
        manager.wait()
    finally:
        FullDiskFS.full = False
    manager.close()
    # A full disk fails the save before its background part (in async_save's set-up).
    assert seen == ([pytest.approx(min(before, BACKGROUND_SWITCH_INTERVAL_S))] if disk == "fine" else [])
    assert sys.getswitchinterval() == before
    assert [o.error is None for o in manager.outcomes] == [disk == "fine"]
