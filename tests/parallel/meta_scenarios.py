"""Rank functions of tests/parallel/test_meta_init.py (importable by spawned ranks).

Each builds a GPT the way the worker does for a layout (``build_model_deferred``, then
``parallelize``, then ``materialize``) and reports what this rank ended up holding.
"""

from __future__ import annotations

import ctypes
import gc
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor

from meshyard.config.sections import ParallelConfig
from meshyard.models.gpt import GPT, GPTShape
from meshyard.parallel.data_parallel import unwrap
from meshyard.parallel.materialize import build_model_deferred, materialize
from meshyard.parallel.layout import Layout as ParallelLayout
from meshyard.parallel.parallelize import parallelize
from meshyard.runtime.parallel_dims import ParallelDims

SEED = 7
SHAPE = GPTShape(vocab_size=64, context_length=16, n_layer=4, n_head=4, d_model=32)
# Eight blocks of 384 wide (about 55 MiB): large next to the process's own fluctuations,
# and no single tensor above 2.4 MiB, so "half the model" and "all of it" differ clearly.
LARGE = GPTShape(vocab_size=256, context_length=16, n_layer=8, n_head=4, d_model=384)

# name -> (world size, ParallelConfig keywords, dp_replicate)
LAYOUTS: dict[str, tuple[int, dict[str, Any], int]] = {
    "fsdp": (2, {"strategy": "fsdp"}, 0),
    "pp2": (2, {"strategy": "none", "pp": 2}, 1),
    "pp2-interleaved": (2, {"strategy": "none", "pp": 2, "pp_virtual_stages": 2,
                            "pp_schedule": "interleaved1f1b"}, 1),
    "fsdp2xtp2": (4, {"strategy": "fsdp", "tp": 2}, 0),
}


Layout = tuple[ParallelConfig, ParallelDims, DeviceMesh]


def make_layout(world_size: int, layout: str) -> Layout:
    _, keywords, dp_replicate = LAYOUTS[layout]
    cfg = ParallelConfig(**keywords)
    dims = ParallelDims.resolve(cfg.strategy, world_size, dp_replicate, 0, cfg.tp, cfg.pp)
    return cfg, dims, dims.build_mesh("cpu")[0]


def build_as_worker(layout: Layout, shape: GPTShape, deferred: bool) -> nn.Module:
    """The worker's build sequence for ``layout``; returns the module to train."""
    cfg, dims, mesh = layout
    torch.manual_seed(SEED)
    model, record = build_model_deferred(lambda: GPT(shape), torch.device("cpu"), deferred,
                                         log=lambda message: None, warn=lambda message: None)
    assert (record is not None) == deferred
    model = parallelize(model, ParallelLayout(cfg, dims), mesh).model
    if record is not None:
        materialize(model, record)
    return model


def held_values(rank: int, world_size: int, layout: str) -> dict[str, Any]:
    """The full value of every parameter this rank holds (part of), its local bytes, and
    the generator state after the build."""
    model = unwrap(build_as_worker(make_layout(world_size, layout), SHAPE, deferred=True))
    rng_after = torch.get_rng_state()
    values, local_bytes = {}, 0
    for name, param in model.named_parameters():
        local = param.to_local() if isinstance(param, DTensor) else param
        local_bytes += local.numel() * local.element_size()
        values[name] = param.full_tensor() if isinstance(param, DTensor) else param.detach().clone()
    tensors = [*model.parameters(), *model.buffers()]
    return {"values": values, "local_bytes": local_bytes, "rng_after": rng_after,
            "on_meta": [t.device.type for t in tensors if t.is_meta],
            "tied": getattr(model, "lm_head", None) is not None and getattr(model, "tok_emb", None) is not None
            and model.lm_head.weight is model.tok_emb.weight}


def _resident_kib(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise LookupError(field)


def _release_free_memory() -> None:
    """Give the C heap's free pages back to the system, so that a build cannot hide its
    peak in memory that an earlier one freed but the process kept."""
    gc.collect()
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):  # not glibc: the measure is only less strict
        pass


def peak_build_kib(layout: Layout, deferred: bool) -> int:
    """How far this process's resident memory rose, at its highest, while building."""
    _release_free_memory()
    Path("/proc/self/clear_refs").write_text("5")  # restart the high-water mark (VmHWM) from now
    before = _resident_kib("VmRSS")
    model = build_as_worker(layout, LARGE, deferred)
    peak = _resident_kib("VmHWM") - before
    del model
    return peak


def build_peaks(rank: int, world_size: int, layout: str) -> dict[str, int]:
    """Peak memory of a build on meta and of one on the device, in KiB, after small
    builds both ways have paid for one-time set-up (the mesh, lazy imports)."""
    parts = make_layout(world_size, layout)
    for deferred in (True, False):
        build_as_worker(parts, SHAPE, deferred)
    meta = peak_build_kib(parts, deferred=True)
    return {"meta": meta, "device": peak_build_kib(parts, deferred=False)}
