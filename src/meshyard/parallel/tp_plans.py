"""Which tensor-parallel plan a model gets, and what in it cannot be split over tp ranks.

Decided on the model's structure alone (module names, types, shapes and a few integer
attributes), so it works on a model built on the meta device: ``meshyard.validate``
asks ``tp_problems`` before any worker starts, and ``apply_tp`` applies the same plan on
every rank. First match wins:

1. the model's own ``tensor_parallel_plan(tp_mesh)``, applied as it is (not inspected),
   and meshyard's GPT, which has its own (``tensor_parallel``);
2. ``parallel.tp_plan`` from the config: module-name patterns (``fnmatch`` globs over
   qualified names, e.g. ``"transformer.h.*.attn.c_attn"``; a module takes the first
   pattern it matches) mapped to a style;
3. the plan a Hugging Face model publishes (``config.base_model_tp_plan`` and its
   class's head plan, read by ``hf_plans``), its styles mapped to meshyard's;
4. built-in plans, recognised by structure wherever they sit: GPT-2-style attention (fused ``c_attn`` + ``c_proj``)
   and MLPs (``c_fc`` + ``c_proj``), nn.Linear or Hugging Face's Conv1D,
   Llama/Mistral-style attention (``q_proj``, ``k_proj``, ``v_proj`` + ``o_proj``) and
   MLPs (``gate_proj``, ``up_proj`` + ``down_proj``), OPT/BART-style attention (``q_proj``,
   ``k_proj``, ``v_proj`` + ``out_proj``) and MLPs (``fc1`` + ``fc2``).
Plans 3 and 4 split the token embedding and output head by vocabulary when tp divides
it, else replicate them.

Styles. ``colwise`` splits a module's output features: each rank keeps its slice, which
the ``rowwise`` module beside it (same parent) takes as input and sums back to the full
width. A colwise projection k times wider than its rowwise sibling's input is fused
(q|k|v: 3, gate|up: 2): each of its k blocks is split on its own, so a rank keeps its
heads of q, k and v together. A colwise module with no rowwise sibling (the output
head) returns its full output, or vocabulary-split logits under loss parallel. On an
nn.Embedding ``rowwise`` splits the vocabulary, ``colwise`` the width; both return the
full embedding. ``replicate``: every rank holds the whole module; every module the plan
does not name is replicated. ``sequence_parallel`` is accepted and runs as
``replicate``: these plans do not cut activations along the sequence (the rank log says so).
A module holding parameters of its own around modules the plan splits (a learned
position table on the root of the model) is refused: replicated, it would compute on
DTensors that its split submodules' plain outputs cannot mix with.

After splitting, attention modules get per-rank head counts and widths (the head rule,
``tp_modules``). Head, key/value-head, width and vocabulary counts a plan splits must be
divisible by tp; ``tp_problems`` names each that is not, and what else cannot be done.
"""

from __future__ import annotations

from dataclasses import dataclass
from fnmatch import fnmatchcase

from torch import nn

from meshyard.config.sections import ParallelConfig
from meshyard.parallel.hf_plans import hf_splits
from meshyard.parallel.tp_modules import (HEAD_COUNTS, HEAD_WIDTHS, KV_HEAD_COUNTS, Split, TPPlan, WIDTHS, first_int,
                                          holds_heads, in_features, input_embedding_name, int_attribute,
                                          is_projection, out_features, output_head_name, pattern_of, tied_groups)
from meshyard.parallel.tp_trial import trial_problems


class TPPlanError(ValueError):
    """A model that tensor parallelism cannot split as asked."""


@dataclass(frozen=True)
class _Pattern:
    """A built-in attention or MLP shape: colwise children (the first is the widest,
    ``parts`` times the rowwise input), the rowwise child, children that may be absent."""

    family: str
    colwise: tuple[str, ...]
    rowwise: str
    parts: int = 1
    optional: tuple[str, ...] = ()
    attention: bool = False


_BUILTIN = (
    _Pattern("GPT-2", ("c_attn",), "c_proj", parts=3, attention=True),
    _Pattern("GPT-2", ("c_fc",), "c_proj"),
    _Pattern("Llama", ("q_proj", "k_proj", "v_proj"), "o_proj", attention=True),
    _Pattern("Llama", ("up_proj", "gate_proj"), "down_proj", optional=("gate_proj",)),
    _Pattern("OPT/BART", ("q_proj", "k_proj", "v_proj"), "out_proj", attention=True),
    _Pattern("OPT/BART", ("fc1",), "fc2"),
)


