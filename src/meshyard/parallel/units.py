"""Which modules are sharded (FSDP) and checkpointed (activation checkpointing) one by one.

Units are chosen by module class, never by container: FSDP2 shards only modules with a
forward of their own (a ``ModuleList`` or ``ModuleDict`` has none), and users keep their
blocks anywhere: a ModuleList inside a ModuleDict (nanoGPT), ``model.layers`` (Llama),
an ``nn.Sequential``, behind wrappers. The class is the one the user names
(``parallel.fsdp_units``) or else the repeated block class found here:

- a block holds a submodule with parameters: leaf layers (Linear, Embedding, norms) are
  the contents of blocks, not blocks (the tied or vocabulary-sized head of a small model
  would otherwise outweigh all its blocks);
- it occurs more than once, and its instances hold parameters;
- of those, the class whose instances hold the most parameters, each counted once (tied
  weights, nested instances); ties go to the outermost (a wrapper around each block).

Class names are read through FSDP2's dynamic subclasses ('FSDPBlock' is a 'Block') and
through traced pipeline stages (torch.export's ``InterpreterModule`` keeps each module's
original class in its graph's ``nn_module_stack``), so a stage's blocks are found under
the same name as the whole model's.
"""

from __future__ import annotations

import difflib
from collections.abc import Iterable, Sequence

import torch
from torch import nn
from torch.distributed.fsdp import FSDPModule
from torch.export.unflatten import InterpreterModule

# Containers without a forward of their own: never a unit (FSDP2 refuses them).
_CONTAINERS = (nn.ModuleList, nn.ModuleDict, nn.ParameterList, nn.ParameterDict)


def class_name(module: nn.Module, name: str = "") -> str:
    """The class ``module`` was written as; '' for a container without a forward (and for
    a traced module whose class was not recorded: the containers of a traced stage).
    ``name`` is its qualified name in the model, under which a traced module's class is
    recorded."""
    if isinstance(module, _CONTAINERS):
        return ""
    cls = type(module)
    if isinstance(module, FSDPModule):
        # fully_shard swaps in a subclass named 'FSDP<cls>' that derives from (FSDPModule, cls).
        cls = next(base for base in cls.__mro__[1:] if not issubclass(base, FSDPModule))
    if isinstance(module, InterpreterModule):
        return _traced_class_name(module, name)
    return cls.__name__


def _traced_class_name(module: nn.Module, name: str) -> str:
    """The recorded class of a traced module: the ``nn_module_stack`` entry at its own path,
    on any node of its graph or of its submodules' graphs (a block whose forward only calls
    its children records itself on theirs)."""
    if not name:
        return ""
    for part in module.modules():
        graph = getattr(part, "graph", None)
        for node in graph.nodes if isinstance(graph, torch.fx.Graph) else ():
            if node.op == "placeholder":
                continue  # placeholders can carry the stack of the module that produced them
            for path, type_name in (node.meta.get("nn_module_stack") or {}).values():
                # A stage wrapped in another module sees its original names under a prefix.
                if path == name or name.endswith("." + path):
                    return str(type_name).rsplit(".", 1)[-1]
    return ""


def _named_classes(model: nn.Module) -> list[tuple[str, str, nn.Module]]:
    """(qualified name, class name, module) of every possible unit, in registration order:
    every submodule except the root (always a unit of its own) and containers."""
    named = []
    for name, module in model.named_modules():
        cls = class_name(module, name) if name else ""
        if cls:
            named.append((name, cls, module))
    return named


def _outermost(named: Iterable[tuple[str, nn.Module]]) -> list[nn.Module]:
    """Modules not inside another of ``named`` (named_modules order: parents come first)."""
    kept: list[str] = []
    modules = []
    for name, module in named:
        if not any(name.startswith(parent + ".") for parent in kept):
            kept.append(name)
            modules.append(module)
    return modules


def _holds_blocks_contents(module: nn.Module) -> bool:
    """Whether a submodule of ``module`` holds parameters (a block, not a leaf layer)."""
    return any(any(True for _ in child.parameters()) for child in module.children())


def repeated_block_class(model: nn.Module) -> str:
    """The class of the repeated blocks of ``model`` (rules in the module docstring); ''
    when it has none."""
    by_class: dict[str, list[tuple[str, nn.Module]]] = {}
    for name, cls, module in _named_classes(model):
        by_class.setdefault(cls, []).append((name, module))
    best, best_score = "", (0, 0)
    for cls, instances in by_class.items():
        if len(instances) < 2 or not any(_holds_blocks_contents(module) for _, module in instances):
            continue
        unique = {id(p): p.numel() for _, module in instances for p in module.parameters()}
        depth = min(name.count(".") for name, _ in instances)
        score = (sum(unique.values()), -depth)  # most parameters, then the outermost
        if score[0] > 0 and score > best_score:
            best, best_score = cls, score
    return best


