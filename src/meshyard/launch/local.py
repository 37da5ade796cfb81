"""Start N workers on this machine through torch.distributed's elastic agent.

Using the agent (``torch.distributed.launcher.api``, the engine behind torchrun) rather
than plain ``multiprocessing`` gives rendezvous, failure detection and worker restarts
(``run.max_restarts``) for free.
"""

from __future__ import annotations

import socket
import uuid
from typing import Any, Callable

from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
from torch.distributed.launcher.api import LaunchConfig, elastic_launch


class WorkerFailure(RuntimeError):
    """A worker exited with an error; the message names the rank and the cause."""


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def launch_local(entrypoint: Callable[..., Any], args: tuple, nproc: int, max_restarts: int = 0) -> dict[int, Any]:
    """Run ``entrypoint(*args)`` in ``nproc`` local processes; returns each rank's return value."""
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
    )
    try:
        return elastic_launch(config, entrypoint)(*args)
    except ChildFailedError as exc:
        rank, failure = exc.get_first_failure()
        message = failure.message
        if isinstance(message, dict):
            message = message.get("message", str(message))
        raise WorkerFailure(f"worker rank {rank} failed (exit code {failure.exitcode}): {message}") from None
