"""Data-parallel wrappers as functions on a plain module: DDP and FSDP2 (ZeRO-2/3, HSDP)."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import CPUOffloadPolicy, FSDPModule, MixedPrecisionPolicy, OffloadPolicy, fully_shard
from torch.nn.parallel import DistributedDataParallel

from meshyard.models.moe import expert_modules
from meshyard.parallel.units import describe_units, find_blocks


def apply_ddp(
    model: nn.Module,
    dp_mesh: DeviceMesh,
    bucket_mb: float = 25.0,
    gradient_as_bucket_view: bool = True,
    static_graph: bool = False,
) -> nn.Module:
    """Replicate ``model`` over the 1-D ``dp_mesh``; gradients are averaged in buckets.

    ``gradient_as_bucket_view`` makes ``.grad`` a view into the all-reduce buckets
    (one gradient-sized copy less); ``static_graph`` lets DDP skip per-step graph checks
    when every step uses the same parameters. A compression hook is registered on the
    result afterwards (``meshyard.comm.attach_compression``).
    """
    device = next(model.parameters()).device
    return DistributedDataParallel(
        model,
        device_ids=[device.index] if device.type == "cuda" else None,
        process_group=dp_mesh.get_group(),
        bucket_cap_mb=bucket_mb,
        gradient_as_bucket_view=gradient_as_bucket_view,
        static_graph=static_graph,
    )


def apply_fsdp(
    model: nn.Module,
    dp_mesh: DeviceMesh,
    reshard_after_forward: bool = True,
    param_dtype: torch.dtype | None = None,
    reduce_dtype: torch.dtype | None = None,
    forward_prefetch: int = 0,
    backward_prefetch: int = 0,
    unit_names: Sequence[str] = (),
    log: Callable[[str], None] | None = None,
    cpu_offload: bool = False,
    expert_mesh: DeviceMesh | None = None,
    expert_divide_factor: float | None = None,
) -> nn.Module:
    """Shard ``model`` with FSDP2: each block is its own unit, then the root holds the rest.

    ``dp_mesh`` is 1-D for plain sharding or 2-D (replicate, shard) for HSDP.
    ``reshard_after_forward=False`` keeps gathered parameters until backward (ZeRO-2);
    the default frees them after forward and gathers again in backward (ZeRO-3).
    ``forward_prefetch`` / ``backward_prefetch`` = N > 0 issue the all-gathers of the
    next N blocks early (more overlap, N blocks' more memory); 0 keeps FSDP2's default.
    The blocks are the modules of the classes in ``unit_names``, or of the repeated block
    class (``meshyard.parallel.units``); a model without any is one unit, the root.
    ``log`` receives one line saying which units were made. ``cpu_offload`` keeps the
    shards (and so gradients and optimizer states) in host memory, pinned where the mesh
    is on a GPU (pinning needs one). ``expert_mesh``: under expert parallelism, the mesh
    the expert weights (split over the ``ep`` ranks already) are sharded over, each MoE
    layer's experts a unit of their own whose reduced gradient is divided by
    ``expert_divide_factor`` (the whole data-parallel degree: every rank's tokens reached
    them through the all-to-all), reduced in fp32 where fp16 gradients would be divided
    twice (``_expert_policy``).
    """
    policy = MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=reduce_dtype)
    offload = (CPUOffloadPolicy(pin_memory=dp_mesh.device_type == "cuda") if cpu_offload
               else OffloadPolicy())
    blocks = find_blocks(model, unit_names)
    if log is not None:
        log(describe_units(model, blocks))
    for experts in expert_modules(model) if expert_mesh is not None else ():
        fully_shard(experts, mesh=expert_mesh, reshard_after_forward=reshard_after_forward,
                    mp_policy=_expert_policy(policy, expert_mesh, experts.w_in.dtype), offload_policy=offload)
        if expert_divide_factor is not None:
            experts.set_gradient_divide_factor(expert_divide_factor)
            # Reduce-scattered gradients: a sum, then a division, since a division inside
            # the reduction (PREMUL_SUM) is NCCL's only. Not on a shard dimension of one
            # rank: FSDP divides while copying the gradient there, and would again after.
            experts.set_force_sum_reduction_for_comms(expert_mesh.size(-1) > 1)
    for index, block in enumerate(blocks):
        # The last block's parameters are needed at once by backward, so freeing them
        # after forward would only cost an extra all-gather.
        reshard = reshard_after_forward and index < len(blocks) - 1
        fully_shard(block, mesh=dp_mesh, reshard_after_forward=reshard, mp_policy=policy, offload_policy=offload)
    fully_shard(model, mesh=dp_mesh, reshard_after_forward=reshard_after_forward, mp_policy=policy,
                offload_policy=offload)
    set_prefetch(blocks, forward_prefetch, backward_prefetch)
    return model


def _expert_policy(policy: MixedPrecisionPolicy, expert_mesh: DeviceMesh,
                   weight_dtype: torch.dtype) -> MixedPrecisionPolicy:
    """The mixed precision of the expert units: ``policy``, but reducing in fp32 where their
    mesh's shard dimension has one rank (dp_shard = ep) and the gradients are fp16.

    There FSDP copies the gradient instead of reduce-scattering it and divides it by the
    divide factor while copying; for fp16 gradients it also splits that factor into a
    division before and one after the reduction (against overflow), and applies them too:
    the gradient would be divided by the factor's square. fp32 and bf16 gradients take no
    such split, so the copy's division is the only one."""
    reduce_dtype = policy.reduce_dtype or policy.param_dtype or weight_dtype
    if expert_mesh.size(-1) > 1 or reduce_dtype in (torch.float32, torch.bfloat16):
        return policy
    return dataclasses.replace(policy, reduce_dtype=torch.float32)


def set_prefetch(blocks: list[nn.Module], forward: int, backward: int) -> None:
    """Explicit FSDP2 prefetching: block i gathers blocks i+1..i+N in forward and
    i-1..i-N (nearest first, the order backward reaches them) in backward."""
    for index, block in enumerate(blocks):
        if forward > 0 and index + 1 < len(blocks):
            block.set_modules_to_forward_prefetch(blocks[index + 1:index + 1 + forward])
        if backward > 0 and index > 0:
            block.set_modules_to_backward_prefetch(blocks[max(0, index - backward):index][::-1])


def unwrap(model: nn.Module) -> nn.Module:
    """The user's module without DDP or compile wrappers (stable state-dict keys)."""
    while isinstance(model, DistributedDataParallel) or hasattr(model, "_orig_mod"):
        model = model.module if isinstance(model, DistributedDataParallel) else model._orig_mod
    return model


def set_gradient_sync(model: nn.Module, enabled: bool) -> None:
    """Turn gradient synchronisation on or off for the next backward (accumulation)."""
    if isinstance(model, FSDPModule):
        model.set_requires_gradient_sync(enabled)
    elif isinstance(model, DistributedDataParallel):
        model.require_backward_grad_sync = enabled
