"""Tensor parallelism (Megatron-style) for the GPT, through ``parallelize_module``.

Each block: attention heads and the MLP's hidden units are split over the ``tp`` ranks
(column-parallel in, row-parallel out), so a block costs two all-reduces (or, with
sequence parallelism, an all-gather and a reduce-scatter each) per forward. With
sequence parallelism the norms, dropouts and residual stream between the blocks hold
only ``seq_len / tp`` positions per rank. The token embedding is split by vocabulary;
the output head, tied to it or not, by vocabulary too.

The fused ``attn.qkv`` projection needs care: its output is chunked into q, k, v and
each is viewed as (heads, head_dim), so a plain column split would hand rank 0 all of
q and half of k. Rank r must instead compute the rows of heads r*H/tp..(r+1)*H/tp of
each of q, k and v, a strided set of rows that DCP cannot store as a shard. So the
weight keeps its plain row shard (name, shape and checkpoints unchanged) and is
gathered for each forward, like an FSDP unit, and each rank multiplies only by its own
heads' rows (``FusedQKVParallel``); docs/parallelism.md discusses the trade-off.

Any model may bring its own plan instead: a method ``tensor_parallel_plan(tp_mesh)``
returning ``{module name: ParallelStyle}`` is applied as it is.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard, distribute_module, distribute_tensor
from torch.distributed.tensor.parallel import (ColwiseParallel, ParallelStyle, PrepareModuleInput,
                                               RowwiseParallel, SequenceParallel, parallelize_module)


class _SumGradOverTP(torch.autograd.Function):
    """Identity forward; backward sums the gradient over the tensor-parallel group
    (Megatron's "f": each rank's gradient covers only its own heads)."""

    @staticmethod
    def forward(ctx: Any, tensor: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
        ctx.group = group
        return tensor.view_as(tensor)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        grad = grad.contiguous()
        dist.all_reduce(grad, group=ctx.group)
        return grad, None


class FusedQKVParallel(ParallelStyle):
    """Column-parallel fused q/k/v projection that keeps q, k and v blocks per rank.

    The weight (and bias) is stored as a plain row shard (``Shard(0)``: 1/tp of the
    memory, and a layout DCP saves and reshards like any other). In forward each rank
    gathers it and multiplies by the rows of its own heads of q, k and v; in backward
    the gradient, non-zero only in those rows, is reduce-scattered back to the shards.

    Input: the full (replicated) activation as a plain tensor. Output: a plain tensor
    ``[q_r | k_r | v_r]`` of this rank's heads, which the model's ``chunk(3)`` and
    ``view(B, T, -1, head_dim)`` read correctly.
    """

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        if not isinstance(module, nn.Linear) or module.out_features % (3 * device_mesh.size()):
            raise TypeError("FusedQKVParallel applies to an nn.Linear with 3 x d_model outputs, d_model % tp == 0")
        for name, param in list(module.named_parameters(recurse=False)):
            module.register_parameter(name, nn.Parameter(distribute_tensor(param, device_mesh, [Shard(0)])))
        rank, size, group = device_mesh.get_local_rank(), device_mesh.size(), device_mesh.get_group()

        def own_rows(param: DTensor) -> torch.Tensor:
            # Gathered for this forward only; each rank's gradient covers its own rows,
            # so it is declared partial and reduce-scattered to the shards in backward.
            full = param.full_tensor(grad_placements=(Partial(),))
            # (3 * C, ...) -> (q|k|v, rank, C / tp, ...) -> this rank's rows of q, k and v.
            blocks = full.view(3, size, full.shape[0] // (3 * size), *full.shape[1:])
            return blocks[:, rank].reshape(-1, *full.shape[1:])

        def forward(x: torch.Tensor) -> torch.Tensor:
            x = _SumGradOverTP.apply(x, group)  # each rank's input gradient covers its heads only
            bias = own_rows(module.bias) if module.bias is not None else None
            return F.linear(x, own_rows(module.weight), bias)

        module.forward = forward
        return module


def _check_divisible(model: nn.Module, tp: int) -> None:
    shape = getattr(model, "shape", None)
    if shape is None:
        return
    problems = [f"{name} = {value} is not divisible by parallel.tp = {tp}"
                for name, value in (("model.n_head", shape.n_head), ("model.d_model", shape.d_model),
                                    ("vocab_size", shape.vocab_size)) if value % tp]
    if problems:
        raise ValueError("; ".join(problems))


def _block_plan(sequence_parallel: bool) -> dict[str, ParallelStyle]:
    """One transformer block: norms on sequence shards, attention and MLP split by heads/units."""
    between = Shard(1) if sequence_parallel else Replicate()
    plan: dict[str, ParallelStyle] = {
        "attn": PrepareModuleInput(input_layouts=(between,), desired_input_layouts=(Replicate(),),
                                   use_local_output=True),
        "attn.qkv": FusedQKVParallel(),
        "attn.proj": RowwiseParallel(output_layouts=between),
        "mlp": PrepareModuleInput(input_layouts=(between,), desired_input_layouts=(Replicate(),)),
        "mlp.fc": ColwiseParallel(),
        "mlp.proj": RowwiseParallel(output_layouts=between),
    }
    if sequence_parallel:
        plan.update({"ln_1": SequenceParallel(), "ln_2": SequenceParallel()})
    return plan


def _replicate(module: nn.Module, tp_mesh: DeviceMesh) -> None:
    """Parameters as Replicate DTensors; plain tensors in and out (position embedding)."""
    def as_replicated(mod: nn.Module, inputs: tuple, mesh: DeviceMesh) -> tuple:
        return tuple(DTensor.from_local(x, mesh, (Replicate(),), run_check=False) for x in inputs)

    distribute_module(module, tp_mesh, input_fn=as_replicated, output_fn=lambda mod, out, mesh: out.to_local())


def apply_tp(model: nn.Module, tp_mesh: DeviceMesh, sequence_parallel: bool = True,
             loss_parallel: bool = False) -> nn.Module:
    """Split ``model`` over the 1-D ``tp_mesh``; parameter names and full shapes are unchanged.

    With ``loss_parallel`` the output head returns logits split by vocabulary (a DTensor)
    and the loss must be computed under ``torch.distributed.tensor.parallel.loss_parallel``:
    the full (batch x sequence x vocabulary) logits are never gathered on one rank.

    Works on the whole GPT and on a pipeline stage of it (parts it does not hold are
    skipped). A model with ``tensor_parallel_plan(tp_mesh)`` gets its own plan instead.
    """
    if hasattr(model, "tensor_parallel_plan"):
        return parallelize_module(model, tp_mesh, model.tensor_parallel_plan(tp_mesh))
    if not hasattr(model, "blocks"):
        raise TypeError(f"parallel.tp > 1 needs a GPT-like model (tok_emb, blocks, ln_f, lm_head) or a "
                        f"tensor_parallel_plan(tp_mesh) method; {type(model).__name__} has neither")
    _check_divisible(model, tp_mesh.size())
    between = Shard(1) if sequence_parallel else Replicate()
    tied = getattr(model, "lm_head", None) is not None and model.lm_head.weight is getattr(
        getattr(model, "tok_emb", None), "weight", None)
    plan: dict[str, ParallelStyle] = {}
    if getattr(model, "tok_emb", None) is not None:
        plan["tok_emb"] = RowwiseParallel(input_layouts=Replicate(), output_layouts=Replicate())
        # Embeddings are summed in full, then cut along the sequence before the first block.
        plan["drop"] = PrepareModuleInput(input_layouts=(Replicate(),), desired_input_layouts=(between,),
                                          use_local_output=True)
    if getattr(model, "ln_f", None) is not None and sequence_parallel:
        plan["ln_f"] = SequenceParallel()
    if getattr(model, "lm_head", None) is not None and not tied:
        plan["lm_head"] = ColwiseParallel(input_layouts=between,
                                          output_layouts=Shard(-1) if loss_parallel else Replicate(),
                                          use_local_output=not loss_parallel)
    for _, block in _named_blocks(model):
        parallelize_module(block, tp_mesh, _block_plan(sequence_parallel))
    parallelize_module(model, tp_mesh, plan)
    if getattr(model, "pos_emb", None) is not None:
        _replicate(model.pos_emb, tp_mesh)
    if tied:
        # The head shares the vocabulary-split embedding weight: re-tie it, then only its
        # input and output need converting.
        model.lm_head.weight = model.tok_emb.weight
        _vocab_split_head(model.lm_head, tp_mesh, between, loss_parallel)
    return model


def _vocab_split_head(head: nn.Linear, tp_mesh: DeviceMesh, between: Shard | Replicate,
                      loss_parallel: bool) -> None:
    def prepare_input(mod: nn.Module, inputs: tuple, mesh: DeviceMesh) -> tuple:
        x = inputs[0]
        if not isinstance(x, DTensor):
            x = DTensor.from_local(x, mesh, (between,), run_check=False)
        return (x.redistribute(placements=(Replicate(),)),)

    def gather_output(mod: nn.Module, out: DTensor, mesh: DeviceMesh) -> torch.Tensor:
        if loss_parallel:
            return out  # vocabulary-split logits, for a loss computed under loss_parallel()
        return out.redistribute(placements=(Replicate(),)).to_local()

    distribute_module(head, tp_mesh, partition_fn=lambda *args: None,
                      input_fn=prepare_input, output_fn=gather_output)


def _named_blocks(model: nn.Module) -> list[tuple[str, nn.Module]]:
    blocks = model.blocks
    return list(blocks.items()) if isinstance(blocks, nn.ModuleDict) else [(str(i), b) for i, b in enumerate(blocks)]
