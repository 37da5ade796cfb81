"""How tensor parallelism reads a module: projections and their widths, the output head
and token embedding, tied parameters, and the attention attributes a split changes; and
the plan it resolves to (``Split`` per module, ``TPPlan``), which ``tp_plans`` builds and
``tp_trial`` tries.

The head rule. After a split, a rank's attention holds 1/tp of the heads, and a forward
that reads its head count or width from attributes must read the per-rank values. An
attention module is the parent of a colwise projection with a rowwise sibling that
holds a head count (an attribute named in ``HEAD_COUNTS``) or a head width (``HEAD_WIDTHS``). Each
integer instance attribute of it named in ``HEAD_COUNTS`` or ``WIDTHS`` is divided by
tp (``per_rank_attributes``): nanoGPT's ``n_head`` and ``n_embd``; Hugging Face GPT-2's
``num_heads``, ``embed_dim`` and ``split_size``; Llama reads only ``head_dim`` and -1
for the heads, and sets ``num_heads`` / ``num_key_value_heads`` where a version has them.
``head_dim`` and ``num_key_value_groups`` keep their values (they do not change with
tp). A forward that reads counts from elsewhere (a config object shared by all layers)
needs the model's own ``tensor_parallel_plan``.

Nothing here needs a process group or tensor values: it all works on the meta device.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field

from torch import nn


@dataclass(frozen=True)
class Split:
    """How one module is split: ``style`` ('colwise', 'rowwise' or 'replicate'), the
    equal blocks of a fused colwise projection (``parts``), whether a colwise module
    returns its full output (``gather``: no rowwise sibling takes its slice), and
    whether a rowwise module is given the full input and cuts its rank's slice itself
    (``whole_input``: no colwise module before it)."""

    style: str
    parts: int = 1
    gather: bool = False
    whole_input: bool = False


@dataclass
class TPPlan:
    """A resolved plan: concrete module names, the attention modules the head rule
    adjusts, the output head (vocabulary-split logits under loss parallel), notes for
    the rank log and problems found while resolving."""

    source: str
    splits: dict[str, Split] = field(default_factory=dict)
    attention: list[str] = field(default_factory=list)
    output_head: str | None = None
    notes: list[str] = field(default_factory=list)
    problems: list[str] = field(default_factory=list)


HEAD_COUNTS = ("n_head", "n_heads", "num_heads", "num_attention_heads", "num_key_value_heads", "n_kv_head",
               "n_kv_heads", "num_kv_heads")
"""Attention attributes holding a head count: divided by tp on each rank."""

WIDTHS = ("n_embd", "embed_dim", "split_size", "hidden_size", "all_head_size")
"""Attention attributes holding the width of all heads together: divided by tp on each rank."""

KV_HEAD_COUNTS = ("num_key_value_heads", "n_kv_head", "n_kv_heads", "num_kv_heads")
"""The head counts of keys and values (grouped-query attention)."""

HEAD_NAMES = ("lm_head", "output", "head")
"""Child names taken for the output head of a model without ``get_output_embeddings``."""


def per_rank_attributes(module: nn.Module, tp: int) -> dict[str, int]:
    """The head rule on one attention module: {attribute: its per-rank value}."""
    return {name: value // tp for name in (*HEAD_COUNTS, *WIDTHS)
            if (value := int_attribute(module, name)) is not None}


HEAD_WIDTHS = ("head_dim", "head_size")
"""Attention attributes holding the width of one head (Llama's ``head_dim``, GPT-NeoX's
``head_size``): unchanged by tp."""


def holds_heads(module: nn.Module) -> bool:
    """Whether ``module`` reads like attention: it has a head count or a head width."""
    return any(int_attribute(module, name) is not None for name in (*HEAD_COUNTS, *HEAD_WIDTHS))


def is_conv1d(module: nn.Module) -> bool:
    """Hugging Face's ``transformers.pytorch_utils.Conv1D`` (weight stored (in, out)),
    recognised without importing transformers."""
    return type(module).__name__ == "Conv1D" and hasattr(module, "nf") and getattr(module, "weight", None) is not None


def is_projection(module: nn.Module | None) -> bool:
    """An nn.Linear or a Conv1D: what colwise and rowwise split besides embeddings."""
    return isinstance(module, nn.Linear) or (module is not None and is_conv1d(module))


def out_features(module: nn.Module) -> int | None:
    """Output width of a projection, or an embedding's width; None for other modules."""
    if isinstance(module, nn.Linear):
        return module.out_features
    if isinstance(module, nn.Embedding):
        return module.embedding_dim
    return int(module.weight.shape[1]) if is_conv1d(module) else None


def in_features(module: nn.Module) -> int | None:
    """Input width of a projection, or an embedding's vocabulary; None for other modules."""
    if isinstance(module, nn.Linear):
        return module.in_features
    if isinstance(module, nn.Embedding):
        return module.num_embeddings
    return int(module.weight.shape[0]) if is_conv1d(module) else None


def output_head_name(model: nn.Module) -> str | None:
    """The module whose output is the model's logits: Hugging Face's
    ``get_output_embeddings()``, else a child named as in ``HEAD_NAMES``."""
    getter = getattr(model, "get_output_embeddings", None)
    head = getter() if callable(getter) else None
    if head is None:
        head = next((child for name, child in model.named_children() if name in HEAD_NAMES), None)
    return next((name for name, module in model.named_modules() if module is head and name), None)


def input_embedding_name(model: nn.Module, head: nn.Linear) -> str | None:
    """The token embedding: Hugging Face's ``get_input_embeddings()``, else the
    embedding tied to the head, else one as large as the vocabulary."""
    getter = getattr(model, "get_input_embeddings", None)
    wanted = getter() if callable(getter) else None
    embeddings = [(n, m) for n, m in model.named_modules() if isinstance(m, nn.Embedding)]
    for test in (lambda m: m is wanted, lambda m: m.weight is head.weight,
                 lambda m: m.num_embeddings == head.out_features):
        found = next((n for n, m in embeddings if test(m)), None)
        if found is not None:
            return found
    return None


def tied_groups(model: nn.Module) -> list[list[str]]:
    """Groups of parameter names that share one tensor (a tied embedding and head)."""
    groups: dict[int, list[str]] = {}
    for name, param in model.named_parameters(remove_duplicate=False):
        groups.setdefault(id(param), []).append(name)
    return [names for names in groups.values() if len(names) > 1]


def int_attribute(module: nn.Module, name: str) -> int | None:
    """An integer the instance itself holds (not a flag, not a class default)."""
    value = vars(module).get(name)
    return value if isinstance(value, int) and not isinstance(value, bool) else None


def first_int(module: nn.Module, names: tuple[str, ...]) -> int | None:
    return next((v for n in names if (v := int_attribute(module, n)) is not None), None)


def pattern_of(name: str) -> str:
    """``transformer.h.3.attn`` -> ``transformer.h.*.attn``: one message for all blocks."""
    return re.sub(r"(?<=\.)\d+(?=\.|$)", "*", name)
