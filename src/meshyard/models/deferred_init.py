"""Build a model on the meta device and record how each of its tensors gets its value.

Under FSDP and pipelining no rank needs the whole model, yet every rank must start from
exactly the weights that a one-process build with the same seed makes: parity with one
process is meshyard's standard of correctness, and losses must not change because a
layout changed. A fresh initialisation per parameter name would give the right
distribution but other numbers, so instead the model's own initialisation is replayed.

``record_build`` runs the unchanged builder with uninitialised allocations
(``torch.empty``, what every ``torch.nn`` layer uses) sent to the meta device, and
records, per tensor, what initialises it in place: a ``torch.nn.init`` call, or an
in-place tensor operation. A random step is recorded with the generator state it starts
from, and is also run once on a scratch tensor of the same shape (one tensor at a time)
so that the generator advances exactly as in a build on the device: later draws, and
whatever runs after the build, see the same random numbers. ``InitRecord.compute(name)``
later replays one tensor's steps into a fresh full tensor; the parallel layout keeps
only its own shard of it.

The protocol a builder follows for this to work (``torch.nn`` layers, ``torch.nn.init``
and meshyard's models do):

1. tensors are allocated with ``torch.empty`` and then initialised in place
   (``reset_parameters``, any ``nn.init`` function, ``fill_``, ``mul_``, ``copy_`` from
   a real tensor ...): these cost nothing until materialised;
2. tensors created with their values (``nn.Parameter(torch.ones(d))``, a causal mask or
   rotary table registered as a buffer) are computed on the device during the build and
   kept as they are, so they should be small.

Anything else raises ``DeferredInitError`` naming what was found, and the caller builds
the model on the device instead: writes into part of a tensor (``nn.Embedding`` with
``padding_idx`` zeroes one row), values computed from other deferred tensors (one
parameter copied into another), random draws from a private ``torch.Generator`` or into
meta tensors that are not initialised in place, tensors never initialised, a builder
that fails on the meta device.
"""

from __future__ import annotations

import sys
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator, NamedTuple

import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

aten = torch.ops.aten

# Allocations whose contents are unspecified: the only ones that may be deferred freely.
_UNINITIALISED = (aten.empty.memory_format, aten.empty_strided.default)
# In-place operations that write every element regardless of the previous contents.
_OVERWRITES = (aten.fill_.Scalar, aten.fill_.Tensor, aten.zero_.default, aten.copy_.default)
# torch.nn.init functions that draw no random numbers.
_DETERMINISTIC_INITS = (nn.init.constant_, nn.init.ones_, nn.init.zeros_, nn.init.eye_, nn.init.dirac_)
# The public torch.nn.init functions (``normal_``, ``trunc_normal_`` ...), by their code.
_INIT_FUNCTIONS = {value.__code__: value for name, value in vars(nn.init).items()
                   if name.endswith("_") and not name.startswith("_") and callable(value)
                   and getattr(value, "__module__", None) == "torch.nn.init" and hasattr(value, "__code__")}


class DeferredInitError(RuntimeError):
    """The builder initialises the model in a way ``record_build`` cannot replay."""


class InitStep(NamedTuple):
    """One in-place operation on a tensor: ``func(tensor, *args, **kwargs)``; a random
    one starts from ``rng_state`` (the device generator's state before it)."""

    func: Callable[..., Any]
    args: tuple[Any, ...]
    kwargs: dict[str, Any]
    rng_state: torch.Tensor | None = None


@dataclass
class TensorInit:
    """How to compute one full tensor: its layout, then its steps in order."""

    size: torch.Size
    stride: tuple[int, ...]
    dtype: torch.dtype
    steps: list[InitStep] = field(default_factory=list)


@dataclass
class InitRecord:
    """The initial value of every parameter and buffer of a model built on meta, by name
    (every name of a tied tensor), and the generator state a full build ends with."""

    device: torch.device
    tensors: dict[str, TensorInit]
    end_state: torch.Tensor

    def compute(self, name: str) -> torch.Tensor:
        """The full initial value of tensor ``name``, as a build on the device makes it."""
        init = self.tensors[name]
        value = torch.empty_strided(init.size, init.stride, dtype=init.dtype, device=self.device)
        generator = device_generator(self.device)
        with torch.no_grad():
            for step in init.steps:
                if step.rng_state is not None:
                    generator.set_state(step.rng_state)
                step.func(value, *step.args, **step.kwargs)
        return value

    def restore_generator(self) -> None:
        """Leave the device generator where a build on the device leaves it (replays moved it)."""
        device_generator(self.device).set_state(self.end_state)


def device_generator(device: torch.device) -> torch.Generator:
    """The default generator that random initialisation on ``device`` draws from."""
    if device.type == "cpu":
        return torch.default_generator
    if device.type == "cuda":
        return torch.cuda.default_generators[device.index if device.index is not None else torch.cuda.current_device()]
    raise DeferredInitError(f"random draws on {device.type} devices are not replayed")


