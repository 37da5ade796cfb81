"""Whether every rank of a job sees the same checkpoint storage.

A checkpoint is written by all ranks together: each rank writes its own shards and its
checksum record, and rank 0 merges the records into the manifest and publishes the
checkpoint. That works only when every rank writes into one and the same folder. A
local ``checkpoint.dir`` (or the default one inside the run directory) on nodes that do
not share a filesystem gives each node a folder of its own: saves would fail at the
first commit, or leave every node with a part of each checkpoint and none with a whole.

``require_shared_storage`` finds this out once, when the storage is opened and before
any save or load: rank 0 writes a probe file with a random token into the checkpoint
root, every rank reads it back, the verdicts are gathered, and rank 0 removes the probe.
Every rank then raises the same ``ConfigError``, which names the ranks and hosts that
could not see the probe and the fix, so no rank is left waiting in a collective.

Object storage and ``memory://`` are checked as well: the probe costs one small write,
one read per rank and one delete per job start, and it catches what a local check
cannot: nodes without credentials for the bucket, nodes pointed at another endpoint,
and ``memory://`` (private to each process) in a job of several processes.
"""

from __future__ import annotations

import posixpath
import time
import uuid
from dataclasses import dataclass

import torch.distributed as dist

from meshyard.checkpoint.storage import CheckpointStorageError, CheckpointStore
from meshyard.config.load import ConfigError
from meshyard.runtime.hosts import host_label

PROBE_PREFIX = ".meshyard-probe"
# Reads of a missing probe are retried this many times, the waits doubling from the first:
# some shared filesystems (NFS attribute caches, FUSE mounts) show a new file late.
_ATTEMPTS = 4
_FIRST_WAIT_S = 0.1


@dataclass(frozen=True)
class Sighting:
    """What one rank saw of rank 0's probe: ``problem`` is None when it read the token."""

    rank: int
    host: str
    problem: str | None


@dataclass(frozen=True)
class Probe:
    """The probe rank 0 wrote (``path``, ``token``), or why it could not write it (``error``)."""

    path: str = ""
    token: str = ""
    host: str = ""
    error: str | None = None


def probe_name(tag: str, token: str) -> str:
    """The probe's file name. ``tag`` (a run id) and the ``.tmp`` ending make a probe left
    by a killed rank 0 one of the temporary files the checkpoint manager cleans up."""
    return f"{PROBE_PREFIX}.{tag + '.' if tag else ''}{token}.tmp"


def require_shared_storage(store: CheckpointStore, rank: int, world_size: int, where: str = "",
                           tag: str = "") -> None:
    """Raise ``ConfigError`` on every rank unless every rank sees what rank 0 writes into
    ``store``'s root. A collective: every rank of the default process group calls it.

    ``where`` names the folder in the message (default: its URL); ``tag`` goes into the
    probe's name. Raises ``CheckpointStorageError`` on every rank when rank 0 cannot
    write the probe at all. A one-rank job returns at once.
    """
    if world_size <= 1:
        return
    probe = _write_probe(store, tag) if rank == 0 else Probe()
    box = [probe]
    dist.broadcast_object_list(box, src=0)  # also orders every read after rank 0's write
    probe = box[0]
    if probe.error is not None:
        raise CheckpointStorageError(
            f"rank 0 on host {probe.host} cannot write into the checkpoint folder {store.url} ({probe.error}); "
            "check that the folder exists or can be created there, its permissions and free space")
    sightings: list[Sighting | None] = [None] * world_size
    dist.all_gather_object(sightings, Sighting(rank, host_label(), look_for(store, probe)))
    if rank == 0:
        _remove_quietly(store, probe.path)
    refusal = refusal_message(store, where or store.url, probe, [s for s in sightings if s is not None])
    if refusal is not None:
        raise ConfigError([refusal], "checkpoint storage, not shared by every rank")


def _write_probe(store: CheckpointStore, tag: str) -> Probe:
    """Rank 0's probe in the checkpoint root; never raises, so every rank learns the outcome."""
    host, token = host_label(), uuid.uuid4().hex
    path = store.path(probe_name(tag, token))
    try:
        store.makedirs(store.root)
        with store.open(path, "w") as handle:  # not write_text: its temporary name would be a second file
            handle.write(token)
    except Exception as exc:  # reported on every rank by the caller
        return Probe(path, token, host, f"{type(exc).__name__}: {exc}")
    return Probe(path, token, host)


def look_for(store: CheckpointStore, probe: Probe) -> str | None:
    """Why this rank does not see ``probe`` (None: it read the token); never raises."""
    wait = _FIRST_WAIT_S
    for attempt in range(_ATTEMPTS):
        try:
            content = store.read_text(probe.path)
        except FileNotFoundError:
            problem = "the file is not there"
        except Exception as exc:
            return f"reading it failed: {type(exc).__name__}: {exc}"
        else:
            return None if content == probe.token else "the file there holds something else"
        if attempt < _ATTEMPTS - 1:
            time.sleep(wait)
            wait *= 2
    return problem


def _remove_quietly(store: CheckpointStore, path: str) -> None:
    try:
        store.fs.rm(path)
    except Exception:
        pass  # a leftover probe is harmless: a later start of the run removes it with its temporary files


def refusal_message(store: CheckpointStore, where: str, probe: Probe, sightings: list[Sighting]) -> str | None:
    """The paragraph refusing the storage, or None when every rank saw the probe."""
    blind = [s for s in sightings if s.problem is not None]
    if not blind:
        return None
    shown = store.url_of(posixpath.basename(probe.path))  # with the protocol of a remote store
    return (f"{where} is not shared by every rank: rank 0 on host {probe.host} wrote a probe file "
            f"{shown}, and {_who(blind)} cannot read it back. Checkpoints need one folder that every rank "
            f"writes into: each rank writes its own shards and rank 0 assembles the checkpoint from all of them. "
            f"{_fix(store)}")


def _who(blind: list[Sighting]) -> str:
    """'rank 1 on host b (the file is not there)', ranks with one host and problem together."""
    groups: dict[tuple[str, str], list[int]] = {}
    for sighting in sorted(blind, key=lambda s: s.rank):
        groups.setdefault((sighting.host, sighting.problem or ""), []).append(sighting.rank)
    parts = []
    for (host, problem), ranks in groups.items():
        label = f"rank {ranks[0]}" if len(ranks) == 1 else "ranks " + ", ".join(map(str, ranks))
        parts.append(f"{label} on host {host} ({problem})")
    return "; ".join(parts)


def _fix(store: CheckpointStore) -> str:
    protocol = store.fs.protocol[0] if isinstance(store.fs.protocol, (tuple, list)) else store.fs.protocol
    if protocol == "memory":
        return ("memory:// lives inside one process, so it serves only one-process jobs; use a folder every node "
                "mounts at the same path, or object storage such as checkpoint.dir = 's3://bucket/prefix' "
                "(pip install 'meshyard[s3]').")
    if not store.is_local:
        return ("Give every node the same checkpoint.dir, checkpoint.storage_options and credentials for that "
                "storage (from the environment or fsspec's usual sources on each node).")
    return ("Set checkpoint.dir to a folder that every node mounts at the same path (a shared filesystem such as "
            "NFS or Lustre), or to object storage such as checkpoint.dir = 's3://bucket/prefix' "
            "(pip install 'meshyard[s3]').")
