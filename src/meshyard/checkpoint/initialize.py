"""``model.init_from``: fill a parallelized, materialized model with weights from elsewhere.

A new run then trains from step 0 with a fresh optimizer (the optimizer's state is
created at its first step, so it never sees the random weights). Every rank reads only
what it holds, never the whole model:

- from safetensors (a Hugging Face folder, an exported file), tensor by tensor: each
  file is opened for one tensor at a time and ``get_slice`` reads just this rank's part
  of a DTensor parameter (FSDP's ``Shard(0)``, tensor parallelism's ``Shard(0)`` or
  ``Shard(1)``: the box ``compute_local_shape_and_global_offset`` gives), transposed
  where the name map says so (GPT-2's ``Conv1D`` matrices); a pipeline stage holds, and
  so reads, only its own modules' tensors. Placements other than plain shards and
  replicas (FSDP over a tensor-parallel dimension) read that one tensor whole;
- from a meshyard checkpoint, through DCP into the parameters in place: only the model's
  entries, resharded from whatever layout saved them, as resume reshards.

Before any weight is read, the ranks compare what they hold with what the source stores
(names, shapes, dtypes, tied weights) and all raise the same ``ConfigError`` when they
differ: one paragraph per kind of problem, every name listed (the first few, with a count).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Callable, Iterator

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor
from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

from meshyard.checkpoint.init_source import InitSource, TensorInfo
from meshyard.checkpoint.state import SafeLoadPlanner
from meshyard.config.load import ConfigError
from meshyard.extras import require
from meshyard.models.hf_gpt2 import NotGPT2, gpt2_name
from meshyard.models.local_part import local_part
from meshyard.parallel.data_parallel import unwrap

SHOWN_NAMES = 6
# Buffers older GPT-2 folders store and transformers itself ignores on load.
IGNORED_SUFFIXES = (".attn.bias", ".attn.masked_bias", "rotary_emb.inv_freq")
GPT2_HINT = ("meshyard's GPT reads a GPT2LMHeadModel folder when its shape is the folder's: set model.n_layer, "
             "model.n_head, model.d_model and model.context_length to its config.json's n_layer, n_head, n_embd "
             "and n_positions")


@dataclass(frozen=True)
class NameMap:
    """Where a model tensor lies in the source: its stored name and whether it is stored
    transposed. ``gpt2``: meshyard's GPT read from a GPT-2 folder (``models.hf_gpt2``);
    otherwise names are the same on both sides. ``ties``: the full model's groups of
    names sharing one weight, so that a tensor stored once is read for each of them."""

    gpt2: bool = False
    ties: list[set[str]] = field(default_factory=list)

    def own(self, name: str) -> tuple[str, bool]:
        if not self.gpt2:
            return name, False
        try:
            found = gpt2_name(name, tied=False)
        except NotGPT2:
            return name, False
        assert found is not None  # only tied heads map to None, and tied=False
        return found

    def stored(self, name: str, tensors: dict[str, TensorInfo]) -> tuple[str, bool] | None:
        """The stored name (and transposition) of ``name``, through a tied partner when the
        source stores the shared weight under the partner's name; None when absent."""
        own = self.own(name)
        if own[0] in tensors:
            return own
        for group in self.ties:
            if name in group:
                for partner in sorted(group - {name}):
                    found = self.own(partner)
                    if found[0] in tensors:
                        return found
        return None


@dataclass(frozen=True)
class _Item:
    """One tensor this rank holds and where it is read from."""

    name: str
    tensor: torch.Tensor
    stored: str
    transposed: bool


def load_initial_weights(model: nn.Module, source: InitSource, names: NameMap,
                         note: Callable[[str], None] = print) -> int:
    """Fill ``model`` (this rank's shards and stages, parallelized and materialized) from
    ``source``; returns the bytes this rank read. Every rank calls it (it gathers)."""
    start = time.perf_counter()
    items, problems, found = _plan(model, source, names)
    _agree(found, problems, source, names)
    with torch.no_grad():
        if source.kind == "checkpoint":
            read = _load_checkpoint(items, source)
        else:
            read = sum(_load_safetensors(item, source.tensors[item.stored]) for item in items)
    note(f"started from {source.describe()}: {len(items)} tensors, {read / 2**20:.1f} MiB read by this rank in "
         f"{time.perf_counter() - start:.1f}s")
    return read


