"""A model's tensors as one safetensors file: the one writer behind ``meshyard ckpt export``
and ``meshyard export --format safetensors``, and the reader of that layout.

Whoever writes, the metadata (strings, as safetensors requires) has the same keys:

- ``format``: ``"pt"``, what PyTorch-side readers of safetensors files expect;
- ``meshyard.tied``: JSON ``{alias: name}``. A tensor shared by two names (tied embeddings)
  is stored once, under its first name (safetensors refuses tensors that share memory);
- ``meshyard.int8_linears``: JSON list of the linear layers stored as int8 entries
  (``meshyard.inference.int8``); empty for a float model;
- ``step``: the training step the tensors come from, when the writer knows it (provenance).

A reader that ignores the metadata (``safetensors.torch.load_file``) gets every tensor
under its own name, aliases excepted.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Mapping, Sequence

import torch

from meshyard.extras import require

FORMAT, TIED, INT8_LINEARS, STEP = "format", "meshyard.tied", "meshyard.int8_linears", "step"


def write_model_file(tensors: Mapping[str, torch.Tensor], path: Path | str, *, int8_linears: Sequence[str] = (),
                     step: int | None = None, feature: str = "writing a .safetensors file") -> None:
    """``tensors`` into ``path``, each storage once (see the module docstring); ``feature``
    names what needs the safetensors package when it is missing."""
    save_file = require("safetensors.torch", feature).save_file
    stored, tied = _stored_once(tensors)
    metadata = {FORMAT: "pt", TIED: json.dumps(tied), INT8_LINEARS: json.dumps(sorted(int8_linears))}
    if step is not None:
        metadata[STEP] = str(step)
    save_file(stored, str(path), metadata=metadata)


def _stored_once(tensors: Mapping[str, torch.Tensor]) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    """The tensors to store (a view shared by several names under its first name only) and
    ``{alias: stored name}`` for the others."""
    stored: dict[str, torch.Tensor] = {}
    tied: dict[str, str] = {}
    first_name: dict[tuple[int, int, tuple[int, ...]], str] = {}
    for name, tensor in tensors.items():
        key = (tensor.untyped_storage().data_ptr(), tensor.storage_offset(), tuple(tensor.shape))
        if key in first_name:
            tied[name] = first_name[key]
        else:
            first_name[key] = name
            stored[name] = tensor.detach().contiguous()
    return stored, tied


def read_model_file(path: Path | str, feature: str = "reading a .safetensors file") -> tuple[dict[str, torch.Tensor],
                                                                                              list[str]]:
    """Every tensor of a file ``write_model_file`` wrote, aliases included (a file without
    meshyard's metadata has none), and the names of its int8 linear layers."""
    safe_open = require("safetensors", feature).safe_open
    with safe_open(str(path), framework="pt") as f:
        metadata = f.metadata() or {}
        tensors = {key: f.get_tensor(key) for key in f.keys()}
    tied = json.loads(metadata.get(TIED, "{}"))
    tensors.update({alias: tensors[name] for alias, name in tied.items() if name in tensors})
    return tensors, json.loads(metadata.get(INT8_LINEARS, "[]"))
