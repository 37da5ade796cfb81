"""What ``model.init_from`` names, read without loading any weight: the kind of source,
the tensors it holds (names, shapes, dtypes) and where each one lies.

Three kinds, tried in this order:

- ``hf``: a Hugging Face model folder: ``config.json`` and ``model.safetensors``, or
  several ``*.safetensors`` listed by ``model.safetensors.index.json`` (as
  ``save_pretrained`` and ``meshyard ckpt export --format hf`` write them);
- ``file``: one ``.safetensors`` file (``meshyard ckpt export``, ``meshyard export``;
  ``checkpoint.model_file`` describes its metadata);
- ``checkpoint``: a meshyard checkpoint, checkpoint folder or run directory, found as
  ``--resume`` finds one (``checkpoint.locate``): its newest valid checkpoint.

Anything else is one ``InitSourceError`` paragraph naming the path and the kinds.
"""

from __future__ import annotations

import json
import tomllib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import torch
from torch.distributed.checkpoint.metadata import TensorStorageMetadata

from meshyard.checkpoint.locate import CheckpointRef, LocationError, locate
from meshyard.checkpoint.model_file import INT8_LINEARS, TIED
from meshyard.checkpoint.tools import model_tensor_metadata
from meshyard.extras import require
from meshyard.models.hf_auto import CONFIG_FILE, HF_MODEL, HFModelError, hf_config, hf_ties_embeddings, hf_vocab_size
from meshyard.run_dir import RunDir

WEIGHTS, INDEX = "model.safetensors", "model.safetensors.index.json"
KINDS = ("a Hugging Face model folder (config.json with model.safetensors, or *.safetensors listed in "
         f"{INDEX}), a meshyard run directory or checkpoint, or a .safetensors file written by "
         "'meshyard ckpt export' or 'meshyard export'")


class InitSourceError(ValueError):
    """``model.init_from`` names nothing meshyard can start from; the message says why."""


@dataclass(frozen=True)
class TensorInfo:
    """One stored tensor: its shape, its dtype's name (safetensors' ``F32``, ``BF16``,
    ``I8``, ...; DCP's ``torch.float32`` spelled the same way) and the file holding it."""

    shape: tuple[int, ...]
    dtype: str
    file: str = ""

    @property
    def floating(self) -> bool:
        return self.dtype.startswith(("F", "BF"))


@dataclass(frozen=True)
class InitSource:
    """A place to start from: ``kind`` (``hf``, ``file``, ``checkpoint``), where it is,
    its tensors by stored name, its vocabulary and whether it ties its embedding and head
    (None: it does not say), and for a checkpoint the reference ``locate`` found."""

    kind: Literal["hf", "file", "checkpoint"]
    path: str
    tensors: dict[str, TensorInfo]
    vocab_size: int | None = None
    tied: bool | None = None
    ref: CheckpointRef | None = field(default=None, compare=False)

    def describe(self) -> str:
        what = {"hf": "Hugging Face folder", "file": "safetensors file", "checkpoint": "checkpoint"}[self.kind]
        where = self.ref.location if self.ref is not None else self.path
        return f"{what} {where}"


def find_source(path: str) -> InitSource:
    """The source ``path`` names (see the module docstring), or ``InitSourceError``."""
    here = Path(path).expanduser()
    if "://" not in path and not here.exists():
        raise InitSourceError(f"model.init_from = '{path}' does not exist; give {KINDS}")
    if here.is_dir() and (here / CONFIG_FILE).is_file():
        return _hf_folder(here)
    if here.is_file() and here.suffix == ".safetensors":
        return _model_file(here)
    try:
        ref = locate(path, {}, report=lambda _: None)
    except LocationError as exc:
        raise InitSourceError(f"model.init_from = '{path}' is none of {KINDS} ({exc})") from None
    return _checkpoint(ref, path)


