"""Checksums on 2 ranks: each rank hashes the files it wrote (off the training thread for
async saves), rank 0 commits without reading other ranks' shards, and at resume each
rank verifies only its own files."""

from __future__ import annotations

import threading
from pathlib import Path

import pytest
import torch

from meshyard.checkpoint.manager import CheckpointManager
from meshyard.checkpoint.manifest import share
from meshyard.checkpoint.resume import agree_resume_point
from meshyard.checkpoint.state import tensor_state
from meshyard.checkpoint.storage import CheckpointStore
from meshyard.config.load import load_config
from tests.ranks import run_on_ranks


def _record_reads(reads: list[tuple[str, str]]) -> None:
    """Note (file name, thread name) of every file opened for reading through a store."""
    original = CheckpointStore.open

    def recording_open(self: CheckpointStore, path: str, mode: str = "rb"):
        if "r" in mode:
            reads.append((path.rsplit("/", 1)[-1], threading.current_thread().name))
        return original(self, path, mode)

    CheckpointStore.open = recording_open  # a spawned rank's own copy of the class


def _save_then_resume(rank: int, world_size: int, root: str, async_save: bool, corrupt: bool) -> dict:
    reads: list[tuple[str, str]] = []
    _record_reads(reads)
    cfg = load_config(None, [f"--checkpoint.async_save={async_save}"]).checkpoint
    manager = CheckpointManager(cfg, CheckpointStore(root), rank, facts={"world_size": world_size}, run_id="r")
    torch.manual_seed(0)
    model = torch.nn.Linear(64, 64)
    optimizer = torch.optim.AdamW(model.parameters())
    for step in (1, 2):
        manager.save(step, tensor_state(model, optimizer, rank), {"step": step}, {})
        manager.wait()
    saved = list(reads)
    torch.distributed.barrier()
    if corrupt and rank == 0:  # one flipped byte in rank 1's shard of the newest checkpoint
        shard = Path(root) / "step-00000002" / "__1_0.distcp"
        data = bytearray(shard.read_bytes())
        data[len(data) // 2] ^= 0xFF
        shard.write_bytes(bytes(data))
    torch.distributed.barrier()
    reads.clear()
    messages: list[str] = []
    point = agree_resume_point("auto", root, cfg, False, messages.append, rank, world_size)
    return {"saved": saved, "verified": list(reads), "point": point.name, "messages": messages}


def _shards(reads: list[tuple[str, str]]) -> set[str]:
    return {name for name, _ in reads if name.endswith(".distcp")}


@pytest.mark.parametrize("async_save", [True, False])
def test_each_rank_hashes_and_verifies_its_own_files(tmp_path, async_save):
    results = run_on_ranks(_save_then_resume, str(tmp_path), async_save, False)
    for rank, result in enumerate(results):
        assert _shards(result["saved"]) == {f"__{rank}_0.distcp"}, "a rank read a shard it did not write"
        assert _shards(result["verified"]) == {f"__{rank}_0.distcp"}
        assert result["point"] == "step-00000002" and not result["messages"]
        if async_save:
            assert all(thread != "MainThread" for name, thread in result["saved"] if name.endswith(".distcp"))


def test_a_shard_that_fails_on_its_rank_falls_back_on_every_rank(tmp_path):
    rank0, rank1 = run_on_ranks(_save_then_resume, str(tmp_path), True, True)
    assert rank0["point"] == rank1["point"] == "step-00000001"
    assert rank0["messages"] == [f"checkpoint {tmp_path}/step-00000002 is not valid: "
                                 "file __1_0.distcp does not match its SHA-256 checksum"]
    assert _shards(rank0["verified"]) == {"__0_0.distcp"}  # rank 0 found the fault without reading it


def test_share_deals_files_by_writing_rank():
    files = {"__0_0.distcp": {"rank": 0}, "__1_0.distcp": {"rank": 1}, ".metadata": {"rank": 0},
             "trainer_state.json": {"rank": 0}}
    assert share(files, 1, 2) == ["__1_0.distcp"]
    assert share(files, 0, 1) == sorted(files)  # one rank checks everything
    assert share(files, 3, 4) == [] and share(files, 1, 4) == ["__1_0.distcp"]
    legacy = {name: {} for name in files}  # manifests without writers: dealt by position
    assert sorted(share(legacy, 0, 2) + share(legacy, 1, 2)) == sorted(files)
