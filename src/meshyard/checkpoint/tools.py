"""Offline checkpoint tools: list, inspect, verify, export (no process group needed)."""

from __future__ import annotations

from pathlib import Path
from typing import Any, Callable

import torch
from torch.distributed.checkpoint.format_utils import _EmptyStateDictLoadPlanner
from torch.distributed.checkpoint.metadata import TensorStorageMetadata
from torch.distributed.checkpoint.state_dict_loader import _load_state_dict

from meshyard.checkpoint.locate import CheckpointRef, Runs, find_checkpoints, locate
from meshyard.checkpoint.manager import LATEST, step_of
from meshyard.checkpoint.manifest import verify
from meshyard.checkpoint.model_file import write_model_file
from meshyard.checkpoint.state import SafeBytesMixin
from meshyard.checkpoint.storage import CheckpointStore
from meshyard.errors import BadInput
from meshyard.extras import require


class _SafeFullStatePlanner(SafeBytesMixin, _EmptyStateDictLoadPlanner):
    """Loads every entry of a checkpoint, non-tensor entries without unpickling code."""


class CheckpointToolError(BadInput, ValueError):
    """A ``meshyard ckpt`` command cannot do what was asked (bad option, invalid checkpoint)."""


def resolve(location: str, options: dict[str, Any], runs: Runs | None = None,
            report: Callable[[str], None] = print) -> CheckpointRef:
    """The checkpoint ``location`` names (``locate``): one checkpoint as named, even if it
    is not valid (``inspect`` shows why), or the newest valid one of a run or folder."""
    return locate(location, options, runs=runs, report=report, require_valid=False)


def list_checkpoints(location: str, options: dict[str, Any], checksums: bool = False,
                     runs: Runs | None = None) -> list[dict[str, Any]]:
    """One row per checkpoint (all of a run or folder, or just the one named), oldest first."""
    found = find_checkpoints(location, options, runs)
    store = CheckpointStore(found.root, options)
    latest = store.read_text(store.path(LATEST)).strip() if store.exists(store.path(LATEST)) else None
    rows = []
    for name in found.names:
        manifest, problem = verify(store, store.path(name), checksums)
        size = sum(f["size"] for f in manifest["files"].values()) if manifest else None
        rows.append({"name": name, "step": step_of(name), "valid": problem is None, "problem": problem,
                     "bytes": size, "world_size": (manifest or {}).get("world_size"),
                     "strategy": (manifest or {}).get("strategy"), "eval_loss": (manifest or {}).get("eval_loss"),
                     "latest": name == latest, "location": store.url_of(name)})
    return rows


def read_full_state(ref: CheckpointRef, entries: set[str] | None = None) -> dict[str, Any]:
    """The entries of a DCP checkpoint (all, or the top-level ones named in ``entries``) as
    full (unsharded) tensors in this process."""
    state: dict[str, Any] = {}
    store = ref.store()
    _load_state_dict(state, storage_reader=store.dcp_reader(store.path(ref.name)),
                     planner=_SafeFullStatePlanner(keys=entries), no_dist=True)
    return state


def model_tensor_metadata(ref: CheckpointRef) -> dict[str, TensorStorageMetadata]:
    """The model's tensors in the checkpoint's DCP metadata under their plain module names:
    sizes and dtypes, no data."""
    store = ref.store()
    metadata = store.dcp_reader(store.path(ref.name)).read_metadata()
    return {key.removeprefix("model."): value for key, value in metadata.state_dict_metadata.items()
            if key.startswith("model.") and isinstance(value, TensorStorageMetadata)}


def model_state(ref: CheckpointRef) -> dict[str, torch.Tensor]:
    """The model's parameters and buffers under their plain module names; the optimizer's
    state (twice the model's size under AdamW) is never read."""
    return dict(read_full_state(ref, {"model"})["model"])


def export(ref: CheckpointRef, out: Path, report: Callable[[str], None] = print) -> Path:
    """Write the model as one file: ``.safetensors`` or a ``torch.save`` state dict (other
    suffixes; tensors only, so ``torch.load(path, weights_only=True)`` reads it)."""
    if out.suffix == ".safetensors":  # before reading anything: the package is an optional extra
        require("safetensors.torch", "exporting to .safetensors")
    store = ref.store()
    manifest, problem = verify(store, store.path(ref.name))
    if problem:
        raise CheckpointToolError(f"{store.url_of(ref.name)} is not valid: {problem}")
    tensors = {k: v.contiguous() for k, v in model_state(ref).items()}
    out.parent.mkdir(parents=True, exist_ok=True)
    if out.suffix == ".safetensors":
        # Tied weights come back from the checkpoint as separate tensors with equal values,
        # so each is stored under its own name; the step is kept for provenance.
        write_model_file(tensors, out, step=manifest["step"])
    else:
        torch.save(tensors, out)
    report(f"exported {len(tensors)} tensors of step {manifest['step']} to {out}")
    return out
