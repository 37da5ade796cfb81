"""Checksums of checkpoint files, taken by the rank that wrote them.

Each rank hashes the shard files it has just written (reading them back, so the sums are
of what storage holds, not of what was meant to be written) and leaves the sums in a small
``digests.rank<N>.json`` beside them. At commit rank 0 merges those records into the
manifest; it never reads another rank's shards.

Why records on storage and not a gather: an async save writes from a background thread,
and a collective on the default group from that thread could interleave with the training
step's collectives and deadlock. The record is written inside DCP's ``write_data``, which
returns before DCP's own gather of write results (on the process group the save runs on:
the checkpoint's own gloo group for async saves). DCP's coordinator (rank 0) writes
``.metadata`` only after every rank's results have arrived, so once rank 0's save has
finished, every rank's record is on storage. The ordering comes from collectives DCP runs
anyway; this module issues none, from any thread.
"""

from __future__ import annotations

import hashlib
import json
from typing import IO, Any, Protocol

from torch.distributed.checkpoint import FileSystemWriter
from torch.distributed.checkpoint._fsspec_filesystem import FsspecWriter
from torch.distributed.checkpoint.planner import SavePlan, SavePlanner
from torch.distributed.checkpoint.storage import WriteResult
from torch.futures import Future



class CheckpointStore(Protocol):
    """What digesting needs of a store (``checkpoint.storage.CheckpointStore``, which builds
    the writers below and so cannot be imported here)."""

    fs: Any

    def open(self, path: str, mode: str = "rb") -> IO[bytes]: ...

    def exists(self, path: str) -> bool: ...

    def read_json(self, path: str) -> Any: ...

    def write_text(self, path: str, text: str) -> None: ...


_CHUNK = 4 * 1024 * 1024
DCP_METADATA = ".metadata"


def record_name(rank: int) -> str:
    """File name of ``rank``'s checksum record inside the checkpoint being written."""
    return f"digests.rank{rank}.json"


def file_digest(store: CheckpointStore, path: str) -> tuple[int, str]:
    """(size, SHA-256) of a file as storage returns it."""
    digest, size = hashlib.sha256(), 0
    with store.open(path, "rb") as handle:
        while chunk := handle.read(_CHUNK):
            digest.update(chunk)
            size += len(chunk)
    return size, digest.hexdigest()


def digest_files(store: CheckpointStore, directory: str, names: list[str], rank: int) -> dict[str, dict[str, Any]]:
    """Manifest entries of ``names`` in ``directory``, marked as written by ``rank``."""
    entries = {}
    for name in names:
        size, sha256 = file_digest(store, f"{directory}/{name}")
        entries[name] = {"size": size, "sha256": sha256, "rank": rank}
    return entries


def collect_records(store: CheckpointStore, directory: str, world_size: int) -> dict[str, dict[str, Any]]:
    """Every rank's record merged (rank 0 at commit); a missing record fails the commit."""
    files: dict[str, dict[str, Any]] = {}
    for rank in range(world_size):
        try:
            files.update(store.read_json(f"{directory}/{record_name(rank)}"))
        except FileNotFoundError:
            raise FileNotFoundError(f"rank {rank} left no checksum record in {directory}") from None
    return files


def remove_records(store: CheckpointStore, directory: str, world_size: int) -> None:
    """The records are merged into the manifest; the published checkpoint holds no extra files."""
    paths = [f"{directory}/{record_name(rank)}" for rank in range(world_size)]
    store.fs.rm([p for p in paths if store.exists(p)])


class _RecordsDigests:
    """Mixin for DCP's file writers: after this rank's files are written, hash them and
    record the sums next to them (in whatever thread DCP writes from)."""

    def __init__(self, *args: Any, store: CheckpointStore, directory: str, rank: int, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._store, self._directory, self._rank = store, directory, rank

    def write_data(self, plan: SavePlan, planner: SavePlanner) -> Future[list[WriteResult]]:
        results: list[WriteResult] = super().write_data(plan, planner).wait()  # type: ignore[misc]
        names = sorted({result.storage_data.relative_path for result in results})
        entries = digest_files(self._store, self._directory, names, self._rank)
        self._store.write_text(f"{self._directory}/{record_name(self._rank)}", json.dumps(entries))
        done: Future[list[WriteResult]] = Future()
        done.set_result(results)
        return done


class DigestingFileSystemWriter(_RecordsDigests, FileSystemWriter):
    """DCP's local writer, recording this rank's checksums."""


class DigestingFsspecWriter(_RecordsDigests, FsspecWriter):
    """DCP's fsspec writer, recording this rank's checksums."""