def _written(func: Any, args: tuple, kwargs: dict) -> list[torch.Tensor]:
    """The tensors an operation writes into (its mutable arguments)."""
    found = []
    for index, arg in enumerate(func._schema.arguments):
        if arg.alias_info is not None and arg.alias_info.is_write:
            value = args[index] if index < len(args) else kwargs.get(arg.name)
            if isinstance(value, torch.Tensor):
                found.append(value)
    return found


def _has_meta(tree: Any) -> bool:
    return any(isinstance(leaf, torch.Tensor) and leaf.is_meta for leaf in tree_leaves(tree))


def _geometry(tensor: torch.Tensor) -> tuple[Any, ...]:
    return tuple(tensor.shape), tensor.stride(), tensor.storage_offset(), tensor.dtype


class _Entry(NamedTuple):
    storage: Any  # held so that its address is not reused by another tensor during the build
    geometry: tuple[Any, ...]
    steps: list[InitStep]


class _Recorder(TorchDispatchMode):
    """Defers uninitialised allocations to meta and records the writes into them.

    ``torch.nn.init`` functions are recorded as one step each, seen through a profile
    hook: some of them (``trunc_normal_``, ``orthogonal_``, ``sparse_``, ``dirac_``) do
    nothing at all on a meta tensor, and ``trunc_normal_`` draws until every value lies
    in bounds, a number of draws that only the values themselves decide. Running the
    whole function on a real scratch tensor reproduces both. Other writes (tensor
    methods such as ``fill_`` or ``normal_``) are recorded operation by operation.

    Entries are keyed by storage, not by tensor object: ``nn.Parameter(t)`` is a new
    tensor object over the same storage as ``t``.
    """

    def __init__(self, device: torch.device) -> None:
        super().__init__()
        self.device = device
        self.generator = device_generator(device)
        self.entries: dict[int, _Entry] = {}
        self.problem: DeferredInitError | None = None  # found by the profile hook, raised after the build
        self._inside: Any = None  # the frame of the torch.nn.init call being recorded
        self._buffer = torch.empty(0, dtype=torch.uint8, device=device)

    @contextmanager
    def watching_init_calls(self) -> Iterator[None]:
        """Record ``torch.nn.init`` calls on meta tensors while the block runs (this thread)."""
        # A profiler running meanwhile misses the build: its hook may not be callable
        # from Python, and chaining to it would risk unsetting this one.
        previous = sys.getprofile()
        sys.setprofile(lambda frame, event, arg: self._on_call(frame, event))
        try:
            yield
        finally:
            sys.setprofile(previous)

    def _on_call(self, frame: Any, event: str) -> None:
        if event == "return" and frame is self._inside:
            self._inside = None
        if event != "call" or self._inside is not None or frame.f_code not in _INIT_FUNCTIONS:
            return
        tensor = frame.f_locals.get("tensor")
        if not isinstance(tensor, torch.Tensor) or not tensor.is_meta:
            return
        self._inside = frame  # the operations inside this call are this step: not recorded again
        function = _INIT_FUNCTIONS[frame.f_code]
        kwargs = {name: value for name, value in frame.f_locals.items() if name != "tensor"}
        try:
            self._record(function, tensor, (), kwargs, function not in _DETERMINISTIC_INITS, overwrites=True)
        except Exception as problem:  # raised inside a profile hook, it would unset the hook: kept for later
            if not isinstance(problem, DeferredInitError):
                problem = DeferredInitError(f"{function.__name__} failed on a scratch copy: {problem!r}")
            self.problem = self.problem or problem

    def _scratch(self, like: torch.Tensor) -> torch.Tensor:
        """A tensor laid out as ``like`` over one reused buffer: a fresh allocation per draw
        would leave the host allocator's heap fragmented, as large as the whole model."""
        span = (like.storage_offset() + sum((n - 1) * s for n, s in zip(like.shape, like.stride())) + 1) \
            * like.element_size() if like.numel() else 0
        if self._buffer.numel() < span:
            self._buffer = torch.empty(0, dtype=torch.uint8, device=self.device)  # freed before the larger one
            self._buffer = torch.empty(-(-span // 16) * 16, dtype=torch.uint8, device=self.device)
        return self._buffer.view(like.dtype).as_strided(like.shape, like.stride(), like.storage_offset())

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        if self._inside is not None:
            return func(*args, **kwargs)  # inside a recorded torch.nn.init call, or its scratch run
        if func in _UNINITIALISED and torch.device(kwargs.get("device") or "cpu").type == self.device.type:
            return func(*args, **{**kwargs, "device": torch.device("meta")})
        seeded = torch.Tag.nondeterministic_seeded in func.tags
        written = [t for t in _written(func, args, kwargs) if t.is_meta]
        if written:
            self._record_write(func, args, kwargs, written, seeded)
        elif seeded and _has_meta((args, kwargs)):
            raise DeferredInitError(f"{func} draws random numbers shaped after a tensor on the meta device")
        result = func(*args, **kwargs)
        if seeded and not written and _has_meta(result):
            raise DeferredInitError(f"{func} draws random numbers into a new tensor on the meta device")
        return result

    def _record_write(self, func: Any, args: tuple, kwargs: dict, written: list[torch.Tensor], seeded: bool) -> None:
        target = args[0] if args and isinstance(args[0], torch.Tensor) else None
        if written != [target]:
            raise DeferredInitError(f"{func} writes into a meta tensor through an out= argument")
        if _has_meta((args[1:], kwargs)):
            raise DeferredInitError(f"{func} computes a value from other tensors on the meta device "
                                    "(e.g. copies one parameter into another)")
        self._record(func, target, tuple(args[1:]), kwargs, seeded, seeded or func in _OVERWRITES)

    def _record(self, call: Callable[..., Any], target: torch.Tensor, args: tuple, kwargs: dict, seeded: bool,
                overwrites: bool) -> None:
        """Add ``call(target, *args, **kwargs)`` to ``target``'s steps; a random one is
        also run once on a scratch tensor, the draw a build on the device makes, so that
        the generator ends where that build's does."""
        if kwargs.get("generator") is not None:
            raise DeferredInitError(f"{getattr(call, '__name__', call)} draws from its own torch.Generator, "
                                    "whose state is not recorded")
        rng_state = None
        if seeded:
            rng_state = self.generator.get_state()
            inside, self._inside = self._inside, True
            try:
                call(self._scratch(target), *args, **kwargs)
            finally:
                self._inside = inside
        self._append(target, InitStep(call, args, dict(kwargs), rng_state), overwrites)

    def _append(self, target: torch.Tensor, step: InitStep, overwrites: bool) -> None:
        storage = target.untyped_storage()
        entry = self.entries.get(storage._cdata)
        if entry is not None and entry.geometry != _geometry(target):
            raise DeferredInitError("an initialisation writes into part of a tensor through a view "
                                    "(e.g. nn.Embedding's padding_idx row)")
        if overwrites:
            # Whatever came before no longer matters.
            self.entries[storage._cdata] = _Entry(storage, _geometry(target), [step])
        elif entry is None:
            # Modifies unspecified contents: no steps, so ``steps_of`` refuses the tensor.
            self.entries[storage._cdata] = _Entry(storage, _geometry(target), [])
        elif entry.steps:
            entry.steps.append(step)

    def steps_of(self, tensor: torch.Tensor) -> list[InitStep] | None:
        """The steps that give ``tensor`` its full value, or None if nothing does."""
        entry = self.entries.get(tensor.untyped_storage()._cdata)
        if entry is None or entry.geometry != _geometry(tensor) or not entry.steps:
            return None
        return entry.steps


def _collect(model: nn.Module, recorder: _Recorder) -> dict[str, TensorInit]:
    """Every parameter and buffer's recipe by name; tensors built with values keep them."""
    tensors: dict[str, TensorInit] = {}
    named = [*model.named_parameters(remove_duplicate=False), *model.named_buffers(remove_duplicate=False)]
    for name, tensor in named:
        if tensor.is_meta:
            steps = recorder.steps_of(tensor)
            if steps is None:
                raise DeferredInitError(f"'{name}' is not initialised in place after torch.empty")
        else:
            steps = [InitStep(aten.copy_.default, (tensor.detach(),), {})]
        tensors[name] = TensorInit(tensor.shape, tensor.stride(), tensor.dtype, steps)
    for module_name, module in model.named_modules():
        for attr, value in vars(module).items():
            if isinstance(value, torch.Tensor) and value.is_meta:
                raise DeferredInitError(f"'{module_name}.{attr}' is a tensor on the meta device that is neither "
                                        "a parameter nor a buffer")
    return tensors


def record_build(build: Callable[[], nn.Module], device: torch.device) -> tuple[nn.Module, InitRecord]:
    """Run ``build()`` with its parameters on the meta device; return the model and the
    record that computes their values on ``device`` exactly as ``with device: build()``.

    Raises ``DeferredInitError`` (with the random generators as they were before) when
    the builder does not follow the protocol in this module's docstring.
    """
    generator = device_generator(device)
    states = torch.get_rng_state(), generator.get_state()
    try:
        recorder = _Recorder(device)
        with torch.device(device), recorder, recorder.watching_init_calls():
            model = build()
        if recorder.problem is not None:
            raise recorder.problem
        tensors = _collect(model, recorder)
    except Exception as failure:
        torch.set_rng_state(states[0])
        generator.set_state(states[1])
        if isinstance(failure, DeferredInitError):
            raise
        # E.g. a builder that reads values (meta tensors have none); a fault of the
        # builder itself shows again when it runs on the device.
        raise DeferredInitError(f"the builder failed on the meta device: {failure!r}") from failure
    return model, InitRecord(device, tensors, generator.get_state())
