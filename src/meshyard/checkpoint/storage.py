"""Checkpoint storage on a local path or an fsspec URL (s3://, memory://, file://).

Publishing differs by kind of storage. A local directory is written under a temporary
name and renamed into place, which is atomic. Object stores have no atomic rename of a
prefix, so there a checkpoint is written in place and becomes valid only when its
manifest, written last, appears. Readers trust nothing without a verified manifest.

Storage options may come from a recorded config whose credentials were redacted: those
entries are left out here, so fsspec takes credentials from its usual sources instead
(environment variables, ~/.aws/credentials, instance roles, gcloud defaults).
"""

from __future__ import annotations

import json
import os
import posixpath
import uuid
from typing import Any

import fsspec
from fsspec.implementations.local import LocalFileSystem
from torch.distributed.checkpoint import FileSystemReader, FileSystemWriter
from torch.distributed.checkpoint._fsspec_filesystem import FsspecReader, FsspecWriter
from torch.distributed.checkpoint.storage import StorageReader, StorageWriter

from meshyard.checkpoint.digests import DigestingFileSystemWriter, DigestingFsspecWriter
from meshyard.config.dump import REDACTED


class CheckpointStorageError(OSError):
    """Reading or writing checkpoint storage failed; the message names the path and the cause."""


class CheckpointStore:
    """One checkpoint root directory and the file operations meshyard needs on it."""

    def __init__(self, root: str, storage_options: dict[str, Any] | None = None) -> None:
        self.url = root
        self.options = usable_options(storage_options or {})
        self.fs, self.root = fsspec.core.url_to_fs(root, **self.options)
        self.is_local = isinstance(self.fs, LocalFileSystem)

    def path(self, *parts: str) -> str:
        return posixpath.join(self.root, *parts)

    def url_of(self, name: str) -> str:
        """A location usable by a later process (keeps the protocol of remote stores)."""
        if self.is_local:
            return self.path(name)
        return f"{self.url.rstrip('/')}/{name}"

    # small files -----------------------------------------------------------------
    def write_text(self, path: str, text: str, tag: str = "") -> None:
        """Write a small file so readers see either the old or the new content. ``tag``
        goes into the temporary file's name (a run id: each run cleans up only its own)."""
        if self.is_local:
            tmp = f"{path}.{tag + '.' if tag else ''}{uuid.uuid4().hex[:8]}.tmp"
            with open(tmp, "w") as handle:
                handle.write(text)
                handle.flush()
                os.fsync(handle.fileno())
            os.replace(tmp, path)
            _fsync_dir(os.path.dirname(path))
        else:
            with self.fs.open(path, "w") as handle:  # a single PUT: atomic on object stores
                handle.write(text)

    def read_text(self, path: str) -> str:
        with self.fs.open(path, "r") as handle:
            return handle.read()

    def read_json(self, path: str) -> dict[str, Any]:
        return json.loads(self.read_text(path))

    def exists(self, path: str) -> bool:
        return self.fs.exists(path)

    # directories -------------------------------------------------------------------
    def list_dir(self, path: str) -> list[str]:
        if not self.fs.exists(path):
            return []
        return [posixpath.basename(p.rstrip("/")) for p in self.fs.ls(path, detail=False)]

    def files_under(self, path: str) -> dict[str, int]:
        """Relative path -> size of every file below ``path``."""
        found = self.fs.find(path, detail=True)
        prefix = path.rstrip("/") + "/"
        return {name[len(prefix):] if name.startswith(prefix) else name: int(info["size"])
                for name, info in found.items() if info.get("type", "file") == "file"}

    def makedirs(self, path: str) -> None:
        self.fs.makedirs(path, exist_ok=True)

    def remove_tree(self, path: str) -> None:
        if self.fs.exists(path):
            self.fs.rm(path, recursive=True)

    def publish(self, staging: str, final: str) -> None:
        """Make a fully written checkpoint visible under its final name."""
        if staging == final:
            return
        os.rename(staging, final)  # local only: object stores write in place
        _fsync_dir(os.path.dirname(final))

    def open(self, path: str, mode: str = "rb"):
        return self.fs.open(path, mode)

    # DCP ---------------------------------------------------------------------------
    def dcp_writer(self, path: str, rank: int | None = None, host_staged: bool = False) -> StorageWriter:
        """A DCP writer into ``path``; with ``rank``, one that also records the checksums
        of the files this rank wrote (see ``digests``). ``host_staged``: the state it
        writes is already in host memory (an async save's staged copy)."""
        if rank is None:
            local, remote, extra = FileSystemWriter, FsspecWriter, {}
        else:
            local, remote = DigestingFileSystemWriter, DigestingFsspecWriter
            extra = {"store": self, "directory": path, "rank": rank}
        if host_staged:
            # Nothing to copy off a device: no copy-ahead, which takes DCP's serial loader.
            # Its overlapping loader would synchronize the current CUDA stream every 10 MB
            # from the writer thread, waiting on the training steps queued there.
            extra["per_thread_copy_ahead"] = 0
        if self.is_local:
            return local(path, sync_files=True, **extra)
        return remote(self._url_for(path), sync_files=True, **extra, **self.options)

    def dcp_reader(self, path: str) -> StorageReader:
        if self.is_local:
            return FileSystemReader(path)
        return FsspecReader(self._url_for(path), **self.options)

    def _url_for(self, path: str) -> str:
        protocol = self.fs.protocol[0] if isinstance(self.fs.protocol, (tuple, list)) else self.fs.protocol
        return path if "://" in path else f"{protocol}://{path.lstrip('/') if protocol != 'memory' else path}"


def usable_options(options: dict[str, Any]) -> dict[str, Any]:
    """``options`` without redacted entries (at any depth), which fsspec must not receive."""
    return {key: usable_options(value) if isinstance(value, dict) else value
            for key, value in options.items() if value != REDACTED}


def _fsync_dir(path: str) -> None:
    """Persist a rename: without it a power loss can forget the new directory entry."""
    try:
        fd = os.open(path or ".", os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
