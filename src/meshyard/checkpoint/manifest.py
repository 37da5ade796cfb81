"""The manifest: the last file of a checkpoint, and the only proof that it is complete.

It lists every file with its size and SHA-256, plus the step, world size, layout and
config. A checkpoint whose manifest is missing, unreadable or disagrees with the files
is not valid, whatever else is there.
"""

from __future__ import annotations

import hashlib
import time
from typing import Any

from meshyard.checkpoint.storage import CheckpointStore

MANIFEST = "manifest.json"
FORMAT_VERSION = 1
_CHUNK = 4 * 1024 * 1024


def file_digest(store: CheckpointStore, path: str) -> str:
    digest = hashlib.sha256()
    with store.open(path, "rb") as handle:
        while chunk := handle.read(_CHUNK):
            digest.update(chunk)
    return digest.hexdigest()


def build_manifest(store: CheckpointStore, directory: str, facts: dict[str, Any]) -> dict[str, Any]:
    """Describe every file now in ``directory`` (read back from storage, so the sums are of
    what was actually written, not of what was meant to be)."""
    files = {
        name: {"size": size, "sha256": file_digest(store, store.fs.sep.join([directory, name]))}
        for name, size in sorted(store.files_under(directory).items())
        if name != MANIFEST
    }
    return {"format_version": FORMAT_VERSION, "created": time.time(), "files": files, **facts}


def verify(store: CheckpointStore, directory: str, checksums: bool = True) -> tuple[dict[str, Any] | None, str | None]:
    """(manifest, None) when the checkpoint is intact, else (None or manifest, the reason)."""
    manifest_path = store.fs.sep.join([directory, MANIFEST])
    try:
        manifest = store.read_json(manifest_path)
    except FileNotFoundError:
        return None, "no manifest (the save never finished)"
    except (OSError, ValueError) as exc:
        return None, f"unreadable manifest ({exc})"
    if manifest.get("format_version") != FORMAT_VERSION:
        return manifest, f"unknown manifest format {manifest.get('format_version')!r}"
    present = store.files_under(directory)
    for name, expected in manifest.get("files", {}).items():
        if name not in present:
            return manifest, f"file {name} is missing"
        if present[name] != expected["size"]:
            return manifest, f"file {name} has {present[name]} bytes, the manifest says {expected['size']}"
        if checksums and file_digest(store, store.fs.sep.join([directory, name])) != expected["sha256"]:
            return manifest, f"file {name} does not match its SHA-256 checksum"
    return manifest, None
