"""Pipeline parallelism: cut a GPT into stages that keep the full model's parameter names.

Stage ``s`` of ``S`` holds consecutive transformer blocks (balanced by count, or as given
by ``parallel.pp_split``), plus the embeddings on the first stage and the final norm and
head on the last. Blocks keep their global index (``blocks.5`` stays ``blocks.5``, held
in an ``nn.ModuleDict``), so a checkpoint written under pipelining loads under any other
layout and back.

Rank ``r`` of the ``pp`` group holds stages ``r, r + pp, r + 2 pp, ...`` (one stage for
GPipe and 1F1B; ``pp_virtual_stages`` for the interleaved schedules). Its stages are
gathered in one ``PipelinedModel`` whose own parameter names are those of the full
model; the trainer, optimizer and checkpoints see that container, while the pipeline
schedule drives the stage modules (each parallelized on its own: TP, AC, FSDP/DDP).

Tied embeddings (``lm_head.weight is tok_emb.weight``) live on two stages: the last
stage gets its own copy, and ``sync_tied_grads`` sums the two copies' gradients over the
pipeline group after backward, so both take identical optimizer steps and stay equal.
"""

from __future__ import annotations

from typing import Callable

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor


class PipelineSplitError(ValueError):
    pass


def stage_sizes(n_blocks: int, n_stages: int, split: list[int] | None = None) -> list[int]:
    """Blocks per stage: ``split`` as given (checked), else as even as possible (earlier
    stages get the remainder, later stages already carry the head)."""
    if split:
        if len(split) != n_stages or sum(split) != n_blocks or min(split) < 1:
            raise PipelineSplitError(f"parallel.pp_split = {split} must give {n_stages} positive counts summing to "
                                     f"the model's {n_blocks} blocks")
        return list(split)
    if n_blocks < n_stages:
        raise PipelineSplitError(f"the model has {n_blocks} blocks, fewer than the {n_stages} pipeline stages; "
                                 "lower parallel.pp / pp_virtual_stages or use more layers")
    base, extra = divmod(n_blocks, n_stages)
    return [base + (1 if s < extra else 0) for s in range(n_stages)]


class GPTStage(nn.Module):
    """Consecutive blocks of a GPT, with the embeddings if first and the head if last.

    Input: token ids (first stage) or the residual stream; output: the residual stream,
    or logits (last stage).
    """

    def __init__(self, gpt: nn.Module, block_ids: list[int], first: bool, last: bool) -> None:
        super().__init__()
        self.context_length = gpt.shape.context_length
        self.tok_emb = gpt.tok_emb if first else None
        self.pos_emb = gpt.pos_emb if first else None
        self.drop = gpt.drop if first else None
        self.blocks = nn.ModuleDict({str(i): gpt.blocks[i] for i in block_ids})
        self.ln_f = gpt.ln_f if last else None
        self.lm_head = gpt.lm_head if last else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.tok_emb is not None:
            positions = torch.arange(x.shape[1], device=x.device)
            x = self.drop(self.tok_emb(x) + self.pos_emb(positions))
        for block in self.blocks.values():
            x = block(x)
        if self.lm_head is not None:
            x = self.lm_head(self.ln_f(x))
        return x


