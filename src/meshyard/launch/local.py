"""Start N workers on this machine through torch.distributed's elastic agent.

Using the agent (``torch.distributed.launcher.api``, the engine behind torchrun) rather
than plain ``multiprocessing`` gives rendezvous, failure detection, worker restarts
(``fault.max_restarts``) and signal forwarding for free. The rendezvous store listens on
127.0.0.1 only (``meshyard.launch.rendezvous``).
"""

from __future__ import annotations

import dataclasses
import sys
import uuid
from typing import Any, Callable, Sequence

from torch.distributed.elastic.multiprocessing.api import SignalException
from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
from torch.distributed.launcher.api import LaunchConfig, elastic_launch

from meshyard.launch.rendezvous import BACKEND, LOOPBACK, register_backend

# Signals on which the agent stops its workers whatever the config says (torch's own
# default set); the configured preemption signals are added to them.
AGENT_SIGNALS = ("SIGTERM", "SIGINT", "SIGHUP", "SIGQUIT")
# Before torch 2.12 the agent's wait between passing a signal on and SIGKILL is fixed.
FIXED_SHUTDOWN_TIMEOUT_S = 30


class LauncherStopped(RuntimeError):
    """This process got a stop signal; the workers were given the grace period and stopped."""

    def __init__(self, signal_number: int) -> None:
        super().__init__(f"stopped by signal {signal_number}")
        self.signal_number = signal_number


class WorkerFailure(RuntimeError):
    """A worker exited with an error; the message names the rank and the cause."""

    def __init__(self, message: str, exit_codes: list[int]) -> None:
        super().__init__(message)
        self.exit_codes = exit_codes


def launch_config(nproc: int, max_restarts: int = 0, grace_period_s: float = 30.0,
                  signals: Sequence[str] = ()) -> LaunchConfig:
    """The elastic agent's settings for ``nproc`` workers on this machine.

    Every signal in ``signals`` is handled by the agent like SIGTERM: passed on to each
    worker, which then has ``grace_period_s`` to save and exit before it is killed.
    """
    register_backend()
    options: dict[str, Any] = dict(
        min_nodes=1,
        max_nodes=1,
        nproc_per_node=nproc,
        run_id=f"meshyard-{uuid.uuid4().hex[:8]}",
        rdzv_backend=BACKEND,
        rdzv_endpoint=LOOPBACK,
        max_restarts=max_restarts,
        monitor_interval=0.2,
        start_method="spawn",
        signals_to_handle=",".join(dict.fromkeys([*AGENT_SIGNALS, *signals])),
    )
    if "shutdown_timeout" in {f.name for f in dataclasses.fields(LaunchConfig)}:  # torch >= 2.12
        options["shutdown_timeout"] = max(1, int(grace_period_s))
    elif grace_period_s > FIXED_SHUTDOWN_TIMEOUT_S:
        print(f"meshyard: this torch's elastic agent kills workers {FIXED_SHUTDOWN_TIMEOUT_S} s after passing on a "
              f"stop signal, sooner than fault.grace_period_s = {grace_period_s:g}; torch 2.12 or later honours it",
              file=sys.stderr, flush=True)
    return LaunchConfig(**options)


def launch_local(entrypoint: Callable[..., Any], args: tuple, nproc: int, max_restarts: int = 0,
                 grace_period_s: float = 30.0, signals: Sequence[str] = ()) -> dict[int, Any]:
    """Run ``entrypoint(*args)`` in ``nproc`` local processes; returns each rank's return value.

    When this process is told to stop (SIGTERM, SIGINT, or any of ``signals``), the agent
    passes the signal on to the workers, gives them ``grace_period_s`` to save, kills
    those still running, and ``LauncherStopped`` is raised.
    """
    config = launch_config(nproc, max_restarts, grace_period_s, signals)
    try:
        return elastic_launch(config, entrypoint)(*args)
    except SignalException as exc:
        raise LauncherStopped(int(exc.sigval)) from None
    except ChildFailedError as exc:
        rank, failure = exc.get_first_failure()
        message = failure.message
        if isinstance(message, dict):
            message = message.get("message", str(message))
        codes = [f.exitcode for f in exc.failures.values()]
        raise WorkerFailure(f"worker rank {rank} failed (exit code {failure.exitcode}): {message}", codes) from None
