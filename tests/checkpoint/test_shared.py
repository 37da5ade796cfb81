"""Checkpoint storage that not every rank sees is refused on every rank, in one paragraph.

The job: two gloo ranks in two processes that meet over a TCPStore on 127.0.0.1. Rank
1 runs in a mount namespace of its own (``unshare --mount``) with an empty tmpfs over
one of the checkpoint folders, so there the two ranks really do not share the folder,
as two nodes with local disks do not. The same two processes also open a folder they
do share, ``memory://`` (private to each process), and a root that rank 0 cannot create.
"""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import sys
from datetime import timedelta
from pathlib import Path

import pytest
import torch.distributed as dist

from meshyard.checkpoint.manager import CheckpointManager
from meshyard.checkpoint.shared import PROBE_PREFIX, Probe, Sighting, probe_name, refusal_message
from meshyard.checkpoint.storage import CheckpointStore
from meshyard.config.load import load_config
from meshyard.runtime.hosts import host_label

REPO = Path(__file__).resolve().parents[2]
SCENARIOS = ("shared", "memory", "private", "unwritable")


def open_storage(rank: int, port: int, roots: dict[str, str], out: str) -> None:
    """One rank of the test job: open each root through a ``CheckpointManager`` (which runs
    the check) and write, per scenario, what was raised and what the root holds after."""
    # Rank 0 serves the store: the test process itself keeps no store thread alive.
    store = dist.TCPStore("127.0.0.1", port, is_master=rank == 0, timeout=timedelta(seconds=60))
    dist.init_process_group("gloo", store=store, rank=rank, world_size=2, timeout=timedelta(seconds=60))
    results = {}
    try:
        for scenario, root in roots.items():
            cfg = load_config(None, [f"--checkpoint.dir={root}", "--checkpoint.async_save=false"]).checkpoint
            storage = CheckpointStore(root)
            try:
                CheckpointManager(cfg, storage, rank, run_id="run-x")
                error = None
            except Exception as exc:
                error = {"type": type(exc).__name__, "message": str(exc)}
            dist.barrier()  # rank 0 has removed its probe before anyone lists the folder
            results[scenario] = {"error": error, "listing": sorted(storage.list_dir(storage.root))}
    finally:
        dist.destroy_process_group()
    Path(out).write_text(json.dumps(results))


def _rank_command(rank: int, port: int, roots: dict[str, str], out: Path) -> list[str]:
    code = ("import json, sys; from tests.checkpoint.test_shared import open_storage; "
            "open_storage(int(sys.argv[1]), int(sys.argv[2]), json.loads(sys.argv[3]), sys.argv[4])")
    return [sys.executable, "-c", code, str(rank), str(port), json.dumps(roots), str(out)]


def _private_mount_refusal(folder: Path) -> str | None:
    """Why a process cannot get a private tmpfs over ``folder`` here (None: it can)."""
    if shutil.which("unshare") is None:
        return "needs unshare (util-linux)"
    probe = subprocess.run(["unshare", "--mount", "--propagation", "private", "sh", "-c",
                            f"mount -t tmpfs none '{folder}'"], capture_output=True, text=True)
    if probe.returncode != 0:
        return f"needs permission for mount namespaces and tmpfs mounts (root): {probe.stderr.strip()}"
    return None