class PipelinedModel(nn.Module):
    """This rank's stages of a pipelined model, under the full model's parameter names.

    Never called itself: ``stages`` (index, module) are what the schedule runs; after
    they are parallelized, ``stages`` holds the wrapped modules (DDP/FSDP) to run, while
    this container keeps the plain ones for the optimizer and checkpoints.
    """

    def __init__(self, parts: list[tuple[int, GPTStage]], n_stages: int) -> None:
        super().__init__()
        self.n_stages = n_stages
        for _, part in parts:
            for name in ("tok_emb", "pos_emb", "drop", "ln_f", "lm_head"):
                if getattr(part, name) is not None:
                    setattr(self, name, getattr(part, name))
        self.blocks = nn.ModuleDict({k: v for _, part in parts for k, v in part.blocks.items()})
        self.stages: list[tuple[int, nn.Module]] = list(parts)  # plain list: not registered twice
        self._tied_first = self._tied_last = self._tied_any = False

    @property
    def has_first(self) -> bool:
        return any(index == 0 for index, _ in self.stages)

    @property
    def has_last(self) -> bool:
        return any(index == self.n_stages - 1 for index, _ in self.stages)

    def wrap_stages(self, wrap: Callable[[nn.Module], nn.Module]) -> None:
        """Parallelize each stage module in place (``wrap`` may return a wrapper such as DDP)."""
        self.stages = [(index, wrap(module)) for index, module in self.stages]

    def forward(self, *args: object) -> torch.Tensor:
        raise RuntimeError("a PipelinedModel is run through its pipeline schedule, not called")

    def tied_parameters(self) -> list[nn.Parameter]:
        """This rank's copies of the tied embedding/head weight (empty when untied).
        Looked up by name: data parallelism may have replaced the parameter objects."""
        names = [n for n, flag in (("tok_emb", self._tied_first), ("lm_head", self._tied_last)) if flag]
        return [getattr(self, name).weight for name in names]

    def norm_duplicates(self) -> list[nn.Parameter]:
        """Parameters whose gradient is counted elsewhere in the global norm (the head copy)."""
        return [self.lm_head.weight] if self._tied_last else []

    @property
    def tied(self) -> bool:
        """Whether the full model ties its embedding and head (on any of the pipeline ranks)."""
        return self._tied_any


def split_model(model: nn.Module, pp: int, pp_rank: int, virtual_stages: int = 1,
                split: list[int] | None = None) -> PipelinedModel:
    """Keep only rank ``pp_rank``'s stages of ``model`` (a GPT with ``tok_emb``, ``blocks``,
    ``ln_f``, ``lm_head``); the other blocks are dropped, their memory freed."""
    for name in ("tok_emb", "pos_emb", "blocks", "ln_f", "lm_head"):
        if not hasattr(model, name):
            raise PipelineSplitError(f"parallel.pp > 1 needs a GPT-like model with tok_emb, pos_emb, blocks, ln_f "
                                     f"and lm_head; {type(model).__name__} has no '{name}'")
    n_stages = pp * virtual_stages
    sizes = stage_sizes(len(model.blocks), n_stages, split)
    starts = [sum(sizes[:s]) for s in range(n_stages)]
    tied = model.lm_head.weight is model.tok_emb.weight
    if tied:
        # Separate copies on the first and last stage; kept equal by sync_tied_grads.
        model.lm_head.weight = nn.Parameter(model.tok_emb.weight.detach().clone())
    own = [s for s in range(n_stages) if s % pp == pp_rank]
    parts = [(s, GPTStage(model, list(range(starts[s], starts[s] + sizes[s])), s == 0, s == n_stages - 1))
             for s in own]
    pipelined = PipelinedModel(parts, n_stages)
    if tied:
        pipelined._tied_any = True
        pipelined._tied_first, pipelined._tied_last = pipelined.has_first, pipelined.has_last
    return pipelined


def tied_weight_group(mesh: DeviceMesh) -> dist.ProcessGroup | None:
    """The group of the first and last pipeline rank that share this rank's data-parallel
    and tensor-parallel coordinates (they hold the tied weight's two copies). Every rank
    must call this (groups are created collectively); others get their pair's group too."""
    ranks = mesh.mesh  # (pp, dp_replicate, dp_shard, tp) global ranks
    if ranks.shape[0] == 2:
        return mesh["pp"].get_group()
    mine = None
    for first, last in zip(ranks[0].flatten().tolist(), ranks[-1].flatten().tolist()):
        group = dist.new_group([first, last])
        if dist.get_rank() in (first, last):
            mine = group
    return mine


def sync_tied_grads(model: PipelinedModel, group: dist.ProcessGroup | None) -> None:
    """Sum the gradients of the tied weight's two copies (first and last stage), so both
    apply the same update. Sharded copies (TP, FSDP) hold matching shards on both ranks."""
    copies = [p for p in model.tied_parameters() if p.grad is not None]
    if not copies or group is None:
        return
    for param in copies:
        if isinstance(param.grad, DTensor) and param.grad.placements != param.placements:
            # An embedding's backward may leave its vocabulary-split weight's gradient
            # replicated; both copies must hold the same shard before they are summed.
            param.grad = param.grad.redistribute(param.device_mesh, param.placements)
        grad = _local(param.grad)
        dist.all_reduce(grad, group=group)


def _local(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.to_local() if isinstance(tensor, DTensor) else tensor
