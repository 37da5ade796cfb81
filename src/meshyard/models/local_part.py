"""This rank's part of a tensor that parallelism may have made a DTensor.

Expert and tensor parallelism turn weights into DTensors (``torch.distributed.tensor``);
a model computing with its own shard, a loss under loss parallelism, a snapshot of
parameters or optimizer states and a hand-written gradient reduction all need the plain
tensor under one. Models may not import ``torch.distributed``, so the DTensor is
recognised by its ``to_local`` method rather than by its class.
"""

from __future__ import annotations

import torch


def local_part(tensor: torch.Tensor) -> torch.Tensor:
    """The plain tensor this rank holds of ``tensor``: its shard of a sharded DTensor, the
    whole value of a replicated one (a loss under loss parallelism), ``tensor`` itself
    when it is a plain tensor. Differentiable like ``DTensor.to_local``."""
    to_local = getattr(tensor, "to_local", None)
    return to_local() if to_local is not None else tensor
