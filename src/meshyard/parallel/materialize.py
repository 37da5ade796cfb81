"""Meta-device initialisation: build the model without memory, parallelize it, then
allocate and fill only this rank's part.

Under ``parallel.strategy = 'fsdp'`` (every parameter sharded) and under pipelining
(each rank keeps its stages) no rank needs the whole model, so ``build_model_deferred``
builds it on the meta device (``meshyard.models.deferred_init``), ``parallelize`` shards
and splits it as it would a real one, and ``materialize`` gives every remaining tensor
storage on the device and this rank's part of exactly the value a one-process build
with the same seed gives it. Peak memory while doing so: this rank's part plus one full
tensor at a time. DDP keeps a full replica (and broadcasts it at wrap time), so other
layouts build on the device, as does a model whose builder cannot be replayed (the
reason is logged).
"""

from __future__ import annotations

from typing import Callable

import torch
from torch import nn
from torch.distributed.tensor import DTensor, distribute_tensor

from meshyard.models.deferred_init import DeferredInitError, InitRecord, record_build
from meshyard.parallel.data_parallel import unwrap
from meshyard.parallel.pipeline import PipelinedModel


def build_model_deferred(build: Callable[[], nn.Module], device: torch.device, deferred: bool,
                         log: Callable[[str], None],
                         warn: Callable[[str], None]) -> tuple[nn.Module, InitRecord | None]:
    """``build()`` on the meta device with the record to ``materialize`` it, when
    ``deferred`` and the builder allows it; else on ``device`` (and no record).

    ``log`` hears which way the model was built; ``warn`` why a deferred build was not possible.
    """
    if deferred:
        try:
            model, record = record_build(build, device)
        except DeferredInitError as reason:
            warn(f"model built in full on every rank ({device}), not on the meta device: {reason}")
        else:
            log(f"model built on the meta device; each rank materialises its own part on {device}")
            return model, record
    with device:
        model = build()
    if not deferred:
        log(f"model built in full on {device}")
    return model, None


def materialize(model: nn.Module, record: InitRecord, offloaded: bool = False) -> None:
    """Give the parameters and buffers of a parallelized meta ``model`` storage on the
    device and fill this rank's part (shard, stages) of their initial values.
    ``offloaded`` (FSDP's CPU offload): parameters in host memory, where FSDP keeps the
    shards it copies to the device, and buffers on the device.

    Call after ``parallelize`` and before the optimizer exists (it may replace tensors).
    """
    holder = unwrap(model)
    tied = _tied_names(holder)
    roots = [unwrap(stage) for _, stage in holder.stages] if isinstance(holder, PipelinedModel) else [holder]
    for root in roots:
        # On the FSDP root too, so that FSDP re-reads its shards' new storage.
        root.to_empty(device=torch.device("cpu") if offloaded else record.device)
    if isinstance(holder, PipelinedModel):
        holder.gather()  # tensors a stage root holds itself were replaced
    _retie(holder, tied)
    filled: set[int] = set()
    with torch.no_grad():
        for name, tensor in [*holder.named_parameters(remove_duplicate=False),
                             *holder.named_buffers(remove_duplicate=False)]:
            if id(tensor) not in filled:
                filled.add(id(tensor))
                _fill(tensor, record.compute(name))
    if offloaded:
        _move_buffers(holder, record.device)
    record.restore_generator()


def _move_buffers(model: nn.Module, device: torch.device) -> None:
    """Every buffer of ``model`` onto ``device`` (assigning a tensor to a buffer's name
    replaces the buffer, persistent or not)."""
    for module in model.modules():
        for name, buffer in list(module.named_buffers(recurse=False)):
            setattr(module, name, buffer.to(device))


def _fill(tensor: torch.Tensor, full: torch.Tensor) -> None:
    """Copy this rank's part of ``full`` into ``tensor`` (a DTensor shard or a whole tensor)."""
    if isinstance(tensor, DTensor):
        # Every rank holds the same ``full``: cut locally (no source rank, no communication).
        part = distribute_tensor(full, tensor.device_mesh, tensor.placements, src_data_rank=None)
        tensor.to_local().copy_(part.to_local())
    else:
        tensor.copy_(full)


def _tied_names(module: nn.Module) -> list[list[str]]:
    """Groups of parameter names that share one tensor (a tied embedding and head)."""
    groups: dict[int, list[str]] = {}
    for name, param in module.named_parameters(remove_duplicate=False):
        groups.setdefault(id(param), []).append(name)
    return [names for names in groups.values() if len(names) > 1]


def _retie(module: nn.Module, groups: list[list[str]]) -> None:
    """Share the first name's parameter under every name of its group again, should a
    conversion have replaced parameter objects one by one (``to_empty`` keeps them today)."""
    for first, *others in groups:
        shared = module.get_parameter(first)
        for name in others:
            owner_name, _, leaf = name.rpartition(".")
            owner = module.get_submodule(owner_name)
            if getattr(owner, leaf) is not shared:
                setattr(owner, leaf, shared)
