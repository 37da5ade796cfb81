"""Where each step's time goes: data, forward, backward, exposed communication, optimizer.

On CPU the phases are wall-clock intervals; on GPU they are CUDA events, kept with the
step (``PhaseTimes``) and read once its figures have come back to the host, usually
while the next step runs, so timing adds no stall inside a step.

Communication overlapped with backward costs nothing and is not counted; what is counted
is the *exposed* part. Under DDP a comm hook records when each gradient bucket is handed
to the network and when its reduction completes: backward compute ends when the last
bucket is launched, and the wait from then until backward returns is exposed
communication. The per-step loss all-reduce is exposed communication too.
"""

from __future__ import annotations

import contextlib
import time
from typing import Any, Callable, Iterator

import torch
import torch.distributed as dist

from meshyard.metrics.schema import PHASES, phase_key


class CommTracker:
    """Wraps a DDP comm hook to mark bucket launches: a wall-clock time on CPU, a CUDA
    event on the compute stream on GPU (in stream order: when the bucket's gradients exist)."""

    def __init__(self, cuda: bool = False) -> None:
        self.cuda = cuda
        self.last_launch: float | None = None
        self.last_launch_event: Any = None
        self.buckets = 0

    def reset(self) -> None:
        self.last_launch, self.last_launch_event, self.buckets = None, None, 0

    def wrap(self, hook: Callable[[Any, dist.GradBucket], torch.futures.Future]) -> Callable:
        def timed_hook(state: Any, bucket: dist.GradBucket) -> torch.futures.Future:
            if self.cuda:
                self.last_launch_event = torch.cuda.Event(enable_timing=True)
                self.last_launch_event.record()
            else:
                self.last_launch = time.perf_counter()
            self.buckets += 1
            return hook(state, bucket)

        # DDP checks the hook's annotations as objects; this module's are strings.
        timed_hook.__annotations__ = {"state": object, "bucket": dist.GradBucket,
                                      "return": torch.futures.Future[torch.Tensor]}
        return timed_hook


class FSDPWaitTracker:
    """Time FSDP2 spends in each unit's pre-forward hook: waiting for (and copying out)
    its parameters' all-gather, i.e. the forward all-gather not hidden by prefetching.

    Two hooks bracket FSDP's own: one registered in front of it, one after it. (Backward
    all-gathers and reduce-scatters have no such bracket and stay inside backward.)
    """

    def __init__(self) -> None:
        self.waited = 0.0
        self._start = 0.0
        self.attached = False  # whether any FSDP unit carries the hooks

    def attach(self, model: torch.nn.Module) -> None:
        from torch.distributed.fsdp import FSDPModule

        for module in model.modules():
            if isinstance(module, FSDPModule):
                module.register_forward_pre_hook(self._before, prepend=True)
                module.register_forward_pre_hook(self._after)
                self.attached = True

    def _before(self, module: torch.nn.Module, args: Any) -> None:
        self._start = time.perf_counter()

    def _after(self, module: torch.nn.Module, args: Any) -> None:
        self.waited += time.perf_counter() - self._start

    def take(self) -> float:
        waited, self.waited = self.waited, 0.0
        return waited


class PhaseTimes:
    """One step's phase durations, as measured while it ran: seconds on CPU, pairs of
    CUDA events on GPU that are read only in ``seconds`` (when the step has completed), so
    a step can be closed while its kernels still run and read one step later."""

    def __init__(self) -> None:
        self.totals: dict[str, float] = dict.fromkeys(PHASES, 0.0)
        self.allgather_wait = 0.0  # the part of comm that FSDP's forward all-gathers exposed
        self.events: list[tuple[str, Any, Any]] = []
        self.exposed_events: list[tuple[Any, Any]] = []
        self.fsdp = False

    def add(self, phase: str, seconds: float) -> None:
        self.totals[phase] += seconds

    def seconds(self) -> dict[str, float]:
        """Seconds per phase; with FSDP's wait tracker attached also ``allgather_wait_s``,
        the part of ``comm_s`` spent waiting for forward all-gathers (a detail of ``comm_s``,
        not one more phase). On GPU this waits for the step's last timed event."""
        totals = dict(self.totals)
        for name, begin, end in self.events:
            totals[name] += _seconds_between(begin, end)
        for launch, end in self.exposed_events:
            exposed = max(0.0, _seconds_between(launch, end))
            totals["backward"] -= exposed
            totals["comm"] += exposed
        figures = {phase_key(phase): value for phase, value in totals.items()}
        if self.fsdp:
            figures["allgather_wait_s"] = self.allgather_wait
        return figures


