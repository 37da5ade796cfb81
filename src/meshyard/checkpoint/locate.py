"""From a location a user typed to one checkpoint: the single resolver behind ``--resume``
and ``meshyard ckpt``.

A location is a local path or an fsspec URL (``s3://``, ``memory://``, ``file://``) and
names one of:

- a checkpoint: a folder with a ``manifest.json``, or one named ``step-NNNNNNNN`` (a save
  that never finished has no manifest: it is still the checkpoint named, reported as not
  valid rather than "not found");
- a checkpoint folder: it holds ``step-NNNNNNNN`` checkpoints (``checkpoint.dir``);
- a run directory: the checkpoint folder its ``run.json`` records (``checkpoint.dir``
  when the run set one), else its ``checkpoints`` folder, holds them;
- ``latest``: the run directory named ``<run.name>`` or ``<run.name>-*`` under
  ``run.dir`` whose checkpoints were committed last (the word is a keyword; write
  ``./latest`` for a folder of that name).

They are tried in exactly that order, and the first that matches decides, even if it
holds nothing valid. The order goes from the most specific reading to the least: each
step looks one level deeper than the one before, so what the user named wins over
whatever lies beneath it. A folder is ambiguous only when it holds ``step-*`` checkpoints
and also a ``checkpoints`` folder of them (a run whose ``checkpoint.dir`` was its own run
directory, reused with the default); its own checkpoints are the ones the user pointed at,
and this is the order ``--resume`` always used, so resuming picks the same checkpoint as
before.

A ``checkpoint.dir`` is one folder for every run of the config that sets it, not one per
run: the runs that resume from it continue one line of steps, each manifest naming the run
that saved it. Out of such a folder, too, the checkpoint of the highest step is the
newest, whichever run saved it; ``latest`` then takes the run that saved it, so the run
continued is the one whose checkpoints they are (see ``latest_run_dir``).

Out of a folder the newest valid checkpoint is taken (manifests and file sizes; checksums
are the caller's, see ``resume.agree_resume_point``), older ones after a report of why the
newer ones were skipped. A checkpoint named exactly is never swapped for another one.
"""

from __future__ import annotations

import posixpath
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Mapping, NamedTuple

from meshyard.checkpoint.manager import find_latest_valid, step_of
from meshyard.checkpoint.manifest import MANIFEST, verify
from meshyard.checkpoint.storage import CheckpointStore
from meshyard.errors import BadInput
from meshyard.run_dir import RunDir

LATEST_RUN = "latest"
KINDS = ("give a checkpoint (a folder with manifest.json), a folder of step-NNNNNNNN checkpoints, "
         "a run directory, or 'latest'")


class LocationError(BadInput, ValueError):
    """A location holds no usable checkpoint; the message names it and says what to give instead."""


class Runs(NamedTuple):
    """Where ``latest`` looks: the parent folder of run directories and the run name
    (a config's ``run.dir`` and ``run.name``)."""

    dir: str
    name: str


@dataclass(frozen=True)
class CheckpointRef:
    """One checkpoint: the folder ``root`` (path or URL) that holds it, its name there and
    its manifest (empty when unreadable). ``options`` are the storage options it is read with."""

    root: str
    name: str  # step-NNNNNNNN
    manifest: dict[str, Any]
    options: dict[str, Any] = field(default_factory=dict, repr=False, compare=False)

    @property
    def location(self) -> str:
        return join(self.root, self.name)

    def store(self) -> CheckpointStore:
        """The store of ``root``: the checkpoint's files are under ``store().path(name)``."""
        return CheckpointStore(self.root, self.options)


@dataclass(frozen=True)
class Candidates:
    """The checkpoints a location names: ``names`` (oldest first) in the folder ``root``;
    ``exact`` when the location was one checkpoint."""

    root: str
    names: tuple[str, ...]
    exact: bool


def join(root: str, name: str) -> str:
    """``root/name`` for a path or a URL (``memory://`` + ``x`` is ``memory://x``)."""
    return posixpath.join(root, name)


