"""A trial forward of a plan's shapes on the meta device, before any worker starts.

The head rule (``tp_modules``) sets the per-rank head counts and widths a forward reads
from attributes; a forward that computes them otherwise (``C // self.n_head`` with ``C``
the full input width, as nanoGPT's original attention does) fails inside every worker
once its attention holds 1/tp of the heads. ``trial_problems`` finds that first: on a
copy of the meta-device model, each split module is replaced by a stand-in returning
what it returns on one rank (a colwise projection its 1/tp slice; a rowwise one checks
it is given that slice), the head rule is applied, and the model runs once on meta
token ids. It must run, and its scaled_dot_product_attention calls must see heads as
wide as in the model unchanged: a forward reading the head width as ``C // n_head`` with
a view of -1 heads would otherwise run on wrong heads without an error (meshyard's GPT
does so, and keeps its own plan). Only a model that runs unchanged on the meta device
is judged (Hugging
Face models call ``.item()`` there and are left to the workers; their forwards read
``head_dim`` and -1, which the split does not change).
"""

from __future__ import annotations

import copy
from typing import Any, Callable

import torch
import torch.nn.functional as F
from torch import nn
from torch.overrides import TorchFunctionMode

from meshyard.parallel.tp_modules import Split, TPPlan, in_features, out_features, pattern_of, per_rank_attributes


def trial_problems(model: nn.Module, plan: TPPlan, tp: int) -> list[str]:
    """Why ``model``'s forward fails, or runs on heads of another width, with ``plan``'s
    per-rank shapes ([] when it runs right, or when it cannot run on the meta device at
    all, so nothing can be told)."""
    if any(not tensor.is_meta for tensor in model.parameters()):
        return []  # a model built with its values: too costly to copy, and not what validation builds
    try:
        unchanged, trial = copy.deepcopy(model), copy.deepcopy(model)
        expected = _head_widths(unchanged)
    except Exception:  # the model does not run on meta: the workers will tell
        return []
    for name, split in plan.splits.items():
        stand_in = _stand_in(pattern_of(name), trial.get_submodule(name), split, tp)
        if stand_in is not None:
            trial.get_submodule(name).forward = stand_in
    for name in plan.attention:
        for attr, value in per_rank_attributes(trial.get_submodule(name), tp).items():
            setattr(trial.get_submodule(name), attr, value)
    fix = ("it must read head counts and widths from its attention's attributes (n_head, n_embd, num_heads, ...: "
           "meshyard sets their per-rank values) or from the tensors it is given (e.g. view(B, T, -1, head_dim)); "
           "or give the model a tensor_parallel_plan(tp_mesh)")
    try:
        widths = _head_widths(trial)
    except Exception as error:
        message = str(error).splitlines()[0] if str(error) else "no message"
        return [f"{type(model).__name__}'s forward fails once each rank holds 1/{tp} of the heads "
                f"({type(error).__name__}: {message}): {fix}"]
    if widths != expected:
        return [f"{type(model).__name__}'s attention runs on heads {widths[0]} wide instead of {expected[0]} once "
                f"each rank holds 1/{tp} of them, which would train on wrong numbers: {fix}"]
    return []


class _HeadWidths(TorchFunctionMode):
    """Records the head width (the query's last dimension) of every
    scaled_dot_product_attention call made while it is active."""

    def __init__(self) -> None:
        super().__init__()
        self.widths: list[int] = []

    def __torch_function__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        if func is F.scaled_dot_product_attention:
            query = args[0] if args else kwargs["query"]
            self.widths.append(int(query.shape[-1]))
        return func(*args, **kwargs)


def _head_widths(model: nn.Module) -> list[int]:
    """One forward of ``model`` on meta token ids; the head widths its attention saw."""
    with torch.no_grad(), _HeadWidths() as seen:
        model(torch.zeros(1, 8, dtype=torch.long, device="meta"))
    return seen.widths


def _stand_in(name: str, module: nn.Module, split: Split, tp: int) -> Callable[..., Any] | None:
    """A forward returning what ``module`` returns on one rank under ``split`` (None:
    the module's own forward already does, as for replicated and full-output modules)."""
    if split.style == "colwise" and not split.gather and not isinstance(module, nn.Embedding):
        width = (out_features(module) or 0) // tp

        def colwise(x: torch.Tensor) -> torch.Tensor:
            return x.new_empty(*x.shape[:-1], width)

        return colwise
    if split.style == "rowwise" and not isinstance(module, nn.Embedding):
        local, width = (in_features(module) or 0) // (1 if split.whole_input else tp), out_features(module) or 0

        def rowwise(x: torch.Tensor) -> torch.Tensor:
            if x.shape[-1] != local:
                raise ValueError(f"{name} is given {x.shape[-1]} features, not its rank's {local}")
            return x.new_empty(*x.shape[:-1], width)

        return rowwise
    return None
