"""Activation checkpointing: recompute a block's activations in backward instead of storing them.

``full`` wraps every block (FSDP's units, chosen by ``meshyard.parallel.units``),
``selective`` every ``every``-th one (memory falls roughly by that share of blocks,
compute rises by one extra forward of them).
The block's ``forward`` is wrapped in place rather than the block in a wrapper module,
so parameter names (and checkpoints) are the same with and without it.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Callable

from torch import nn
from torch.utils.checkpoint import checkpoint

from meshyard.parallel.units import ac_problems, find_blocks, unit_problems


def _checkpointed(forward: Callable[..., Any]) -> Callable[..., Any]:
    def run(*args: Any, **kwargs: Any) -> Any:
        # Non-reentrant: works with keyword arguments, DTensors and inputs without grad.
        return checkpoint(forward, *args, use_reentrant=False, **kwargs)
    run.recomputes_activations = True  # type: ignore[attr-defined]  # read by checkpointed_blocks
    return run


def apply_ac(model: nn.Module, mode: str, every: int = 2, unit_names: Sequence[str] = ()) -> nn.Module:
    """Checkpoint the blocks of ``model`` per ``mode`` ('none', 'full', 'selective'): the
    modules of the classes in ``unit_names``, or of the repeated block class
    (``meshyard.parallel.units``, the same units FSDP shards)."""
    if mode == "none":
        return model
    blocks = find_blocks(model, unit_names)
    if not blocks:
        # Validation refuses this before workers start (units.ac_problems); this guards direct calls.
        raise TypeError(" ".join(ac_problems(model, mode, unit_names) or unit_problems(model, unit_names)))
    for position, block in enumerate(blocks):
        if mode == "full" or position % every == 0:
            block.forward = _checkpointed(block.forward)
    return model


def checkpointed_blocks(model: nn.Module, unit_names: Sequence[str] = ()) -> int:
    """How many blocks of ``model`` recompute their activations (for reports and tests)."""
    return sum(1 for block in find_blocks(model, unit_names)
               if getattr(vars(block).get("forward"), "recomputes_activations", False))


__all__ = ["apply_ac", "checkpointed_blocks"]
