"""The parallel plans a Hugging Face model publishes for itself, read without importing transformers.

transformers gives each architecture a tensor-parallel plan in its config
(``config.base_model_tp_plan``: module-name patterns relative to the base model, such as
``"layers.*.self_attn.q_proj": "colwise"``), one for its output head on the model class
(``_tp_plan``, e.g. ``{"lm_head": "colwise_gather_output"}``), and a pipeline plan
(``config.base_model_pp_plan``) whose entry holding an ``nn.ModuleList`` is the list of
decoder layers. Their authors know how each projection is laid out: GPT-NeoX's fused
``query_key_value`` holds q, k and v head by head, so a plain column split keeps whole
heads on each rank, where meshyard's structural reading would take it for q|k|v blocks.

Styles (transformers' names) and the ``Split`` each becomes (``HF_STYLES``):

- ``colwise``: split by output features, each rank keeping its slice for the rowwise
  module that reads it; ``colwise_rep`` / ``colwise_gather_output``: the same, returning
  the full output; ``packed_colwise``: two packed blocks (gate|up), each split on its own;
- ``rowwise``: split by input features, taking a colwise module's slice and summing the
  full output; ``rowwise_rep`` / ``rowwise_split_input``: the same from the full input;
- ``embedding_rowwise`` / ``embedding_colwise``: an embedding split by vocabulary / width;
- ``replicate``, ``replicated_with_grad_allreduce``: the whole module on every rank;
  ``sequence_parallel``: runs as ``replicate`` (these plans do not cut activations
  along the sequence; the rank log says so).

Any other style (local, packed-rowwise, expert and MLA styles) names a layout meshyard
cannot carry out: ``hf_splits`` reports it as one problem naming the patterns and the
ways around it. The vocabulary (token embedding and output head) is split by
``tp_plans`` as for every plan, when tp divides it.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field

from torch import nn

from meshyard.parallel.tp_modules import Split

HF_STYLES: dict[str, Split] = {
    "colwise": Split("colwise"),
    "colwise_rep": Split("colwise", gather=True),
    "colwise_gather_output": Split("colwise", gather=True),
    "packed_colwise": Split("colwise", parts=2),
    "rowwise": Split("rowwise"),
    "rowwise_rep": Split("rowwise", whole_input=True),
    "rowwise_split_input": Split("rowwise", whole_input=True),
    "embedding_rowwise": Split("rowwise"),
    "embedding_colwise": Split("colwise"),
    "replicate": Split("replicate"),
    "replicated_with_grad_allreduce": Split("replicate"),
    "sequence_parallel": Split("replicate"),
}
"""transformers' tensor-parallel styles meshyard carries out, as the Split each becomes."""


@dataclass
class HFSplits:
    """A Hugging Face plan expanded over a model's module names: the split of each
    module (first matching pattern wins), notes for the rank log, and problems."""

    source: str
    splits: dict[str, Split] = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)
    problems: list[str] = field(default_factory=list)


def base_model_name(model: nn.Module) -> str | None:
    """The qualified name of a Hugging Face model's base model ('' when the model is
    its own base), None for a model that is not a Hugging Face ``PreTrainedModel``."""
    base = getattr(model, "base_model", None)
    if getattr(model, "config", None) is None or not isinstance(base, nn.Module):
        return None
    return next((name for name, module in model.named_modules() if module is base), None)


def hf_tp_entries(model: nn.Module) -> dict[str, str]:
    """The model's own tensor-parallel plan, its patterns made relative to the model
    itself: the config's ``base_model_tp_plan`` under the base model's name, then the
    model class's ``_tp_plan`` (its head). Empty when the config publishes none."""
    base = base_model_name(model)
    plan = getattr(getattr(model, "config", None), "base_model_tp_plan", None)
    if base is None or not isinstance(plan, dict) or not plan:
        return {}
    entries = {_join(base, pattern): str(style) for pattern, style in plan.items()}
    head_plan = getattr(type(model), "_tp_plan", None) if base else None
    if isinstance(head_plan, dict):
        entries.update({pattern: str(style) for pattern, style in head_plan.items() if pattern not in entries})
    return entries


def hf_splits(model: nn.Module) -> HFSplits | None:
    """``hf_tp_entries`` expanded over ``model``'s module names, as meshyard's splits;
    None when the model publishes no plan or none of its patterns names a module."""
    entries = hf_tp_entries(model)
    if not entries:
        return None
    found = HFSplits(f"the Hugging Face plan of {type(model).__name__} (config.base_model_tp_plan)")
    modules = [name for name, _ in model.named_modules() if name]
    parameters = [name for name, _ in model.named_parameters()]
    refused: list[str] = []
    for pattern, style in entries.items():
        regex = _pattern_regex(pattern)
        names = [name for name in modules if regex.fullmatch(name)]
        if style in HF_STYLES and names:
            for name in names:
                found.splits.setdefault(name, HF_STYLES[style])
        elif names or any(regex.fullmatch(name) for name in parameters):
            refused.append(f"'{pattern}' = '{style}'")  # a style meshyard lacks, or a bare parameter
    if not found.splits and not refused:
        return None
    if "sequence_parallel" in entries.values():
        found.notes.append("'sequence_parallel' entries of the Hugging Face plan run as 'replicate': meshyard does "
                           "not split activations along the sequence for this model")
    if refused:
        found.problems.append(
            f"parallel.tp: the Hugging Face plan of {type(model).__name__} asks for {', '.join(refused)}, which "
            f"meshyard cannot carry out: it splits modules with {', '.join(repr(s) for s in HF_STYLES)} only "
            "(not local, packed-rowwise or expert styles, nor single parameters). Give these modules a "
            "[parallel.tp_plan] table of your own (module-name patterns to 'colwise', 'rowwise' or 'replicate'; "
            "it replaces the Hugging Face plan), give the model a tensor_parallel_plan(tp_mesh) method, or set "
            "parallel.tp = 1")
    return found


def hf_layer_list(model: nn.Module) -> str | None:
    """The qualified name of the ``nn.ModuleList`` of decoder layers the model's
    ``config.base_model_pp_plan`` names, None when it names none."""
    base = base_model_name(model)
    plan = getattr(getattr(model, "config", None), "base_model_pp_plan", None)
    if base is None or not isinstance(plan, dict):
        return None
    for name in plan:
        qualified = _join(base, name)
        try:
            module = model.get_submodule(qualified)
        except AttributeError:
            continue
        if isinstance(module, nn.ModuleList) and len(module) > 0:
            return qualified
    return None


def _pattern_regex(pattern: str) -> re.Pattern[str]:
    """A plan pattern as a regular expression: ``*`` stands for one name segment (a layer index)."""
    return re.compile(r"[^.]+".join(re.escape(part) for part in pattern.split("*")))


def _join(prefix: str, name: str) -> str:
    return f"{prefix}.{name}" if prefix else name