def _safetensors_header(file: Path) -> tuple[dict[str, TensorInfo], dict[str, str]]:
    """The tensors a safetensors file holds (from its header alone) and its metadata."""
    safe_open = require("safetensors", "model.init_from").safe_open
    try:
        with safe_open(str(file), framework="pt") as f:
            infos = {}
            for name in f.keys():
                part = f.get_slice(name)
                infos[name] = TensorInfo(tuple(part.get_shape()), str(part.get_dtype()), str(file))
            return infos, dict(f.metadata() or {})
    except Exception as exc:  # safetensors raises its own error types for a damaged header
        raise InitSourceError(f"{file} is not a readable safetensors file ({str(exc).splitlines()[0]})") from None


def _hf_folder(folder: Path) -> InitSource:
    try:
        config = hf_config(folder)
    except HFModelError as exc:
        raise InitSourceError(f"model.init_from: {exc}") from None
    if (folder / INDEX).is_file():
        try:
            weight_map = json.loads((folder / INDEX).read_text())["weight_map"]
        except (ValueError, KeyError, TypeError):
            raise InitSourceError(f"{folder / INDEX} has no readable weight_map") from None
        files = sorted(set(weight_map.values()))
    elif (folder / WEIGHTS).is_file():
        files = [WEIGHTS]
    else:
        raise InitSourceError(
            f"model.init_from = '{folder}' has a {CONFIG_FILE} but neither {WEIGHTS} nor {INDEX}; meshyard reads "
            "safetensors weights only (save the model with save_pretrained(..., safe_serialization=True))")
    tensors: dict[str, TensorInfo] = {}
    for name in files:
        if not (folder / name).is_file():
            raise InitSourceError(f"{folder / INDEX} lists {name}, which is not in the folder")
        tensors.update(_safetensors_header(folder / name)[0])
    return InitSource("hf", str(folder), tensors, hf_vocab_size(config), hf_ties_embeddings(config))


def _model_file(file: Path) -> InitSource:
    tensors, metadata = _safetensors_header(file)
    if json.loads(metadata.get(INT8_LINEARS, "[]") or "[]"):
        raise InitSourceError(f"model.init_from = '{file}' holds int8 linear layers (meshyard export --quantize "
                              "int8), which training cannot start from; export the model in float instead")
    tied = json.loads(metadata.get(TIED, "{}") or "{}")
    # An alias is read from the tensor stored for it.
    tensors.update({alias: tensors[name] for alias, name in tied.items() if name in tensors})
    return InitSource("file", str(file), tensors, tied=True if tied else None)


def _checkpoint(ref: CheckpointRef, path: str) -> InitSource:
    tensors = {name: TensorInfo(tuple(value.size), _dtype_name(value))
               for name, value in model_tensor_metadata(ref).items()}
    return InitSource("checkpoint", path, tensors, tied=_recorded_tie(ref.manifest), ref=ref)


def _dtype_name(meta: TensorStorageMetadata) -> str:
    """A DCP tensor's dtype in safetensors' spelling (F32, BF16, I64, ...)."""
    dtype = meta.properties.dtype
    if dtype == torch.bfloat16:
        return "BF16"
    kind = "F" if dtype.is_floating_point else "BOOL" if dtype == torch.bool else "U" if dtype == torch.uint8 else "I"
    return kind if kind == "BOOL" else f"{kind}{dtype.itemsize * 8}"


def _recorded_tie(manifest: dict[str, Any]) -> bool | None:
    """Whether the run that saved the checkpoint tied its GPT's embedding and head, from
    the config its manifest recorded (None when it does not say: another model)."""
    try:
        model = tomllib.loads(manifest.get("config") or "").get("model", {})
    except (tomllib.TOMLDecodeError, TypeError):
        return None
    name = str(model.get("name", "gpt-mini"))
    return bool(model.get("tie_embeddings", True)) if name.startswith("gpt") else None


def kind_problem(model_name: str, source: InitSource) -> str | None:
    """``model.name = 'hf'`` is built from a Hugging Face folder's config.json: only such a folder will do."""
    if model_name != HF_MODEL or source.kind == "hf":
        return None
    return (f"model.name = 'hf' builds the model from the config.json of a Hugging Face folder, but model.init_from "
            f"names a {source.describe()}; set model.name to the model that was trained there (its run's "
            f"{RunDir.CONFIG} records it), or point model.init_from at a Hugging Face folder")