def _model_tensors(model: nn.Module) -> Iterator[tuple[str, torch.Tensor]]:
    """This rank's parameters (each once) and persistent buffers, under the full model's names."""
    holder = unwrap(model)
    yield from holder.named_parameters()
    for module_name, module in holder.named_modules():
        for name, buffer in module._buffers.items():
            if buffer is not None and name not in module._non_persistent_buffers_set:
                yield (f"{module_name}.{name}" if module_name else name), buffer


def _plan(model: nn.Module, source: InitSource,
          names: NameMap) -> tuple[list[_Item], dict[str, list[str]], set[str]]:
    """What this rank reads, its problems by kind (missing, shape, dtype), and the stored
    names its tensors correspond to (read or not)."""
    items: list[_Item] = []
    seen: set[str] = set()
    problems: dict[str, list[str]] = {"missing": [], "shape": [], "dtype": []}
    for name, tensor in _model_tensors(model):
        found = names.stored(name, source.tensors)
        if found is None:
            problems["missing"].append(name)
            continue
        stored, transposed = found
        seen.add(stored)
        info = source.tensors[stored]
        shape = tuple(tensor.shape)
        expected = tuple(reversed(shape)) if transposed else shape
        label = name if stored == name else f"{name} (stored as {stored}{', transposed' if transposed else ''})"
        if info.shape != expected:
            problems["shape"].append(f"{label}: {list(info.shape)} stored, {list(expected)} in the model")
        elif info.floating != tensor.dtype.is_floating_point:
            problems["dtype"].append(f"{label}: {info.dtype} stored, {str(tensor.dtype).removeprefix('torch.')} "
                                     "in the model")
        else:
            items.append(_Item(name, tensor, stored, transposed))
    return items, problems, seen


def _agree(found: set[str], problems: dict[str, list[str]], source: InitSource, names: NameMap) -> None:
    """Every rank's problems, and the stored tensors no rank's model has, as one
    ``ConfigError`` raised on all ranks alike (a rank alone would leave the others waiting)."""
    mine = (found, problems)
    everyone = [mine]
    if dist.is_initialized() and dist.get_world_size() > 1:
        everyone = [None] * dist.get_world_size()
        dist.all_gather_object(everyone, mine)
    used = set().union(*(read for read, _ in everyone))
    for group in names.ties:  # a shared weight stored under each of its names (an exported checkpoint)
        stored = {names.own(name)[0] for name in group}
        if stored & used:
            used |= stored
    merged = {kind: sorted({entry for _, found in everyone for entry in found[kind]}) for kind in problems}
    tied_model = any(names.ties)
    if source.tied is not None and source.tied != tied_model:
        raise ConfigError([_tie_paragraph(source, tied_model, names)], "model.init_from")
    unexpected = sorted(name for name in source.tensors if name not in used and not name.endswith(IGNORED_SUFFIXES))
    paragraphs = _paragraphs(merged, unexpected, source, names)
    if paragraphs:
        raise ConfigError(paragraphs, "model.init_from")


def _listed(names: list[str]) -> str:
    shown = ", ".join(names[:SHOWN_NAMES])
    return shown + (f" (and {len(names) - SHOWN_NAMES} more)" if len(names) > SHOWN_NAMES else "")


def _paragraphs(problems: dict[str, list[str]], unexpected: list[str], source: InitSource,
                names: NameMap) -> list[str]:
    where = source.describe()
    hint = f"; {GPT2_HINT}" if names.gpt2 else ""
    found = []
    if problems["missing"]:
        found.append(f"{len(problems['missing'])} tensor(s) of the model are not in {where}: "
                     f"{_listed(problems['missing'])}; it holds another model (check model.name and its size "
                     f"fields against it){hint}")
    if unexpected:
        found.append(f"{len(unexpected)} tensor(s) of {where} are not in the model: {_listed(unexpected)}; "
                     f"it holds another model, or a bigger one (check model.name and its size fields){hint}")
    if problems["shape"]:
        found.append(f"{len(problems['shape'])} tensor(s) of {where} have another shape than the model's: "
                     f"{_listed(problems['shape'])}{hint}")
    if problems["dtype"]:
        found.append(f"{len(problems['dtype'])} tensor(s) of {where} are not of the model's kind of dtype "
                     f"(a float parameter needs float weights): {_listed(problems['dtype'])}; start from a "
                     "float (not quantized) copy of the model")
    return found