def block_class_names(model: nn.Module, unit_names: Sequence[str] = ()) -> tuple[str, ...]:
    """The unit classes for ``model``: ``unit_names`` when given, else its repeated block
    class (empty when it has none). Resolved on the whole model before a pipeline split,
    since a stage may hold a single block and so no repeated one."""
    if unit_names:
        return tuple(unit_names)
    found = repeated_block_class(model)
    return (found,) if found else ()


def find_blocks(model: nn.Module, unit_names: Sequence[str] = ()) -> list[nn.Module]:
    """The modules of ``model`` to shard and checkpoint one by one, in registration (forward)
    order: those whose class is in ``unit_names`` (outermost matches only), or without
    names the instances of the repeated block class; [] when the model has none."""
    names = set(block_class_names(model, unit_names))
    return _outermost((name, module) for name, cls, module in _named_classes(model) if cls in names)


def describe_units(model: nn.Module, blocks: Sequence[nn.Module]) -> str:
    """One line for the rank log: how many units of which class, or that the model is one."""
    if not blocks:
        return (f"FSDP units: no repeated blocks in {type(model).__name__}, so the whole model is one FSDP "
                "unit (parallel.fsdp_units names the class of modules to shard one by one)")
    classes = {id(module): cls for _, cls, module in _named_classes(model)}
    counts: dict[str, int] = {}
    for block in blocks:
        cls = classes.get(id(block), type(block).__name__)
        counts[cls] = counts.get(cls, 0) + 1
    listed = ", ".join(f"{count} x {cls}" for cls, count in counts.items())
    return f"FSDP units: {listed}, then the root ({type(model).__name__}) for the remaining parameters"


def unit_problems(model: nn.Module, unit_names: Sequence[str]) -> list[str]:
    """One line per name in ``unit_names`` (``parallel.fsdp_units``) that names no module
    class of ``model`` that can be a unit, each naming the fix (checked before workers start).
    Names that are not strings are left to the config's own field checks."""
    if not _well_formed(unit_names):
        return []
    named = _named_classes(model)
    known = list(dict.fromkeys(cls for _, cls, module in named if any(True for _ in module.parameters())))
    containers = {type(m).__name__ for m in model.modules() if isinstance(m, _CONTAINERS)}
    root = type(model).__name__
    problems = []
    for wanted in dict.fromkeys(unit_names):  # each name once
        if any(cls == wanted for _, cls, _ in named):
            continue
        if wanted in containers:
            why = (f"'{wanted}' is a container without a forward, which FSDP cannot shard as a unit; name the "
                   "class of the blocks inside it")
        elif wanted == root:
            why = f"'{wanted}' is the model itself, always the last unit; name the class of its repeated blocks"
        else:
            close = difflib.get_close_matches(wanted, known, n=1)
            why = f"no module of {root} has class '{wanted}'" + (f" (did you mean '{close[0]}'?)" if close else "")
        problems.append(f"parallel.fsdp_units: {why}. Classes with parameters in {root}: "
                        f"{', '.join(known) or 'none'}; or leave fsdp_units empty to use the repeated block class")
    return problems


def _well_formed(unit_names: object) -> bool:
    """Whether ``unit_names`` is a list of non-empty strings (``config.checks`` says so otherwise)."""
    return isinstance(unit_names, (list, tuple)) and all(isinstance(n, str) and n.strip() for n in unit_names)


def ac_problems(model: nn.Module, mode: str, unit_names: Sequence[str] = ()) -> list[str]:
    """Why ``parallel.ac = mode`` cannot checkpoint ``model``: it has no blocks to wrap.
    Unknown names in ``unit_names`` are ``unit_problems``' to report, not repeated here."""
    if mode not in ("full", "selective") or not _well_formed(unit_names) or unit_problems(model, unit_names):
        return []
    if find_blocks(model, unit_names):
        return []
    return [f"parallel.ac = '{mode}' checkpoints the model's repeated blocks, and {type(model).__name__} has "
            "none (no module class holding layers with parameters occurs more than once); name the class "
            "of the modules to checkpoint with parallel.fsdp_units = [\"ClassName\"], or set parallel.ac = 'none'"]