# --- what the three sources give -----------------------------------------------------------
def is_meshyard_gpt(model: nn.Module) -> bool:
    """meshyard's own GPT or a pipeline stage of it (its blocks are meshyard's)."""
    from meshyard.models.gpt import Block

    blocks = getattr(model, "blocks", None)
    return isinstance(blocks, (nn.ModuleList, nn.ModuleDict)) and len(blocks) > 0 and all(
        isinstance(block, Block) for block in (blocks.values() if isinstance(blocks, nn.ModuleDict) else blocks))


def resolve_plan(model: nn.Module, patterns: dict[str, str], tp: int) -> TPPlan | None:
    """The config's plan when ``patterns`` is not empty, else the plan a Hugging Face
    model publishes, else the built-in plan the model's structure matches; None when
    there is none. (Not asked for models with a plan of their own: ``tensor_parallel_plan``
    or meshyard's GPT.)"""
    if patterns:
        return config_plan(model, patterns)
    return hf_plan(model, tp) or builtin_plan(model, tp)


def hf_plan(model: nn.Module, tp: int) -> TPPlan | None:
    """A Hugging Face model's own plan (``hf_plans``): its styles as splits, the attention
    modules the head rule adjusts (parents of colwise projections that hold heads), the
    vocabulary split as in the built-in plans; None when it publishes none."""
    found = hf_splits(model)
    if found is None:
        return None
    plan = TPPlan(found.source, notes=found.notes, problems=found.problems)
    head_name = output_head_name(model)
    head = model.get_submodule(head_name) if head_name is not None else None
    vocabulary = {head_name, input_embedding_name(model, head)} if isinstance(head, nn.Linear) else set()
    plan.splits = {name: split for name, split in found.splits.items() if name not in vocabulary}
    for name, split in plan.splits.items():
        parent = name.rpartition(".")[0]
        if split.style == "colwise" and not split.gather and parent not in plan.attention and holds_heads(
                model.get_submodule(parent)):
            plan.attention.append(parent)
    _split_vocabulary(model, plan, tp)
    return plan


def config_plan(model: nn.Module, patterns: dict[str, str]) -> TPPlan:
    """``parallel.tp_plan`` expanded over the model's module names."""
    plan = TPPlan("the [parallel.tp_plan] of the config")
    styles: dict[str, str] = {}
    used: set[str] = set()
    for name, _ in model.named_modules():
        pattern = next((p for p in patterns if name and fnmatchcase(name, p)), None)
        if pattern is not None:
            styles[name] = "replicate" if patterns[pattern] == "sequence_parallel" else patterns[pattern]
            used.add(pattern)
    examples = ", ".join(repr(n) for n, _ in list(model.named_modules())[1:4])
    plan.problems.extend(f"parallel.tp_plan: '{p}' matches no module of {type(model).__name__} (its module names "
                         f"look like {examples}); fix or remove it" for p in patterns if p not in used)
    if "sequence_parallel" in patterns.values():
        plan.notes.append("'sequence_parallel' entries run as 'replicate': config plans do not split activations "
                          "along the sequence")
    plan.splits, plan.attention = _complete(model, styles, plan.problems)
    head = output_head_name(model)
    plan.output_head = head if head is not None and plan.splits.get(head, Split("")).gather else None
    return plan


def builtin_plan(model: nn.Module, tp: int) -> TPPlan | None:
    """GPT-2-style and Llama-style attention and MLPs found in ``model``, with the
    vocabulary split when tp divides it; None when none is found."""
    plan = TPPlan("the built-in plan")
    families: list[str] = []
    for parent_name, parent in model.named_modules():
        for pattern in _BUILTIN:
            if _matches(parent, pattern):
                prefix = f"{parent_name}." if parent_name else ""
                present = [c for c in pattern.colwise if hasattr(parent, c)]
                plan.splits.update({f"{prefix}{c}": Split("colwise", pattern.parts if c == present[0] else 1)
                                    for c in present})
                plan.splits[f"{prefix}{pattern.rowwise}"] = Split("rowwise")
                if pattern.attention:
                    plan.attention.append(parent_name)
                kind = f"{pattern.family}-style {'attention' if pattern.attention else 'MLP'}"
                families += [kind] if kind not in families else []
                break
    if not plan.splits:
        return None
    plan.source = f"the built-in plan ({', '.join(families)})"
    _split_vocabulary(model, plan, tp)
    return plan


