"""``parallelize``: the one place where parallelisms are composed, in a fixed order."""

from __future__ import annotations

from typing import Callable, NamedTuple

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from meshyard.comm.hooks import GradientCompression
from meshyard.comm.registry import attach_compression
from meshyard.config.sections import CommConfig
from meshyard.parallel.activation_checkpoint import apply_ac
from meshyard.parallel.compile import Compilation, apply_compile
from meshyard.parallel.context_parallel import SequenceSplit, apply_cp
from meshyard.parallel.data_parallel import apply_ddp, apply_fsdp
from meshyard.parallel.expert_parallel import apply_ep
from meshyard.parallel.layout import Layout
from meshyard.parallel.pipeline import split_model
from meshyard.parallel.tensor_parallel import apply_tp
from meshyard.parallel.units import block_class_names


class Parallelized(NamedTuple):
    """The module to train, the state of its gradient communication, and its layout.

    ``compression`` always exists (a null object where nothing is compressed): the
    trainer adds ``compression.take_step_stats()`` to each step's record, and the
    checkpointer saves ``compression.state_dict()`` per rank. ``layout`` answers what the
    layout implies for everything downstream (step runner, precision, optimizer,
    checkpoint).
    """

    model: nn.Module
    compression: GradientCompression
    layout: Layout
    compilation: Compilation = Compilation()
    """What ``parallelize`` compiled (nothing unless it was given a ``compilation``)."""
    sequence: SequenceSplit | None = None
    """This rank's share of each sequence under context parallelism (None without it)."""


def parallelize(
    model: nn.Module,
    layout: Layout,
    mesh: DeviceMesh,
    compute_dtype: torch.dtype = torch.float32,
    reduce_fp32: bool = True,
    comm: CommConfig | None = None,
    hook_wrapper: Callable[[Callable], Callable] | None = None,
    log: Callable[[str], None] | None = None,
    example_tokens: torch.Tensor | None = None,
    compilation: Compilation | None = None,
) -> Parallelized:
    """Apply ``layout`` to ``model`` (already on its device, or on the meta device).

    Order: pipeline split (each rank keeps its stages; every stage then goes through the
    rest as a model of its own, with ``layout.stage_layout()``), expert parallel (expert
    weights become DTensors on the ``ep`` mesh, tokens go all-to-all), context parallel
    (attention becomes a ring over the ``cp`` ranks; parameters untouched), tensor parallel
    (parameters become DTensors on the ``tp`` mesh), activation checkpointing (wraps
    block forwards, so it sees the TP modules), compilation of each block when
    ``compilation`` is given (it records what it compiled), then data parallelism, outermost,
    because DDP and FSDP must see the final module structure (FSDP over TP DTensors gives
    2-D FSDP x TP); the gradient-compression hook goes on the DDP module last. Returns
    the module to train (``unwrap`` recovers the plain module from it; under pipelining a
    ``PipelinedModel`` holding this rank's stages), the compression state and the layout.
    ``log`` receives a line per model or stage saying which FSDP units it was cut into.
    ``example_tokens``: token ids shaped as one pipeline micro-batch, on which a model
    other than meshyard's GPT is traced to cut it into stages (``pipeline.split_model``).
    """
    comm = comm or CommConfig()
    # Resolved on the whole model: a pipeline stage may hold one block, so none repeated.
    units = block_class_names(model, layout.cfg.fsdp_units)
    if layout.pipelined:
        cfg = layout.cfg
        pipelined = split_model(model, layout.dims.pp, mesh["pp"].get_local_rank(), cfg.pp_virtual_stages,
                                cfg.pp_split, units, example_tokens, torch.device(mesh.device_type))
        stage_layout = layout.stage_layout()
        pipelined.wrap_stages(lambda stage: _parallelize_whole(stage, stage_layout, mesh, compute_dtype,
                                                               reduce_fp32, units, log, compilation))
        return Parallelized(pipelined, attach_compression(pipelined, comm, hook_wrapper), layout,
                            compilation or Compilation())
    sequence = apply_cp(model, mesh["cp"]) if layout.context_parallel else None
    model = _parallelize_whole(model, layout, mesh, compute_dtype, reduce_fp32, units, log, compilation)
    return Parallelized(model, attach_compression(model, comm, hook_wrapper), layout, compilation or Compilation(),
                        sequence)


