"""Tensor parallelism (Megatron-style), through ``parallelize_module``: meshyard's GPT and users' models.

Each block: attention heads and the MLP's hidden units are split over the ``tp`` ranks
(column-parallel in, row-parallel out), so a block costs two all-reduces (or, with
sequence parallelism, an all-gather and a reduce-scatter each) per forward. A
mixture-of-experts block splits its attention and shared experts; its router and routed
experts run whole on every tp rank, on the same tokens (``_moe_plan``). With
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

Other models get a plan from ``tp_plans`` (their own ``tensor_parallel_plan(tp_mesh)``,
the config's ``parallel.tp_plan``, the plan a Hugging Face config publishes, or a
built-in plan recognised by structure), applied
by ``apply_plan`` with torch's styles and three of meshyard's: ``FusedQKVParallel``
(any fused projection, nn.Linear or Hugging Face's Conv1D), ``Conv1DColwiseParallel`` /
``Conv1DRowwiseParallel`` (torch's styles handle nn.Linear and nn.Embedding only), and
``ReplicateParallel`` for every module the plan leaves whole: all parameters become
DTensors on the tp mesh, so FSDP, clipping and the optimizer see one kind of parameter.
"""

from __future__ import annotations

import logging
from typing import Any, Callable

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Partial, Placement, Replicate, Shard, distribute_module, distribute_tensor
from torch.distributed.tensor.parallel import (ColwiseParallel, ParallelStyle, PrepareModuleInput,
                                               PrepareModuleInputOutput, RowwiseParallel, SequenceParallel,
                                               parallelize_module)
from torch.utils._pytree import tree_leaves, tree_map_only

from meshyard.models.moe import MoEFeedForward
from meshyard.parallel.tp_modules import is_conv1d, pattern_of, per_rank_attributes, tied_groups
from meshyard.parallel.tp_plans import (Split, TPPlan, TPPlanError, gpt_problems, is_meshyard_gpt, no_plan_problems,
                                        plan_problems, resolve_plan)


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


def _distribute_params(module: nn.Module, mesh: DeviceMesh, placements: dict[str, Placement]) -> None:
    """``module``'s own parameters named in ``placements`` as DTensors placed so."""
    for name, param in list(module.named_parameters(recurse=False)):
        if name in placements:
            dtensor = distribute_tensor(param.detach(), mesh, [placements[name]])
            module.register_parameter(name, nn.Parameter(dtensor, requires_grad=param.requires_grad))


