"""``torch.compile`` for training: the model and its loss as one region where the layout
allows, each transformer block otherwise (the FSDP unit, as torchtitan compiles).

Compilation replaces a ``forward`` (a block's, in place, as activation checkpointing
does) or the step's forward-and-loss function; modules are never wrapped, so parameter
names, checkpoints, ``verify`` and exports are the same compiled or not. Regions compile
with ``fullgraph=True``: a model either compiles whole or is reported (``train.compile =
'auto'`` then trains it eagerly, ``true`` stops), never half-compiled without a word.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Callable

import torch
from torch import nn

from meshyard.parallel.units import find_blocks


def resolve_compile(requested: Any, device: torch.device) -> bool:
    """``train.compile``: 'auto' compiles on CUDA (where it pays) and not on CPU, where a
    first compile costs more than a short job gains; true or false as given."""
    if requested == "auto":
        return device.type == "cuda"
    return bool(requested)


def inductor_options(tuning: bool, cuda_graphs: bool = False) -> dict[str, Any]:
    """``train.compile_tuning`` and ``train.cuda_graphs`` as Inductor options.

    Tuning: coordinate-descent tuning of each generated Triton kernel's block sizes and
    warps (the memory-bound kernels around the matmuls: layer norms, GELU, the loss's
    reductions), at the price of a first compile about twice as long. Off by default: its
    gain in step time is not yet measured. CUDA graphs: the compiled forward and backward
    are recorded once and replayed (CUDAGraph trees, the option mode 'reduce-overhead'
    sets; ``torch.compile`` takes a mode or options, not both)."""
    return {**({"coordinate_descent_tuning": True} if tuning else {}),
            **({"triton.cudagraphs": True} if cuda_graphs else {})}


def compile_errors() -> tuple[type[BaseException], ...]:
    """What a failed compilation raises: Dynamo's errors (an unsupported construct under
    fullgraph, a failing backend such as Inductor without a C compiler), and tracing's
    errors on a size read from the data (a mixture of experts splitting its tokens by
    counts taken to the host), which reach the caller as they are."""
    from torch._dynamo.exc import TorchDynamoException  # no public name for Dynamo's error base
    from torch._subclasses.fake_tensor import DataDependentOutputException
    from torch.fx.experimental.symbolic_shapes import GuardOnDataDependentSymNode

    return (TorchDynamoException, GuardOnDataDependentSymNode, DataDependentOutputException)


def compiled_graphs() -> int:
    """Graphs compiled in this process so far (Dynamo's count): a steady run stops adding."""
    from torch._dynamo.utils import counters  # Dynamo's own statistics; no public accessor

    return int(counters["stats"]["unique_graphs"])


@dataclass
class Compilation:
    """What was compiled and how to undo it: ``regions`` names each compiled module or
    function (for records and warnings), ``revert`` restores the eager forwards."""

    requested: Any = False
    options: dict[str, Any] = field(default_factory=dict)
    """Inductor options of every region (``inductor_options``)."""
    regions: list[str] = field(default_factory=list)
    _undo: list[Callable[[], None]] = field(default_factory=list)

    @property
    def enabled(self) -> bool:
        return bool(self.regions)

    @property
    def graphs(self) -> bool:
        """Whether the compiled regions replay as CUDA graphs (``train.cuda_graphs``)."""
        return self.enabled and bool(self.options.get("triton.cudagraphs"))

    def revert(self) -> None:
        """Eager again: every compiled forward put back (after a compile failure)."""
        for undo in reversed(self._undo):
            undo()
        self._undo.clear()
        self.regions.clear()

    def compile_function(self, fn: Callable[..., Any], name: str) -> Callable[..., Any]:
        """``fn`` compiled as one region; ``revert`` makes callers fall back to ``fn``."""
        compiled = torch.compile(fn, fullgraph=True, options=self.options or None)
        self.regions.append(name)
        holder = {"fn": compiled}
        self._undo.append(lambda: holder.update(fn=fn))
        return lambda *args, **kwargs: holder["fn"](*args, **kwargs)


    def compile_forward(self, module: nn.Module) -> None:
        """``module.forward`` (with activation checkpointing's wrapper, if any) compiled in
        place; ``revert`` puts back what was there."""
        own = vars(module).get("forward")
        compiled = torch.compile(module.forward, fullgraph=True, options=self.options or None)
        # Recomputing activations stays visible to reports through the compiled wrapper.
        compiled.recomputes_activations = getattr(own, "recomputes_activations", False)
        module.forward = compiled
        self.regions.append(type(module).__name__)

        def undo() -> None:
            if own is None:
                del module.forward
            else:
                module.forward = own

        self._undo.append(undo)

    def describe(self) -> str:
        """'Block x12' or 'the model and its loss': what was compiled, in one phrase."""
        counts: dict[str, int] = {}
        for name in self.regions:
            counts[name] = counts.get(name, 0) + 1
        regions = ", ".join(name if n == 1 else f"{name} x{n}" for name, n in counts.items())
        notes = [note for option, note in (("coordinate_descent_tuning", "tuned kernels"),
                                           ("triton.cudagraphs", "CUDA graphs")) if self.options.get(option)]
        return f"{regions} ({', '.join(notes)})" if regions and notes else regions


def apply_compile(model: nn.Module, compilation: Compilation, unit_names: Sequence[str] = ()) -> nn.Module:
    """Compile the ``forward`` of each block of ``model`` (the modules of the classes in
    ``unit_names``, or the repeated block class) in place, after tensor parallelism and
    activation checkpointing and before FSDP, which then gathers parameters around each
    compiled block. A model without repeated blocks is compiled whole, in place."""
    for block in find_blocks(model, unit_names) or [model]:
        compilation.compile_forward(block)
    return model
