"""Pipeline parallelism: cut a model into stages that keep the full model's parameter names.

Stage ``s`` of ``S`` holds consecutive repeated blocks (balanced by count, or as given by
``parallel.pp_split``), plus what runs before the first block on the first stage
(embeddings) and what runs after the last block on the last (final norm, head). Two ways
to cut, chosen by the model:

- meshyard's GPT (``tok_emb``, ``pos_emb``, ``blocks``, ``ln_f``, ``lm_head``) is cut by
  hand into ``GPTStage`` modules, which also take tensor parallelism;
- any other model is traced whole and cut before its blocks (``pipeline_trace``), so its
  own forward is kept; the blocks are the layers a Hugging Face model's
  ``config.base_model_pp_plan`` names (``hf_plans``), else the units FSDP shards
  (``units.find_blocks``). What one stage sends the next is made contiguous (gloo and
  NCCL send nothing else).

Either way parameters keep their names (``blocks.5`` stays ``blocks.5``;
``transformer.h.5`` stays ``transformer.h.5``), so a checkpoint written under pipelining
loads under any other layout and back.

Rank ``r`` of the ``pp`` group holds stages ``r, r + pp, r + 2 pp, ...`` (one stage for
GPipe and 1F1B; ``pp_virtual_stages`` for the interleaved schedules). Its stages are
gathered in one ``PipelinedModel`` whose own parameter names are those of the full
model; the trainer, optimizer and checkpoints see that container, while the pipeline
schedule drives the stage modules (each parallelized on its own: TP, AC, FSDP/DDP).

A weight the first and the last stage share (a tied embedding and head) lives on both:
each stage holds its own copy, and ``sync_tied_grads`` sums the two copies' gradients
over the pipeline group after backward, so both take identical optimizer steps and stay
equal. Other stages may not share weights (``pp_problems`` says so before a run starts).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Sequence

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.pipelining import PipelineStage
from torch.distributed.pipelining._IR import PipeInfo
from torch.distributed.pipelining.stage import _PipelineStageBase, build_stage
from torch.distributed.tensor import DTensor

from meshyard.config.sections import ParallelConfig
from meshyard.models.local_part import local_part
from meshyard.parallel.data_parallel import unwrap
from meshyard.parallel.hf_plans import hf_layer_list
from meshyard.parallel.pipeline_trace import PREFIX, PipelineTraceError, trace_stages
from meshyard.parallel.units import find_blocks

_GPT_PARTS = ("tok_emb", "pos_emb", "blocks", "ln_f", "lm_head")


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


@dataclass(frozen=True)
class StageTies:
    """Weights the model shares between stages (a tied embedding and head), as this rank
    holds them: ``names`` its copies, ``duplicates`` those whose gradient another stage
    already counts in the global norm, ``anywhere`` whether any stage holds such a copy."""

    names: tuple[str, ...] = ()
    duplicates: tuple[str, ...] = ()
    anywhere: bool = False


def stage_ties(groups: list[set[str]], held: list[set[str]], own: Sequence[int]) -> StageTies:
    """The ties ``groups`` (``tied_groups`` of the whole model) across stages holding the
    parameter names ``held`` (all stages), for the rank holding stages ``own``. The
    copy on the first stage that holds one counts in the norm."""
    names: list[str] = []
    duplicates: list[str] = []
    anywhere = False
    for group in groups:
        stages = [index for index, names_of in enumerate(held) if names_of & group]
        if len(stages) < 2:
            continue
        anywhere = True
        for index in own:
            mine = sorted(held[index] & group)
            names += mine
            duplicates += mine if index in stages[1:] else []
    return StageTies(tuple(names), tuple(duplicates), anywhere)


def tied_groups(model: nn.Module) -> list[set[str]]:
    """Names that share one parameter (a tied embedding and head), one set per parameter."""
    by_tensor: dict[int, set[str]] = {}
    for name, param in model.named_parameters(remove_duplicate=False):
        by_tensor.setdefault(id(param), set()).add(name)
    return [names for names in by_tensor.values() if len(names) > 1]


class PipelinedModel(nn.Module):
    """This rank's stages of a pipelined model, under the full model's parameter names.

    Never called itself: ``stages`` (index, module) are what the schedule runs; after
    they are parallelized, ``stages`` holds the wrapped modules (DDP/FSDP) to run, while
    this container registers their plain submodules, found below each stage at ``root``
    ('' for a GPT stage, the tracing wrapper's prefix for a traced one), under the full
    model's names for the optimizer and checkpoints. A traced pipeline also carries the
    pipeline graph (``pipe_info``) its torch stages are built from.
    """

    def __init__(self, parts: list[tuple[int, nn.Module]], n_stages: int, root: str = "",
                 ties: StageTies | None = None, pipe_info: PipeInfo | None = None) -> None:
        super().__init__()
        self.n_stages = n_stages
        self.stages: list[tuple[int, nn.Module]] = list(parts)  # plain list: not registered twice
        self._plain = [module for _, module in parts]
        self._root = root
        self._ties = ties or StageTies()
        self._pipe_info = pipe_info
        self.gather()

    @property
    def has_first(self) -> bool:
        return any(index == 0 for index, _ in self.stages)

    @property
    def has_last(self) -> bool:
        return any(index == self.n_stages - 1 for index, _ in self.stages)

    def gather(self) -> None:
        """Register the stages' submodules under the full model's names. Called again after
        parallelizing or materializing, which may replace tensors the root holds itself."""
        self._modules.clear()
        self._parameters.clear()
        self._buffers.clear()
        self._non_persistent_buffers_set.clear()
        _graft(self, [unwrap(module).get_submodule(self._root) for module in self._plain])

    def wrap_stages(self, wrap: Callable[[nn.Module], nn.Module]) -> None:
        """Parallelize each stage module in place (``wrap`` may return a wrapper such as DDP)."""
        self.stages = [(index, wrap(module)) for index, module in self.stages]
        self.gather()

    def pipeline_stage(self, index: int, module: nn.Module, device: torch.device,
                       group: dist.ProcessGroup) -> _PipelineStageBase:
        """The torch pipeline stage that runs ``module`` as stage ``index``: a traced stage
        learns from the pipeline graph which stages it receives from and sends to."""
        if self._pipe_info is None:
            stage = PipelineStage(module, index, self.n_stages, device, group=group)
        else:
            stage = build_stage(module, index, self._pipe_info, device, group)
        send_contiguous(stage)
        return stage

    def train(self, mode: bool = True) -> "PipelinedModel":
        super().train(mode)
        for _, module in self.stages:
            module.train(mode)  # the stage roots, which are not registered here
        return self

    def forward(self, *args: object) -> torch.Tensor:
        raise RuntimeError("a PipelinedModel is run through its pipeline schedule, not called")

    def tied_parameters(self) -> list[nn.Parameter]:
        """This rank's copies of weights shared between stages (empty when untied).
        Looked up by name: data parallelism may have replaced the parameter objects."""
        return [self.get_parameter(name) for name in self._ties.names]

    def norm_duplicates(self) -> list[nn.Parameter]:
        """Parameters whose gradient is counted elsewhere in the global norm (the head copy)."""
        return [self.get_parameter(name) for name in self._ties.duplicates]

    @property
    def tied(self) -> bool:
        """Whether the full model shares a weight between stages (on any of the pipeline ranks)."""
        return self._ties.anywhere


def send_contiguous(stage: _PipelineStageBase) -> None:
    """Make every tensor ``stage`` sends (its outputs forward, its inputs' gradients
    backward) contiguous. torch sends them as the stage's forward left them, and gloo
    and NCCL refuse a view such as the transposed hidden states a Hugging Face OPT layer
    returns. Wraps the stage's two send-op builders, which every schedule calls."""
    def contiguous(build: Callable[[int], list[dist.P2POp]]) -> Callable[[int], list[dist.P2POp]]:
        def ops(chunk_id: int) -> list[dist.P2POp]:
            built = build(chunk_id)
            for op in built:
                if not op.tensor.is_contiguous():
                    op.tensor = op.tensor.contiguous()
            return built
        return ops

    stage.get_fwd_send_ops = contiguous(stage.get_fwd_send_ops)
    stage.get_bwd_send_ops = contiguous(stage.get_bwd_send_ops)


def _graft(target: nn.Module, sources: list[nn.Module]) -> None:
    """Register the tensors and children of ``sources`` on ``target``. A child name held by
    one source registers that very module (its hooks and wrappers stay); one held by
    several (``blocks`` of two stages on one rank) gets a new container holding theirs."""
    children: dict[str, list[nn.Module]] = {}
    for source in sources:
        for name, param in source._parameters.items():
            if param is not None:
                target.register_parameter(name, param)
        for name, buffer in source._buffers.items():
            if buffer is not None:
                target.register_buffer(name, buffer, persistent=name not in source._non_persistent_buffers_set)
        for name, child in source._modules.items():
            if child is not None:
                children.setdefault(name, []).append(child)
    for name, group in children.items():
        if len(group) == 1:
            target.add_module(name, group[0])
        else:
            container = nn.Module()
            _graft(container, group)
            target.add_module(name, container)


def _cut_by_hand(model: nn.Module) -> bool:
    """meshyard's GPT and models shaped like it: embeddings, ``blocks``, final norm, head."""
    return all(hasattr(model, name) for name in _GPT_PARTS)


def split_model(model: nn.Module, pp: int, pp_rank: int, virtual_stages: int = 1, split: list[int] | None = None,
                unit_names: Sequence[str] = (), example_tokens: torch.Tensor | None = None,
                device: torch.device | None = None) -> PipelinedModel:
    """Keep only rank ``pp_rank``'s stages of ``model``; the other blocks are dropped, their
    memory freed. A GPT is cut by hand; another model is traced on ``example_tokens``
    (token ids shaped as one pipeline micro-batch) and cut before its blocks (the
    modules of the classes ``unit_names``, else its repeated block class), its stages
    made to run on ``device`` (default: that of ``example_tokens``)."""
    n_stages = pp * virtual_stages
    own = [s for s in range(n_stages) if s % pp == pp_rank]
    if _cut_by_hand(model):
        return _split_gpt(model, n_stages, own, split)
    if example_tokens is None:
        raise PipelineSplitError(f"pipelining {type(model).__name__} traces its forward: pass example_tokens")
    cut_before = stage_starts(model, n_stages, split, unit_names)
    traced = trace_stages(model, cut_before, own, example_tokens, device or example_tokens.device)
    return PipelinedModel([(s, traced.modules[s]) for s in own], n_stages, PREFIX,
                          stage_ties(tied_groups(model), traced.held, own), traced.info)


def example_micro_batch(micro_batch: int, microbatches: int, seq_len: int) -> torch.Tensor:
    """Token ids shaped as one pipeline micro-batch (a train micro-batch cut ``microbatches``
    ways): the shapes a traced model's stages are fixed to."""
    return torch.zeros(max(1, micro_batch // microbatches), seq_len, dtype=torch.long)


def stage_starts(model: nn.Module, n_stages: int, split: list[int] | None,
                 unit_names: Sequence[str] = ()) -> list[str]:
    """Qualified names of the first block of every stage after the first (where a traced
    model is cut): blocks balanced by count, or as ``split`` says. The blocks are the
    modules of the classes ``unit_names``, else the layers a Hugging Face model's
    ``config.base_model_pp_plan`` names, else its repeated block class."""
    layers = None if unit_names else hf_layer_list(model)
    if layers is not None:
        blocks = [f"{layers}.{index}" for index in range(len(model.get_submodule(layers)))]
    else:
        names = {id(module): name for name, module in model.named_modules()}
        blocks = [names[id(block)] for block in find_blocks(model, unit_names)]
    if not blocks:
        raise PipelineSplitError(
            f"parallel.pp cuts a model before its repeated blocks, and {type(model).__name__} has none (no module "
            "class that holds layers occurs more than once); name the class of its blocks with "
            "parallel.fsdp_units = [\"ClassName\"], or train it without pipeline parallelism")
    sizes = stage_sizes(len(blocks), n_stages, split)
    return [blocks[sum(sizes[:s])] for s in range(1, n_stages)]


def _split_gpt(model: nn.Module, n_stages: int, own: list[int], split: list[int] | None) -> PipelinedModel:
    """GPT stages by hand. Tied embeddings get separate copies on the first and the last
    stage, kept equal by ``sync_tied_grads``."""
    sizes = stage_sizes(len(model.blocks), n_stages, split)
    starts = [sum(sizes[:s]) for s in range(n_stages)]
    groups = tied_groups(model)
    if model.lm_head.weight is model.tok_emb.weight:
        model.lm_head.weight = nn.Parameter(model.tok_emb.weight.detach().clone())
    parts = [GPTStage(model, list(range(starts[s], starts[s] + sizes[s])), s == 0, s == n_stages - 1)
             for s in range(n_stages)]  # light: they hold the model's modules, nothing copied
    held = [{name for name, _ in part.named_parameters()} for part in parts]
    return PipelinedModel([(s, parts[s]) for s in own], n_stages, "", stage_ties(groups, held, own))


def pp_problems(model: nn.Module, cfg: ParallelConfig, pp: int, example_tokens: torch.Tensor) -> list[str]:
    """Why ``model`` (built on the meta device or anywhere) cannot be cut into ``pp`` x
    ``cfg.pp_virtual_stages`` stages: one line per problem naming the fix, [] when it can.
    A model that is traced is traced here once, on ``example_tokens`` (token ids, ideally
    shaped as one pipeline micro-batch), exactly as each rank will."""
    n_stages = pp * max(1, cfg.pp_virtual_stages)
    if _cut_by_hand(model):
        try:
            stage_sizes(len(model.blocks), n_stages, cfg.pp_split)
        except PipelineSplitError as problem:
            return [str(problem)]
        return []
    try:
        cut_before = stage_starts(model, n_stages, cfg.pp_split, cfg.fsdp_units)
        traced = trace_stages(model, cut_before, (), example_tokens, example_tokens.device)
    except (PipelineSplitError, PipelineTraceError) as problem:
        return [str(problem)]
    problems = []  # tensor parallelism inside traced stages is refused by tp_plans.tp_problems
    for group in tied_groups(model):
        stages = [index for index, names in enumerate(traced.held) if names & group]
        if len(stages) > 1 and set(stages) != {0, n_stages - 1}:
            problems.append(f"parallel.pp: {type(model).__name__} shares one weight ({', '.join(sorted(group))}) "
                            f"between pipeline stages {stages}; only the first and the last stage may share one "
                            "(a tied embedding and head). Change parallel.pp_split so that its users share a "
                            "stage, or train it without pipeline parallelism")
    own_names = {*dir(PipelinedModel), "n_stages", "stages"}
    clashes = sorted({name.split(".")[0] for names in traced.held for name in names} & own_names)
    if clashes:
        problems.append(f"parallel.pp: {type(model).__name__} has parts named {clashes}, names the pipeline's "
                        "container uses itself; rename them, or train it without pipeline parallelism")
    return problems


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
    """Sum the gradients of the tied weight's copies (first and last stage), so all
    apply the same update. Sharded copies (TP, FSDP) hold matching shards on both ranks."""
    copies = [p for p in model.tied_parameters() if p.grad is not None]
    if not copies or group is None:
        return
    for param in copies:
        if isinstance(param.grad, DTensor) and param.grad.placements != param.placements:
            # An embedding's backward may leave its vocabulary-split weight's gradient
            # replicated; both copies must hold the same shard before they are summed.
            param.grad = param.grad.redistribute(param.device_mesh, param.placements)
        grad = local_part(param.grad)
        dist.all_reduce(grad, group=group)