def _linear(module: nn.Module, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """nn.Linear's product, for a Conv1D too (its weight is stored (in, out))."""
    return F.linear(x, weight.t() if is_conv1d(module) else weight, bias)


def _replicated(x: torch.Tensor, mesh: DeviceMesh) -> DTensor:
    """A plain tensor, the same on every rank, as a Replicate DTensor (DTensors pass)."""
    return x if isinstance(x, DTensor) else DTensor.from_local(x, mesh, (Replicate(),), run_check=False)


class FusedQKVParallel(ParallelStyle):
    """Column-parallel fused projection that keeps each rank's part of every block.

    A fused projection's output is ``parts`` equal blocks (q|k|v: 3, gate|up: 2) that the
    model cuts apart, so rank r must compute the r-th slice of each block (its heads of
    q, k and v), a strided set of rows. The weight (and bias) is stored as a plain shard
    of its output dimension (1/tp of the memory, and a layout DCP saves and reshards
    like any other). In forward each rank gathers it and multiplies by its own rows; in
    backward the gradient, non-zero only in those rows, is reduce-scattered back.

    Takes nn.Linear and Hugging Face's Conv1D. Input: the full (replicated) activation
    as a plain tensor. Output: a plain tensor ``[q_r | k_r | v_r]`` of this rank's
    slices, which the model's split into ``parts`` and per-head views read correctly.
    """

    def __init__(self, parts: int = 3) -> None:
        super().__init__()
        self.parts = parts

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        parts, size = self.parts, device_mesh.size()
        out_dim = 1 if is_conv1d(module) else 0  # a Conv1D weight is (in, out)
        if not (isinstance(module, nn.Linear) or is_conv1d(module)) or module.weight.shape[out_dim] % (parts * size):
            raise TypeError(f"FusedQKVParallel applies to an nn.Linear or Conv1D whose outputs form {parts} "
                            f"blocks divisible by tp = {size}")
        _distribute_params(module, device_mesh, {"weight": Shard(out_dim), "bias": Shard(0)})
        rank, group = device_mesh.get_local_rank(), device_mesh.get_group()

        def own_part(param: DTensor, dim: int) -> torch.Tensor:
            # Gathered for this forward only; each rank's gradient covers its own rows,
            # so it is declared partial and reduce-scattered to the shards in backward.
            full = param.full_tensor(grad_placements=(Partial(),))
            # (parts * C) -> (parts, tp, C / tp) along ``dim`` -> this rank's slice of each block.
            blocks = full.unflatten(dim, (parts, size, full.shape[dim] // (parts * size)))
            return blocks.select(dim + 1, rank).flatten(dim, dim + 1)

        def forward(x: torch.Tensor) -> torch.Tensor:
            x = _SumGradOverTP.apply(x, group)  # each rank's input gradient covers its slices only
            bias = own_part(module.bias, 0) if module.bias is not None else None
            return _linear(module, x, own_part(module.weight, out_dim), bias)

        module.forward = forward
        return module


class Conv1DColwiseParallel(ParallelStyle):
    """torch's ColwiseParallel for Hugging Face's Conv1D (weight (in, out), split by
    output column). Input: the full activation; output: this rank's columns as a plain
    tensor, or, with ``output_layout = Replicate()``, all of them."""

    def __init__(self, output_layout: Placement = Shard(-1), use_local_output: bool = True) -> None:
        super().__init__()
        self.output_layout, self.use_local_output = output_layout, use_local_output

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        _distribute_params(module, device_mesh, {"weight": Shard(1), "bias": Shard(0)})

        def forward(x: torch.Tensor) -> torch.Tensor:
            x = _replicated(x, device_mesh).redistribute(placements=(Replicate(),))
            out = _linear(module, x, module.weight, module.bias).redistribute(placements=(self.output_layout,))
            return out.to_local() if self.use_local_output else out

        module.forward = forward
        return module


class Conv1DRowwiseParallel(ParallelStyle):
    """torch's RowwiseParallel for Hugging Face's Conv1D (weight split by input row).
    Input: this rank's slice of the features (a colwise module's output), or with
    ``input_layout = Replicate()`` all of them, cut here; output: the full sum, as a
    plain tensor."""

    def __init__(self, input_layout: Placement = Shard(-1)) -> None:
        super().__init__()
        self.input_layout = input_layout

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        _distribute_params(module, device_mesh, {"weight": Shard(0), "bias": Replicate()})

        def forward(x: torch.Tensor) -> torch.Tensor:
            if not isinstance(x, DTensor):
                x = DTensor.from_local(x, device_mesh, (self.input_layout,), run_check=False)
            x = x.redistribute(placements=(Shard(-1),))
            out = _linear(module, x, module.weight, module.bias)
            return out.redistribute(placements=(Replicate(),)).to_local()

        module.forward = forward
        return module


class ReplicateParallel(ParallelStyle):
    """The whole module on every rank (norms, position embeddings, anything a plan does
    not split). Its own parameters become Replicate DTensors; it computes on DTensors,
    taking its plain tensor inputs as replicated (they are: every rank holds the full
    activation), and returns plain tensors, or DTensors to a caller that passed some
    (a replicated module around it). ``tp_plans`` refuses a module holding parameters
    of its own around modules a plan splits, whose plain outputs it could not mix in."""

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        _distribute_params(module, device_mesh, {name: Replicate() for name, param in
                                                 module.named_parameters(recurse=False)
                                                 if not isinstance(param, DTensor)})
        original = module.forward

        def forward(*args: Any, **kwargs: Any) -> Any:
            called_with_dtensors = any(isinstance(t, DTensor) for t in tree_leaves((args, kwargs)))
            args, kwargs = tree_map_only(torch.Tensor, lambda t: _replicated(t, device_mesh), (args, kwargs))
            out = original(*args, **kwargs)
            return out if called_with_dtensors else tree_map_only(DTensor, lambda t: t.to_local(), out)

        module.forward = forward
        return module


def _style(module: nn.Module, split: Split, logits_split: bool) -> ParallelStyle:
    """The ParallelStyle carrying out ``split`` on ``module``'s type; ``logits_split``:
    the output head returns vocabulary-split logits (a DTensor, for loss parallel)."""
    if split.style == "replicate":
        return ReplicateParallel()
    embedding = isinstance(module, nn.Embedding)
    if split.style == "rowwise":
        if embedding:  # vocabulary split: each rank looks up its rows, the sum is the embedding
            return RowwiseParallel(input_layouts=Replicate(), output_layouts=Replicate())
        given: Placement = Replicate() if split.whole_input else Shard(-1)
        return Conv1DRowwiseParallel(given) if is_conv1d(module) else RowwiseParallel(input_layouts=given)
    if split.parts > 1:
        return FusedQKVParallel(split.parts)
    output: Placement = Replicate() if split.gather or embedding else Shard(-1)
    output, local = (Shard(-1), False) if logits_split else (output, True)
    if is_conv1d(module):
        return Conv1DColwiseParallel(output, use_local_output=local)
    return ColwiseParallel(output_layouts=output, use_local_output=local)


def apply_plan(model: nn.Module, tp_mesh: DeviceMesh, plan: TPPlan, loss_parallel: bool = False,
               log: Callable[[str], None] | None = None) -> nn.Module:
    """Split ``model`` as ``plan`` says, replicate every other module with parameters,
    re-tie tied parameters, and set the per-rank head counts and widths (the head rule
    of ``tp_modules``); ``log`` hears what was done. Parameter names and full shapes are
    unchanged."""
    tied = tied_groups(model)
    for name, split in plan.splits.items():
        module = model.get_submodule(name)
        parallelize_module(module, tp_mesh, _style(module, split, loss_parallel and name == plan.output_head))
    for module in list(model.modules()):
        if any(not isinstance(p, DTensor) for p in module.parameters(recurse=False)):
            parallelize_module(module, tp_mesh, ReplicateParallel())
    for first, *others in tied:
        # Each module got its own DTensor of the shared weight; share the first again.
        shared = model.get_parameter(first)
        for name in others:
            owner, _, leaf = name.rpartition(".")
            setattr(model.get_submodule(owner), leaf, shared)
    adjusted = []
    for name in plan.attention:
        module = model.get_submodule(name)
        for attr, value in per_rank_attributes(module, tp_mesh.size()).items():
            adjusted.append(f"{pattern_of(name)}.{attr} {getattr(module, attr)} -> {value}")
            setattr(module, attr, value)
    _log_plan(plan, list(dict.fromkeys(adjusted)), log or _rank_log)
    return model


def _log_plan(plan: TPPlan, adjusted: list[str], log: Callable[[str], None]) -> None:
    """One line per style (repeated blocks said once), then the head rule and the notes."""
    by_style: dict[str, list[str]] = {}
    for name, split in plan.splits.items():
        shown = pattern_of(name) + (f" ({split.parts} fused blocks)" if split.parts > 1 else "")
        if shown not in by_style.setdefault(split.style, []):
            by_style[split.style].append(shown)
    log(f"tensor parallel: {plan.source}; " + "; ".join(f"{style}: {', '.join(names)}"
                                                        for style, names in by_style.items()))
    if adjusted:
        log(f"tensor parallel: per-rank attention attributes: {', '.join(adjusted)}")
    for note in plan.notes:
        log(f"tensor parallel: {note}")


def _rank_log(message: str) -> None:
    """This rank's log (``metrics.records.rank_logger``), where the run set one up."""
    logging.getLogger(f"meshyard.rank{dist.get_rank() if dist.is_initialized() else 0}").info(message)


def _check_divisible(model: nn.Module, tp: int) -> None:
    problems = gpt_problems(model, tp)
    if problems:
        raise TPPlanError("; ".join(problems))


def _block_plan(block: nn.Module, sequence_parallel: bool) -> dict[str, ParallelStyle]:
    """One transformer block: norms on sequence shards, attention and MLP split by heads/units."""
    between = Shard(1) if sequence_parallel else Replicate()
    plan: dict[str, ParallelStyle] = {
        "attn": PrepareModuleInput(input_layouts=(between,), desired_input_layouts=(Replicate(),),
                                   use_local_output=True),
        "attn.qkv": FusedQKVParallel(),
        "attn.proj": RowwiseParallel(output_layouts=between),
    }
    if isinstance(block.mlp, MoEFeedForward):
        plan.update(_moe_plan(block.mlp, between))
    else:
        plan.update({
            "mlp": PrepareModuleInput(input_layouts=(between,), desired_input_layouts=(Replicate(),)),
            "mlp.fc": ColwiseParallel(),
            "mlp.proj": RowwiseParallel(output_layouts=between),
        })
    if sequence_parallel:
        plan.update({"ln_1": SequenceParallel(), "ln_2": SequenceParallel()})
    return plan


def _moe_plan(moe: MoEFeedForward, between: Shard | Replicate) -> dict[str, ParallelStyle]:
    """A mixture-of-experts feed-forward: each tp rank takes the whole hidden state of its
    tokens (gathered along the sequence under SP) and routes them alike through a whole
    router and whole experts (expert parallelism spreads those); the output returns to the
    residual stream's layout (a slice whose backward gathers the gradient). Shared experts,
    dense on every token, are split by hidden units and summed over tp like a dense MLP."""
    plan: dict[str, ParallelStyle] = {
        "mlp": PrepareModuleInputOutput(input_layouts=(between,), desired_input_layouts=(Replicate(),),
                                        use_local_input=True, output_layouts=(Replicate(),),
                                        desired_output_layouts=(between,), use_local_output=True),
    }
    if moe.shared is not None:
        plan["mlp.shared.fc"] = ColwiseParallel()
        plan["mlp.shared.proj"] = RowwiseParallel(output_layouts=Replicate())
    return plan


def _replicate(module: nn.Module, tp_mesh: DeviceMesh) -> None:
    """Parameters as Replicate DTensors; plain tensors in and out (position embedding)."""
    def as_replicated(mod: nn.Module, inputs: tuple, mesh: DeviceMesh) -> tuple:
        return tuple(DTensor.from_local(x, mesh, (Replicate(),), run_check=False) for x in inputs)

    distribute_module(module, tp_mesh, input_fn=as_replicated, output_fn=lambda mod, out, mesh: out.to_local())


def apply_tp(model: nn.Module, tp_mesh: DeviceMesh, sequence_parallel: bool = True, loss_parallel: bool = False,
             plan: dict[str, str] | None = None, log: Callable[[str], None] | None = None) -> nn.Module:
    """Split ``model`` over the 1-D ``tp_mesh``; parameter names and full shapes are unchanged.

    The plan, first match wins: the model's own ``tensor_parallel_plan(tp_mesh)`` (or
    meshyard's GPT's), then ``plan`` (the config's ``parallel.tp_plan``: module-name
    patterns to styles), then a Hugging Face model's ``config.base_model_tp_plan``
    (``hf_plans``), then a built-in plan recognised by structure (``tp_plans``). A
    model no plan fits, or one whose counts tp does not divide, raises ``TPPlanError``.

    With ``loss_parallel`` an output head split by vocabulary returns logits split by
    vocabulary (a DTensor), and the loss must be computed under
    ``torch.distributed.tensor.parallel.loss_parallel``: the full (batch x sequence x
    vocabulary) logits are never gathered on one rank. Other heads return plain logits.
    Sequence parallelism applies to meshyard's GPT only (``log`` says so otherwise;
    it defaults to this rank's log).
    """
    log = log or _rank_log
    if hasattr(model, "tensor_parallel_plan"):
        log("tensor parallel: the model's own tensor_parallel_plan(tp_mesh)")
        return parallelize_module(model, tp_mesh, model.tensor_parallel_plan(tp_mesh))
    if is_meshyard_gpt(model):
        if plan:
            log("tensor parallel: parallel.tp_plan is not used: meshyard's GPT has its own plan")
        return _apply_gpt_tp(model, tp_mesh, sequence_parallel, loss_parallel)
    tp = tp_mesh.size()
    resolved = resolve_plan(model, plan or {}, tp)
    problems = no_plan_problems(model, tp) if resolved is None else plan_problems(model, resolved, tp)
    if problems:
        raise TPPlanError("; ".join(problems))
    if sequence_parallel:
        resolved.notes.append("sequence parallelism is off for this plan (it splits meshyard's GPT only): "
                              "norms and dropout see the whole sequence on every rank")
    return apply_plan(model, tp_mesh, resolved, loss_parallel, log)


def _apply_gpt_tp(model: nn.Module, tp_mesh: DeviceMesh, sequence_parallel: bool, loss_parallel: bool) -> nn.Module:
    """meshyard's GPT, or a pipeline stage of it (parts it does not hold are skipped)."""
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
        parallelize_module(block, tp_mesh, _block_plan(block, sequence_parallel))
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
