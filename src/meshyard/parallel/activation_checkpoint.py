"""Activation checkpointing: recompute a block's activations in backward instead of storing them.

``full`` wraps every transformer block, ``selective`` every ``every``-th one (memory
falls roughly by that share of blocks, compute rises by one extra forward of them).
The block's ``forward`` is wrapped in place rather than the block in a wrapper module,
so parameter names (and checkpoints) are the same with and without it.
"""

from __future__ import annotations

from typing import Any, Callable

from torch import nn
from torch.utils.checkpoint import checkpoint


def _repeated_blocks(model: nn.Module) -> list[nn.Module]:
    """The transformer blocks: ``model.blocks`` (list or, in a pipeline stage, dict), else
    the children of the first ``nn.ModuleList``."""
    blocks = getattr(model, "blocks", None)
    if isinstance(blocks, nn.ModuleDict):
        return list(blocks.values())
    if isinstance(blocks, nn.ModuleList):
        return list(blocks)
    for module in model.modules():
        if isinstance(module, nn.ModuleList) and len(module) > 0:
            return list(module)
    return []


def _checkpointed(forward: Callable[..., Any]) -> Callable[..., Any]:
    def run(*args: Any, **kwargs: Any) -> Any:
        # Non-reentrant: works with keyword arguments, DTensors and inputs without grad.
        return checkpoint(forward, *args, use_reentrant=False, **kwargs)
    return run


def apply_ac(model: nn.Module, mode: str, every: int = 2) -> nn.Module:
    """Checkpoint the blocks of ``model`` per ``mode`` ('none', 'full', 'selective')."""
    if mode == "none":
        return model
    blocks = _repeated_blocks(model)
    if not blocks:
        raise TypeError(f"parallel.ac = '{mode}' needs repeated blocks (an nn.ModuleList); "
                        f"{type(model).__name__} has none")
    for position, block in enumerate(blocks):
        if mode == "full" or position % every == 0:
            block.forward = _checkpointed(block.forward)
    return model


def checkpointed_blocks(model: nn.Module) -> int:
    """How many blocks of ``model`` recompute their activations (for reports and tests)."""
    return sum(1 for block in _repeated_blocks(model) if "forward" in vars(block))


__all__ = ["apply_ac", "checkpointed_blocks"]