def _matches(parent: nn.Module, pattern: _Pattern) -> bool:
    """``parent`` holds the pattern's projections, shaped as its pairing needs."""
    names = [c for c in pattern.colwise if c not in pattern.optional or hasattr(parent, c)]
    modules = [getattr(parent, n, None) for n in (*names, pattern.rowwise)]
    if not all(is_projection(m) for m in modules):
        return False
    width = in_features(modules[-1])
    outs = [out_features(m) for m in modules[:-1]]
    return outs[0] == pattern.parts * width and all(out <= outs[0] // pattern.parts for out in outs[1:])


def _split_vocabulary(model: nn.Module, plan: TPPlan, tp: int) -> None:
    """Output head colwise and its token embedding rowwise (both by vocabulary) when tp
    divides the vocabulary; else both stay replicated, as the note says."""
    head_name = output_head_name(model)
    head = model.get_submodule(head_name) if head_name is not None else None
    if not isinstance(head, nn.Linear):
        return
    if head.out_features % tp:
        plan.notes.append(f"the vocabulary ({head.out_features}) is not divisible by parallel.tp = {tp}: the "
                          "token embedding and the output head are replicated on every rank")
        return
    plan.splits[head_name] = Split("colwise", gather=True)
    plan.output_head = head_name
    embedding = input_embedding_name(model, head)
    if embedding is not None:
        plan.splits[embedding] = Split("rowwise")


# --- completing a plan: fused projections, gathered outputs, attention modules ------------
def _complete(model: nn.Module, styles: dict[str, str],
              problems: list[str]) -> tuple[dict[str, Split], list[str]]:
    """Splits for ``styles`` (module name -> style): each colwise module's fused blocks
    and whether it gathers; the attention modules the head rule adjusts."""
    splits: dict[str, Split] = {}
    attention: list[str] = []
    for name, style in styles.items():
        if style != "colwise":
            splits[name] = Split(style)
            continue
        parent_name = name.rpartition(".")[0]
        sibling = next((n for n, s in styles.items() if s == "rowwise" and n.rpartition(".")[0] == parent_name), None)
        if sibling is None:
            splits[name] = Split("colwise", gather=True)
            continue
        parent = model.get_submodule(parent_name)
        is_attention = holds_heads(parent)
        if is_attention and parent_name not in attention:
            attention.append(parent_name)
        parts = _fused_parts(name, model.get_submodule(name), sibling, model.get_submodule(sibling), parent,
                             problems)
        splits[name] = Split("colwise", parts)
    return splits, attention


def _fused_parts(name: str, module: nn.Module, sibling_name: str, sibling: nn.Module, parent: nn.Module,
                 problems: list[str]) -> int:
    """Equal blocks of a colwise projection: its outputs over its rowwise sibling's inputs."""
    out, width = out_features(module), in_features(sibling)
    if out is None or width is None or out <= width:
        return 1
    fix = "give the model a tensor_parallel_plan(tp_mesh) method"
    if out % width:
        problems.append(f"{pattern_of(name)}: its {out} outputs are not a whole multiple of the {width} inputs of "
                        f"{sibling_name.rpartition('.')[2]}, so meshyard cannot tell how its fused outputs divide "
                        f"between heads or units; {fix}")
        return 1
    parts = out // width
    heads = first_int(parent, HEAD_COUNTS[:4])
    kv_heads = first_int(parent, KV_HEAD_COUNTS)
    if holds_heads(parent) and (parts != 3 or (kv_heads is not None and kv_heads != heads)):
        problems.append(f"{pattern_of(name)}: a fused attention projection {parts} times wider than the attention "
                        "output is read as q|k|v only with 3 equal blocks (as many key/value heads as query heads); "
                        f"{fix}")
    return parts


# --- checks ---------------------------------------------------------------------------------
def tp_problems(model: nn.Module, cfg: ParallelConfig, tp: int) -> list[str]:
    """Why ``model`` cannot run with ``tp`` tensor-parallel ranks under ``cfg``, one line
    each naming the fix; [] when it can (or tp is 1). Works on the meta device, where a
    plan without problems is also tried once (``tp_trial``)."""
    if tp <= 1:
        return []
    if is_meshyard_gpt(model):
        return gpt_problems(model, tp)
    if cfg.pp > 1:
        return [f"parallel.tp = {tp} with parallel.pp = {cfg.pp} runs only meshyard's GPT: the pipeline stages of "
                f"other models are traced graphs whose head counts are fixed when traced; use tp or pp alone"]
    if hasattr(model, "tensor_parallel_plan"):
        return []  # the model's own plan: what it splits is its author's decision
    plan = resolve_plan(model, cfg.tp_plan, tp)
    if plan is None:
        return no_plan_problems(model, tp)
    return plan_problems(model, plan, tp) or trial_problems(model, plan, tp)


def no_plan_problems(model: nn.Module, tp: int) -> list[str]:
    """The message for a model no plan applies to: the three ways to provide one."""
    return [f"parallel.tp = {tp}: meshyard has no tensor-parallel plan for {type(model).__name__} (it has no "
            "Hugging Face plan in its config, no GPT-2-style c_attn/c_proj/c_fc, Llama-style "
            "q_proj/k_proj/v_proj/o_proj, gate_proj/up_proj/down_proj or OPT-style out_proj, fc1/fc2 modules); "
            "give the model a method tensor_parallel_plan(tp_mesh) returning "
            "{module name: ParallelStyle}, or add a [parallel.tp_plan] table mapping module-name patterns to "
            "'colwise', 'rowwise', 'sequence_parallel' or 'replicate' (e.g. \"blocks.*.attn.qkv\" = \"colwise\"), "
            "or set parallel.tp = 1"]


def gpt_problems(model: nn.Module, tp: int) -> list[str]:
    """meshyard's GPT: heads, width and vocabulary must divide by tp."""
    shape = getattr(model, "shape", None)
    if shape is None:
        return []
    return [f"{name} = {value} is not divisible by parallel.tp = {tp}"
            for name, value in (("model.n_head", shape.n_head), ("model.d_model", shape.d_model),
                                ("vocab_size", shape.vocab_size)) if value % tp]


def plan_problems(model: nn.Module, plan: TPPlan, tp: int) -> list[str]:
    """What in ``plan`` cannot be split over ``tp`` ranks (repeated blocks said once);
    where an attention module's heads do not divide, its projections are not named again."""
    problems = list(plan.problems)
    failed_heads: set[str] = set()
    for name in plan.attention:
        found = _head_problems(model, name, plan, tp)
        failed_heads.update([name] if found else [])
        problems += found
    indivisible: dict[str, list[str]] = {}  # parent -> "child (n what)", said in one message per parent
    for name, split in plan.splits.items():
        parent, _, child = name.rpartition(".")
        if parent in failed_heads:
            continue
        problem = _split_problem(name, model.get_submodule(name), split, tp)
        if problem is not None and problem.startswith("("):
            indivisible.setdefault(pattern_of(parent), []).append(f"{child} {problem}")
        elif problem is not None:
            problems.append(problem)
    problems += [f"{parent + ': ' if parent else ''}{', '.join(dict.fromkeys(found))} not divisible by "
                 f"parallel.tp = {tp}; use a tp that divides them" for parent, found in indivisible.items()]
    problems += _tie_problems(model, plan) + _own_parameter_problems(model, plan)
    return list(dict.fromkeys(problems))


def _split_problem(name: str, module: nn.Module, split: Split, tp: int) -> str | None:
    """A module a style cannot split; or, in parentheses, the count tp does not divide."""
    if split.style == "replicate":
        return None
    if not is_projection(module) and not isinstance(module, nn.Embedding):
        return (f"{pattern_of(name)} is a {type(module).__name__}: '{split.style}' splits nn.Linear, nn.Embedding "
                "and Hugging Face Conv1D modules only; make it 'replicate' or split its projections")
    colwise = split.style == "colwise"
    count = out_features(module) if colwise else in_features(module)
    what = {(True, True): "embedding features", (True, False): "vocabulary entries",
            (False, True): "output features", (False, False): "input features"}[
        (isinstance(module, nn.Embedding), colwise)]
    if count % (split.parts * tp):
        return f"({count} {what}{f' in {split.parts} fused blocks' if split.parts > 1 else ''})"
    return None


def _head_problems(model: nn.Module, name: str, plan: TPPlan, tp: int) -> list[str]:
    """The head counts and widths the head rule divides; where the module names no head
    count, those of its Hugging Face config, else the heads each colwise projection
    holds (``head_dim`` wide each)."""
    module = model.get_submodule(name)
    if not holds_heads(module):
        return [f"{pattern_of(name)}: meshyard cannot tell how many heads it has (no attribute named as in "
                f"{', '.join(HEAD_COUNTS[:4])}, head_dim or head_size); give the model a tensor_parallel_plan(tp_mesh)"]
    counts = {attr: value for attr in (*HEAD_COUNTS, *WIDTHS) if (value := int_attribute(module, attr)) is not None}
    head_dim = first_int(module, HEAD_WIDTHS)
    if not counts:
        counts = _config_heads(module)
    if not counts and head_dim:
        projections = [(child, split) for child, split in plan.splits.items()
                       if split.style == "colwise" and child.rpartition(".")[0] == name]
        for index, (child, split) in enumerate(projections):
            label = "query heads" if index == 0 else "key/value heads"
            counts.setdefault(label, (out_features(model.get_submodule(child)) or 0) // (split.parts * head_dim))
    failed = [f"{attr} = {value}" for attr, value in counts.items() if value % tp]
    if not failed:
        return []
    return [f"{pattern_of(name)}: {', '.join(failed)} not divisible by parallel.tp = {tp}; each rank must hold "
            "whole heads (with grouped-query attention the key/value heads too): use a tp that divides them"]


def _config_heads(module: nn.Module) -> dict[str, int]:
    """The head counts of a Hugging Face attention module's ``config`` (GPT-NeoX's holds
    no count of its own, and its fused projection's width is not a count of heads)."""
    config = getattr(module, "config", None)
    heads = getattr(config, "num_attention_heads", None)
    if not isinstance(heads, int):
        return {}
    kv_heads = getattr(config, "num_key_value_heads", None)
    return {"query heads": heads, **({"key/value heads": kv_heads} if isinstance(kv_heads, int) else {})}


def _tie_problems(model: nn.Module, plan: TPPlan) -> list[str]:
    """Tied parameters (one tensor under several names) must be split alike."""
    problems = []
    for group in tied_groups(model):
        placements = {name: _shard_dim(model, name, plan) for name in group}
        if len(set(placements.values())) > 1:
            shown = " and ".join(f"{n} ({'replicated' if d is None else f'split on dim {d}'})"
                                 for n, d in placements.items())
            problems.append(f"{shown} are one tied tensor that the plan splits differently; split both alike (the "
                            "embedding 'rowwise' with its head 'colwise') or neither")
    return problems


def _own_parameter_problems(model: nn.Module, plan: TPPlan) -> list[str]:
    """A module replicated with parameters of its own computes on DTensors, which the
    plain outputs of modules split inside it cannot mix with."""
    split = [n for n, s in plan.splits.items() if s.style != "replicate"]
    problems = []
    for name, module in model.named_modules():
        own = [n for n, _ in module.named_parameters(recurse=False)]
        if own and name not in split and any(n.startswith(f"{name}.") or not name for n in split):
            where = pattern_of(name) or f"the model's root ({type(model).__name__})"
            problems.append(f"{where} holds parameters of its own ({', '.join(own)}) around modules the plan splits; "
                            "tensor parallelism replicates such parameters only in modules that hold no split "
                            f"module: move {own[0]} into a submodule of its own (e.g. an nn.Embedding), or give the "
                            "model a tensor_parallel_plan(tp_mesh)")
    return problems


def _shard_dim(model: nn.Module, param_name: str, plan: TPPlan) -> int | None:
    """The dimension ``plan`` splits a parameter along (None: replicated)."""
    owner, _, leaf = param_name.rpartition(".")
    split = plan.splits.get(owner)
    if split is None or split.style not in ("colwise", "rowwise"):
        return None
    module = model.get_submodule(owner)
    if leaf != "weight":
        return 0 if split.style == "colwise" and not isinstance(module, nn.Embedding) else None
    # nn.Linear weights are (out, in); Conv1D and nn.Embedding weights are (in, out).
    out_dim = 0 if isinstance(module, nn.Linear) else 1
    return out_dim if split.style == "colwise" else 1 - out_dim