def _parallelize_whole(model: nn.Module, layout: Layout, mesh: DeviceMesh, compute_dtype: torch.dtype,
                       reduce_fp32: bool, units: tuple[str, ...] = (),
                       log: Callable[[str], None] | None = None,
                       compilation: Compilation | None = None) -> nn.Module:
    """TP, activation checkpointing, then FSDP or DDP, on a model without pipeline stages;
    ``units`` are the classes of the blocks checkpointed and sharded one by one."""
    cfg, dims = layout.effective_cfg, layout.dims
    if dims.ep > 1:
        model = apply_ep(model, mesh["ep"])
    if dims.tp > 1:
        model = apply_tp(model, mesh["tp"], cfg.sequence_parallel, loss_parallel=layout.loss_parallel,
                         plan=cfg.tp_plan, log=log)
    model = apply_ac(model, cfg.ac, cfg.ac_every, units)
    if compilation is not None:
        model = apply_compile(model, compilation, units)
    if layout.data_parallel == "fsdp":
        dp_mesh = _fsdp_mesh(mesh, layout)
        low_precision = compute_dtype if compute_dtype != torch.float32 else None
        reduce_dtype = torch.float32 if (low_precision and reduce_fp32) else None
        return apply_fsdp(model, dp_mesh, cfg.reshard_after_forward, low_precision, reduce_dtype,
                          forward_prefetch=cfg.forward_prefetch, backward_prefetch=cfg.backward_prefetch,
                          unit_names=units, log=log, cpu_offload=cfg.cpu_offload,
                          **_expert_sharding(layout, mesh))
    if layout.data_parallel == "ddp":
        return apply_ddp(model, _ddp_mesh(mesh, layout), cfg.bucket_mb,
                         gradient_as_bucket_view=cfg.gradient_as_bucket_view, static_graph=cfg.static_graph)
    return model


def _fsdp_mesh(mesh: DeviceMesh, layout: Layout) -> DeviceMesh:
    """Where FSDP shards: over dp_shard, with dp_replicate as HSDP's replicas in one 2-D
    mesh; under context parallelism over dp_shard x cp flattened, since the cp ranks
    compute gradients of one model from different tokens (torchtitan's ``dp_shard_cp``).
    'ddp' carried out by FSDP2 replicates over dp_replicate x cp instead (a 2-D mesh whose
    shard dimension is 1, HSDP's pure replication), as DDP would over ``_ddp_mesh``."""
    dims = layout.dims
    if not layout.context_parallel:
        return mesh["dp_replicate", "dp_shard"] if dims.dp_replicate > 1 else mesh["dp_shard"]
    flat = mesh["dp_replicate", "dp_shard", "cp"]._flatten("dp_cp")
    if layout.replicates_with_fsdp:  # dp_shard is 1 under 'ddp'
        return flat._unflatten(0, (dims.dp_replicate * dims.cp, 1), ("dp_cp_replicate", "dp_cp_shard"))
    if dims.dp_replicate == 1:
        return flat
    return flat._unflatten(0, (dims.dp_replicate, dims.dp_shard * dims.cp), ("dp_replicate", "dp_shard_cp"))


def _ddp_mesh(mesh: DeviceMesh, layout: Layout) -> DeviceMesh:
    """Where DDP averages gradients: the replicas, and under context parallelism their cp
    ranks too (dp_shard is 1 under DDP)."""
    if not layout.context_parallel:
        return mesh["dp_replicate"]
    return mesh["dp_replicate", "dp_shard", "cp"]._flatten("dp_cp")


def _expert_sharding(layout: Layout, mesh: DeviceMesh) -> dict[str, object]:
    """FSDP's arguments for expert weights under expert parallelism ({} without it): their
    own mesh, and the whole data-parallel degree to divide their gradients by."""
    dims = layout.dims
    if dims.ep == 1:
        return {}
    return {"expert_mesh": dims.expert_dp_mesh(mesh), "expert_divide_factor": float(dims.dp)}
