"""What a model's forward returns, reduced to what training needs."""

from __future__ import annotations

import torch


def logits_of(output: object) -> torch.Tensor:
    """The logits in what a model's forward returned: a tensor as is, the ``logits`` of a
    Hugging Face ``ModelOutput`` or of a dict. Anything else is a TypeError that names
    what came back, since the loss cannot guess which part of it to train on."""
    if isinstance(output, torch.Tensor):
        return output
    logits = output.get("logits") if isinstance(output, dict) else getattr(output, "logits", None)
    if isinstance(logits, torch.Tensor):  # a ModelOutput is a dict too; both paths find it
        return logits
    raise TypeError(
        f"the model's forward returned {_describe(output)}, which holds no logits tensor; meshyard trains "
        "on next-token logits: return a (batch, sequence, vocabulary) tensor, or an object or dict with "
        "a 'logits' tensor (as Hugging Face models do)")


def _describe(output: object) -> str:
    """A short name for what a forward returned, for the error above."""
    if isinstance(output, dict):
        return f"a {type(output).__name__} with keys {sorted(map(str, output))}"
    if isinstance(output, (tuple, list)):
        return f"a {type(output).__name__} of {len(output)} items"
    return f"a value of type {type(output).__name__}"