def _tie_paragraph(source: InitSource, tied_model: bool, names: NameMap) -> str:
    if tied_model:
        return (f"{source.describe()} keeps its output head apart from its token embedding, but the model ties "
                "them (one weight); set model.tie_embeddings = false to start from it")
    return (f"{source.describe()} ties its output head to its token embedding (one weight, stored once), but the "
            "model keeps them apart; set model.tie_embeddings = true to start from it"
            + ("" if names.gpt2 or source.kind != "hf" else " (or use model.name = 'hf')"))


def _local_box(tensor: torch.Tensor) -> tuple[torch.Tensor, tuple[int, ...], tuple[int, ...]] | None:
    """This rank's part of ``tensor``: its local tensor and the box it covers in the whole
    (shape, offset); None for placements whose part is not one box (strided shards)."""
    if not isinstance(tensor, DTensor):
        return tensor, tuple(tensor.shape), (0,) * tensor.dim()
    if not all(type(p) in (Shard, Replicate) for p in tensor.placements):
        return None
    shape, offset = compute_local_shape_and_global_offset(tensor.shape, tensor.device_mesh, tensor.placements)
    return tensor.to_local(), tuple(shape), tuple(offset)


def _read_box(file: str, name: str, shape: tuple[int, ...], offset: tuple[int, ...]) -> torch.Tensor:
    """The box (``shape`` at ``offset``) of the stored tensor ``name``. The file is opened
    for this tensor alone: its mapped pages are let go of before the next one is read."""
    safe_open = require("safetensors", "model.init_from").safe_open
    with safe_open(file, framework="pt") as f:
        if not shape:
            return f.get_tensor(name)
        return f.get_slice(name)[tuple(slice(start, start + size) for start, size in zip(offset, shape))]


def _load_safetensors(item: _Item, info: TensorInfo) -> int:
    """Read ``item``'s part into its tensor; returns the bytes read."""
    box = _local_box(item.tensor)
    if box is None:  # not one box: read whole, keep this rank's part (no communication)
        whole = _read_box(info.file, item.stored, info.shape, (0,) * len(info.shape))
        whole = whole.t() if item.transposed else whole
        tensor = item.tensor
        assert isinstance(tensor, DTensor)
        part = distribute_tensor(whole.to(tensor.dtype), tensor.device_mesh, tensor.placements,
                                 src_data_rank=None).to_local()
        tensor.to_local().copy_(part)
        return whole.numel() * whole.element_size()
    local, shape, offset = box
    if local.numel() == 0:
        return 0
    if item.transposed:
        read = _read_box(info.file, item.stored, shape[::-1], offset[::-1]).t()
    else:
        read = _read_box(info.file, item.stored, shape, offset)
    local.copy_(read)
    return read.numel() * read.element_size()


def _load_checkpoint(items: list[_Item], source: InitSource) -> int:
    """The model's entries of a DCP checkpoint, read into the parameters in place (each
    rank its shards, resharded from the layout that saved them)."""
    assert source.ref is not None
    store = source.ref.store()
    first: dict[str, torch.Tensor] = {}
    copies: list[tuple[torch.Tensor, str]] = []
    for item in items:
        if item.stored in first:  # a weight this rank holds twice (two stages): read once
            copies.append((item.tensor, item.stored))
        else:
            first[item.stored] = item.tensor.detach()
    dcp.load({"model": first}, storage_reader=store.dcp_reader(store.path(source.ref.name)),
             planner=SafeLoadPlanner())
    for tensor, stored in copies:
        tensor.copy_(first[stored])
    return sum(_local_bytes(tensor) for tensor in first.values())


def _local_bytes(tensor: torch.Tensor) -> int:
    local = local_part(tensor)
    return local.numel() * local.element_size()