class StepTimer:
    """Accumulates phase durations within one step; ``NullStepTimer`` when switched off."""

    enabled = True

    def __init__(self, device: torch.device, comm: CommTracker | None = None,
                 mark: Callable[..., None] = lambda where, step=None: None) -> None:
        self.mark = mark  # tells the hang watchdog where this rank is
        self.cuda = device.type == "cuda"
        self.fsdp = FSDPWaitTracker()
        self.comm = comm or CommTracker(self.cuda)
        self._step = PhaseTimes()

    def start_step(self) -> None:
        self._step = PhaseTimes()
        self.comm.reset()

    def add(self, phase: str, seconds: float) -> None:
        self._step.add(phase, seconds)

    @contextlib.contextmanager
    def phase(self, name: str, where: str | None = None) -> Iterator[None]:
        """Time ``name``; ``where`` is the position reported to the watchdog (default: name)."""
        self.mark(where or name)
        step = self._step
        if self.cuda:
            begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            begin.record()
            yield
            end.record()
            step.events.append((name, begin, end))
            return
        start = time.perf_counter()
        yield
        step.totals[name] += time.perf_counter() - start
        if name == "forward":
            waited = self.fsdp.take()  # FSDP all-gather waits inside this forward
            step.totals["forward"] -= waited
            step.totals["comm"] += waited
            step.allgather_wait += waited

    @contextlib.contextmanager
    def backward(self) -> Iterator[None]:
        """Backward, split into compute and the exposed wait for the last gradient buckets.
        (Gradients of accumulation micro-steps are not communicated; nothing is split off.)"""
        launches_before = self.comm.buckets
        with self.phase("backward"):
            yield
        if self.comm.buckets == launches_before:
            return  # no gradient was communicated (accumulation micro-step, or no DDP)
        if self.cuda:
            end = torch.cuda.Event(enable_timing=True)
            end.record()
            self._step.exposed_events.append((self.comm.last_launch_event, end))
        elif self.comm.last_launch is not None:
            exposed = max(0.0, time.perf_counter() - self.comm.last_launch)
            self._step.totals["backward"] -= exposed
            self._step.totals["comm"] += exposed

    def close_step(self) -> PhaseTimes:
        """The step just issued, to be read (``PhaseTimes.seconds``) once it has completed;
        the next ``start_step`` measures into a fresh one."""
        self._step.fsdp = self.fsdp.attached
        return self._step


def _seconds_between(begin: Any, end: Any) -> float:
    """Seconds between two recorded CUDA events.

    ``elapsed_time`` fails unless both events have completed, so the host waits for both
    first. The Trainer reads a step's phases after its figures came back (usually one
    step later), so the wait is short or none; a bucket-launch event may sit on another
    stream than ``end``, hence the wait on ``begin`` too.
    """
    begin.synchronize()
    end.synchronize()
    return begin.elapsed_time(end) / 1000.0


class NullStepTimer:
    """Measurement off: no figures are reported; positions still reach the watchdog."""

    enabled = False
    comm = None

    def __init__(self, mark: Callable[..., None] = lambda where, step=None: None) -> None:
        self.mark = mark

    def start_step(self) -> None: ...

    def add(self, phase: str, seconds: float) -> None: ...

    @contextlib.contextmanager
    def phase(self, name: str, where: str | None = None) -> Iterator[None]:
        self.mark(where or name)
        yield

    @contextlib.contextmanager
    def backward(self) -> Iterator[None]:
        self.mark("backward")
        yield

    def close_step(self) -> PhaseTimes:
        return _NO_PHASES


class _NoPhases(PhaseTimes):
    def add(self, phase: str, seconds: float) -> None: ...

    def seconds(self) -> dict[str, float]:
        return {}


_NO_PHASES = _NoPhases()
