"""The manifest: the last file of a checkpoint, and the only proof that it is complete.

It lists every file with its size, SHA-256 and the rank that wrote it, plus the step, the
id of the run that saved it, world size, layout and config. A checkpoint whose manifest is
missing, unreadable or disagrees with the files is not valid, whatever else is there.
"""

from __future__ import annotations

import time
from typing import Any

from meshyard.checkpoint.digests import file_digest
from meshyard.checkpoint.storage import CheckpointStore

MANIFEST = "manifest.json"
FORMAT_VERSION = 1  # "rank" per file and "run_id" were added compatibly: older manifests still verify


def build_manifest(files: dict[str, dict[str, Any]], facts: dict[str, Any]) -> dict[str, Any]:
    """The manifest of a checkpoint made of ``files`` (name -> size, sha256, rank), as the
    writing ranks measured them after writing."""
    return {"format_version": FORMAT_VERSION, "created": time.time(), "files": dict(sorted(files.items())), **facts}


def share(files: dict[str, dict[str, Any]], rank: int, world_size: int) -> list[str]:
    """The files ``rank`` of ``world_size`` checks: those a rank r with r % world_size ==
    rank wrote (on the same world size, exactly its own files). Files of manifests that
    name no writer are dealt out by position."""
    return [name for index, (name, entry) in enumerate(sorted(files.items()))
            if int(entry.get("rank", index)) % world_size == rank]


def owner(store: CheckpointStore, directory: str) -> str | None:
    """The run id in the manifest of ``directory``; "" for a manifest that names none (an
    older checkpoint); None when there is no readable manifest."""
    try:
        return str(store.read_json(f"{directory}/{MANIFEST}").get("run_id", ""))
    except (OSError, ValueError):
        return None


def verify(store: CheckpointStore, directory: str, checksums: bool = True, rank: int = 0,
           world_size: int = 1) -> tuple[dict[str, Any] | None, str | None]:
    """(manifest, None) when the checkpoint is intact, else (None or manifest, the reason).

    Every file's presence and size are checked; with ``checksums``, the SHA-256 of this
    rank's ``share`` of the files (all of them when ``world_size`` is 1)."""
    try:
        manifest = store.read_json(f"{directory}/{MANIFEST}")
    except FileNotFoundError:
        return None, "no manifest (the save never finished)"
    except (OSError, ValueError) as exc:
        return None, f"unreadable manifest ({exc})"
    if manifest.get("format_version") != FORMAT_VERSION:
        return manifest, f"unknown manifest format {manifest.get('format_version')!r}"
    files = manifest.get("files", {})
    present = store.files_under(directory)
    for name, expected in files.items():
        if name not in present:
            return manifest, f"file {name} is missing"
        if present[name] != expected["size"]:
            return manifest, f"file {name} has {present[name]} bytes, the manifest says {expected['size']}"
    for name in share(files, rank, world_size) if checksums else []:
        if file_digest(store, f"{directory}/{name}")[1] != files[name]["sha256"]:
            return manifest, f"file {name} does not match its SHA-256 checksum"
    return manifest, None