def _split(location: str) -> tuple[str, str]:
    """(parent, name) of a checkpoint location; a bare name lies in the current folder."""
    parent, slash, name = location.rstrip("/").rpartition("/")
    return (parent or "/") if slash else ".", name


def _store(location: str, options: dict[str, Any]) -> CheckpointStore:
    try:
        return CheckpointStore(location, options)
    except (ValueError, ImportError) as exc:  # an unknown protocol, or its package missing
        raise LocationError(f"{location}: cannot open it ({exc})") from None


def _step_names(root: str, options: dict[str, Any]) -> tuple[str, ...]:
    store = _store(root, options)
    return tuple(sorted(n for n in store.list_dir(store.root) if step_of(n) is not None))


def run_checkpoints(run_dir: str, options: dict[str, Any]) -> str:
    """The checkpoint folder of the run in ``run_dir``: the one its ``run.json`` records
    (a ``checkpoint.dir`` of its own), else its ``checkpoints`` folder."""
    return _checkpoints_of(run_dir, _run_record(run_dir, options))


def _checkpoints_of(run_dir: str, record: dict[str, Any]) -> str:
    recorded = record.get(RunDir.CHECKPOINTS_FACT)
    return str(recorded) if recorded else join(run_dir, RunDir.CHECKPOINTS)


def _run_record(run_dir: str, options: dict[str, Any]) -> dict[str, Any]:
    """The run's ``run.json``; empty when it has none or it cannot be read."""
    try:
        store = CheckpointStore(run_dir, options)
        record = store.read_json(store.path(RunDir.RUN_FACTS))
    except (OSError, ValueError, ImportError):
        return {}
    return record if isinstance(record, dict) else {}


def latest_run_dir(runs: Runs, options: dict[str, Any] | None = None) -> Path:
    """The run directory ``<dir>/<name>`` or ``<dir>/<name>-*`` whose newest checkpoint
    (the one of the highest step in its checkpoint folder) was committed last.

    The time is the commit's, from that checkpoint's manifest: a folder's modification
    time moves with every log line and copy. Runs that share a ``checkpoint.dir`` share
    that newest checkpoint; of those, the run that saved it is taken. ``options`` are the
    storage options of checkpoint folders that are URLs."""
    options = options or {}
    base = Path(runs.dir).expanduser().resolve()
    ranked = [(_recency(path, options), path) for path in sorted(base.glob(f"{runs.name}*"))
              if path.is_dir() and (path.name == runs.name or path.name.startswith(f"{runs.name}-"))]
    ranked = [(recency, path) for recency, path in ranked if recency is not None]
    if not ranked:
        raise LocationError(f"{LATEST_RUN}: no run directory named '{runs.name}' or '{runs.name}-*' under {base} "
                            f"has checkpoints; check the folder and run name searched (run.dir, run.name), or give a "
                            "checkpoint's path instead")
    return max(ranked, key=lambda item: item[0])[1]


def _recency(run_dir: Path, options: dict[str, Any]) -> tuple[float, bool, float] | None:
    """How recent the run's checkpoints are, to compare runs by: the commit time of its
    newest checkpoint, whether the run saved that one itself, then the folder's
    modification time (for checkpoints without a readable manifest). None without any."""
    record = _run_record(str(run_dir), options)
    root = _checkpoints_of(str(run_dir), record)
    try:
        names = _step_names(root, options)
    except (LocationError, OSError):  # a recorded folder that cannot be opened or read here
        return None
    if not names:
        return None
    manifest = _newest_manifest(root, names, options)
    run_id = record.get("run_id") or _kept_run_id(run_dir)
    saved_it = bool(run_id) and manifest.get("run_id") == run_id
    created = manifest.get("created")
    return float(created) if isinstance(created, (int, float)) else 0.0, saved_it, run_dir.stat().st_mtime


