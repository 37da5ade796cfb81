"""Start N workers on this machine through torch.distributed's elastic agent.

Using the agent (``torch.distributed.launcher.api``, the engine behind torchrun) rather
than plain ``multiprocessing`` gives rendezvous, failure detection and worker restarts
(``fault.max_restarts``) for free.
"""

from __future__ import annotations

import socket
import uuid
from typing import Any, Callable

from torch.distributed.elastic.multiprocessing.api import SignalException
from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
from torch.distributed.launcher.api import LaunchConfig, elastic_launch


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


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def launch_local(entrypoint: Callable[..., Any], args: tuple, nproc: int, max_restarts: int = 0,
                 grace_period_s: float = 30.0) -> dict[int, Any]:
    """Run ``entrypoint(*args)`` in ``nproc`` local processes; returns each rank's return value.

    When this process is told to stop (SIGTERM, SIGINT), the agent passes the signal on to
    the workers and gives them ``grace_period_s`` to save before killing them.
    """
    config = LaunchConfig(
        min_nodes=1,
        max_nodes=1,
        nproc_per_node=nproc,
        run_id=f"meshyard-{uuid.uuid4().hex[:8]}",
        rdzv_backend="c10d",
        rdzv_endpoint=f"127.0.0.1:{free_port()}",
        max_restarts=max_restarts,
        monitor_interval=0.2,
        start_method="spawn",
        shutdown_timeout=max(1, int(grace_period_s)),
    )
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