@pytest.fixture(scope="module")
def job(tmp_path_factory):
    """Both ranks' results (scenario -> error and listing) and the roots, from one job."""
    base = tmp_path_factory.mktemp("shared")
    private = base / "private"
    private.mkdir()
    refusal = _private_mount_refusal(private)
    if refusal is not None:
        pytest.skip(f"two ranks that do not share a folder {refusal}")
    (base / "a-file").write_text("not a folder")
    roots = {"shared": str(base / "shared"), "memory": "memory://meshyard-probe-test",
             "private": str(private), "unwritable": str(base / "a-file" / "checkpoints")}
    with socket.socket() as probe:  # a free port for rank 0's store
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    outs = [base / f"rank{rank}.json" for rank in (0, 1)]
    env = {**os.environ, "GLOO_SOCKET_IFNAME": "lo", "OMP_NUM_THREADS": "1"}
    rank0 = _rank_command(0, port, roots, outs[0])
    # Rank 1 sees an empty tmpfs where rank 0 sees the real private folder: two nodes' local disks.
    inner = " ".join(f"'{part}'" for part in _rank_command(1, port, roots, outs[1]))
    rank1 = ["unshare", "--mount", "--propagation", "private", "sh", "-c",
             f"mount -t tmpfs none '{private}' && exec {inner}"]
    procs = [subprocess.Popen(cmd, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
             for cmd in (rank0, rank1)]
    try:
        logs = [proc.communicate(timeout=120)[0] for proc in procs]
    finally:
        for proc in procs:
            proc.kill()
    for rank, (proc, log) in enumerate(zip(procs, logs)):
        assert proc.returncode == 0, f"rank {rank} failed:\n{log}"
    return [json.loads(out.read_text()) for out in outs], roots


def test_a_folder_every_rank_sees_passes_and_keeps_nothing(job):
    results, _ = job
    for result in results:
        assert result["shared"] == {"error": None, "listing": []}


def test_a_folder_one_rank_cannot_see_is_refused_on_every_rank(job):
    results, roots = job
    errors = [result["private"]["error"] for result in results]
    assert errors[0] == errors[1], "the ranks must fail alike"
    assert errors[0]["type"] == "ConfigError"
    message = errors[0]["message"]
    host = host_label()  # these ranks meet over loopback: the hostname alone
    assert f"checkpoint.dir = '{roots['private']}' is not shared by every rank" in message
    assert f"rank 0 on host {host} wrote a probe file {roots['private']}/{PROBE_PREFIX}.run-x." in message
    assert f"rank 1 on host {host} (the file is not there) cannot read it back" in message
    assert "every node mounts at the same path" in message and "meshyard[s3]" in message
    assert "ranks 0" not in message and f"rank 0 on host {host} (" not in message  # rank 0 saw its own probe
    assert results[0]["private"]["listing"] == []  # the probe is gone after a refusal too
    assert results[1]["private"]["listing"] == []  # rank 1's own empty folder


def test_memory_storage_is_private_to_each_process(job):
    results, _ = job
    errors = [result["memory"]["error"] for result in results]
    assert errors[0] == errors[1] and errors[0]["type"] == "ConfigError"
    assert "rank 1 on host" in errors[0]["message"] and "memory:// lives inside one process" in errors[0]["message"]
    assert results[0]["memory"]["listing"] == []


def test_a_root_rank0_cannot_create_fails_on_every_rank(job):
    results, roots = job
    errors = [result["unwritable"]["error"] for result in results]
    assert errors[0] == errors[1], "rank 1 must not be left waiting for rank 0"
    assert errors[0]["type"] in ("FileExistsError", "NotADirectoryError")


def test_a_one_rank_job_is_not_probed(tmp_path):
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    cfg = load_config(None, [f"--checkpoint.dir={tmp_path}", "--checkpoint.async_save=false"]).checkpoint
    CheckpointManager(cfg, CheckpointStore(str(tmp_path)), 0, run_id="run-x")
    assert list(tmp_path.iterdir()) == []


def test_stale_probe_of_this_run_is_removed_on_the_next_start(tmp_path):
    (tmp_path / probe_name("run-x", "0123")).write_text("0123")  # rank 0 was killed mid-check
    (tmp_path / probe_name("run-y", "4567")).write_text("4567")  # another run's check may be under way
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    cfg = load_config(None, [f"--checkpoint.dir={tmp_path}", "--checkpoint.async_save=false"]).checkpoint
    CheckpointManager(cfg, CheckpointStore(str(tmp_path)), 0, run_id="run-x")
    assert [p.name for p in tmp_path.iterdir()] == [probe_name("run-y", "4567")]


def test_refusal_groups_ranks_by_host_and_cause(tmp_path):
    store = CheckpointStore(str(tmp_path))
    probe = Probe(f"{tmp_path}/p.tmp", "t", "node-a")
    sightings = [Sighting(0, "node-a", None), Sighting(1, "node-a", None), Sighting(2, "node-b", "the file is not there"),
                 Sighting(3, "node-b", "the file is not there"), Sighting(4, "node-c", "reading it failed: X")]
    message = refusal_message(store, "checkpoint.dir = 'x'", probe, sightings)
    assert message is not None
    assert ("ranks 2, 3 on host node-b (the file is not there); rank 4 on host node-c (reading it failed: X) "
            "cannot read it back") in message
    assert refusal_message(store, "x", probe, sightings[:2]) is None
    remote = refusal_message(CheckpointStore("memory://elsewhere"), "x", probe, sightings)
    assert remote is not None and "memory:// lives inside one process" in remote



def test_meshyard_run_refuses_storage_a_rank_cannot_see_with_exit_code_2(tmp_path):
    """Through the launcher: the workers' refusal reaches the console whole, exit code 2,
    and the agent does not restart workers on it."""
    command = [sys.executable, "-m", "meshyard.cli", "run", "--nproc", "2", "--model.name=gpt-tiny",
               "--data.source=random", "--data.seq_len=16", "--train.steps=2", "--train.global_batch=4",
               "--metrics.progress_bar=false", "--checkpoint.dir=memory://refused", "--fault.max_restarts=2",
               f"--run.run_dir={tmp_path / 'run'}", f"--data.cache_dir={tmp_path / 'cache'}"]
    done = subprocess.run(command, capture_output=True, text=True, timeout=240, cwd=REPO)
    assert done.returncode == 2, done.stderr[-3000:]
    assert "memory:// lives inside one process" in done.stderr and "Traceback" not in done.stderr
    assert "restart 1" not in done.stdout