def _newest_manifest(root: str, names: tuple[str, ...], options: dict[str, Any]) -> dict[str, Any]:
    """The manifest of the highest step among ``names`` that has a readable one ({} if none)."""
    store = _store(root, options)
    for name in reversed(names):
        try:
            manifest = store.read_json(store.path(name, MANIFEST))
        except (OSError, ValueError):
            continue
        if isinstance(manifest, dict):
            return manifest
    return {}


def _kept_run_id(run_dir: Path) -> str:
    """The run id kept in the run directory (``run_dir.run_id_of``), for runs whose
    run.json predates recording it."""
    try:
        return RunDir(run_dir).run_id_file.read_text().strip()
    except OSError:
        return ""


def find_checkpoints(location: str, options: dict[str, Any], runs: Runs | None = None) -> Candidates:
    """What ``location`` names, by the order of the module docstring; raises
    ``LocationError`` when it does not exist or holds no checkpoint."""
    if location == LATEST_RUN:
        if runs is None:
            raise LocationError(f"{LATEST_RUN}: which runs to look in is not known here; give a path instead")
        root = run_checkpoints(str(latest_run_dir(runs, options)), options)
        return Candidates(root, _step_names(root, options), exact=False)
    store = _store(location, options)
    if not store.exists(store.root):
        raise LocationError(f"{location} does not exist; {KINDS}")
    if store.exists(store.path(MANIFEST)) or step_of(_split(location)[1]) is not None:
        parent, name = _split(location)
        return Candidates(parent, (name,), exact=True)
    for root in dict.fromkeys((location, run_checkpoints(location, options), join(location, RunDir.CHECKPOINTS))):
        names = _step_names(root, options)
        if names:
            return Candidates(root, names, exact=False)
    raise LocationError(f"{location} holds no checkpoint: it has no {MANIFEST}, and neither it nor its "
                        f"'{RunDir.CHECKPOINTS}' folder (nor a checkpoint folder its {RunDir.RUN_FACTS} records) holds "
                        f"step-NNNNNNNN checkpoints; {KINDS}")


def newest_valid(root: str, options: dict[str, Any], report: Callable[[str], None],
                 rejected: Mapping[str, str] | None = None) -> CheckpointRef | None:
    """The newest checkpoint in the folder ``root`` whose manifest and file sizes check
    out, skipping the ``rejected`` locations; None when there is none."""
    found = find_latest_valid(_store(root, options), False, report, _rejected_names(root, rejected or {}))
    return CheckpointRef(root, found[0], found[1], options) if found else None


def _rejected_names(root: str, rejected: Mapping[str, str]) -> set[str]:
    """Checkpoint names directly under ``root`` among the ``rejected`` locations."""
    return {name for name in (_split(location)[1] for location in rejected) if join(root, name) in rejected}


def locate(location: str, options: dict[str, Any], *, runs: Runs | None = None,
           report: Callable[[str], None] = print, rejected: Mapping[str, str] | None = None,
           require_valid: bool = True) -> CheckpointRef:
    """The checkpoint ``location`` names (see the module docstring for the order).

    ``runs``: where ``latest`` looks. ``report`` hears why newer checkpoints of a folder
    were skipped. ``rejected`` maps locations found damaged by a check made elsewhere (the
    SHA-256 checks at resume) to the reason; they count as not valid. With
    ``require_valid=False`` a checkpoint named exactly is returned even when it is not
    valid (for tools that show what is wrong with it)."""
    found = find_checkpoints(location, options, runs)
    if not found.exact:
        ref = newest_valid(found.root, options, report, rejected)
        if ref is None:
            raise LocationError(f"{location}: none of the {len(found.names)} checkpoints in {found.root} is valid "
                                "(the reasons are above); give a checkpoint kept elsewhere")
        return ref
    name = found.names[0]
    store = _store(found.root, options)
    manifest, problem = verify(store, store.path(name), checksums=False)
    problem = problem or (rejected or {}).get(join(found.root, name))
    if problem and require_valid:
        raise LocationError(f"{location} is a checkpoint but not a valid one: {problem}; give an older "
                            "checkpoint, or the folder holding it to take its newest valid one")
    return CheckpointRef(found.root, name, manifest or {}, options)
