"""Start N workers on this machine through torch.distributed's elastic agent, alone or
as one node of a multi-node job (``meshyard.launch.nodes``).

Using the agent (``torch.distributed.elastic``, the engine behind torchrun) rather than
plain ``multiprocessing`` gives rendezvous, failure detection, worker restarts
(``fault.max_restarts``) and signal forwarding for free; ``meshyard.launch.agent`` keeps
it from restarting preempted workers. A one-node run's rendezvous store listens on
127.0.0.1 only (``meshyard.launch.rendezvous``).

The agent reports a failed worker in its own way: a multi-line log record per failure,
each line prefixed (``E1123 ... api.py:836] ...``), holding the worker's traceback.
meshyard tells a failure in one paragraph (``meshyard.fault.failure``) and keeps the
traceback in the rank's log, so the agent's records are kept off the console here and
in the workers (``quiet_agent_logs``); a launch with a run directory keeps them in
``logs/agent.log``.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import sys
import time
import uuid
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Callable, Iterator, Sequence

from torch.distributed.elastic.multiprocessing.api import SignalException
from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
from torch.distributed.elastic.rendezvous.api import RendezvousClosedError, RendezvousError
from torch.distributed.launcher.api import LaunchConfig

from meshyard.config.load import ConfigError
from meshyard.errors import EXIT_BAD_INPUT
from meshyard.fault.failure import (RankFailed, WorkerFailure, exit_description, first_failure, first_line,
                                    recorded_bad_input)
from meshyard.fault.preemption import EXIT_PREEMPTED
from meshyard.launch.agent import run_agent
from meshyard.launch.nodes import Nodes, bind_interface, network_note, node_launch_config
from meshyard.launch.rendezvous import BACKEND, LOOPBACK, register_backend
from meshyard.run_dir import RunDir

# Signals on which the agent stops its workers whatever the config says (torch's own
# default set); the configured preemption signals are added to them.
AGENT_SIGNALS = ("SIGTERM", "SIGINT", "SIGHUP", "SIGQUIT")
# Before torch 2.12 the agent's wait between passing a signal on and SIGKILL is fixed.
FIXED_SHUTDOWN_TIMEOUT_S = 30
# The loggers of the elastic agent, the launcher API and torch.multiprocessing's spawn
# ("Terminating process ... via signal SIGTERM" when one worker took the others down).
AGENT_LOGGERS = ("torch.distributed.elastic", "torch.distributed.launcher", "torch.multiprocessing")


class LauncherStopped(RuntimeError):
    """This process got a stop signal; the workers were given the grace period and stopped."""

    def __init__(self, signal_number: int) -> None:
        super().__init__(f"stopped by signal {signal_number}")
        self.signal_number = signal_number


def _is_agent_record(record: logging.LogRecord) -> bool:
    return any(record.name == name or record.name.startswith(name + ".") for name in AGENT_LOGGERS)


@contextmanager
def quiet_agent_logs(log_file: Path | None = None) -> Iterator[None]:
    """Keep the agent's log records off the console while the block runs (into
    ``log_file`` when given); every other record is shown as before.

    The agent's loggers each set their own level, and their records reach the console
    through handlers of ``torch.distributed`` and ``torch`` (which propagate no further),
    so a filter goes on each handler those records pass, whatever logger created later.
    """
    handlers = {handler for name in AGENT_LOGGERS for handler in _handlers_reached(logging.getLogger(name))}
    for handler in handlers:
        handler.addFilter(_keep_off_console)
    kept = None
    if log_file is not None:
        log_file.parent.mkdir(parents=True, exist_ok=True)
        kept = logging.FileHandler(log_file, delay=True)  # no empty file when the agent says nothing
        kept.setFormatter(logging.Formatter("%(asctime)s %(name)s %(levelname)s %(message)s"))
        for name in AGENT_LOGGERS:
            logging.getLogger(name).addHandler(kept)
    try:
        yield
    finally:
        for handler in handlers:
            handler.removeFilter(_keep_off_console)
        if kept is not None:
            for name in AGENT_LOGGERS:
                logging.getLogger(name).removeHandler(kept)
            kept.close()


def _keep_off_console(record: logging.LogRecord) -> bool:
    return not _is_agent_record(record)


def _handlers_reached(logger: logging.Logger | None) -> list[logging.Handler]:
    """The handlers a record of ``logger`` passes through: its own and its parents' up
    to the first that does not propagate (Python's last-resort handler aside)."""
    found: list[logging.Handler] = []
    while logger is not None:
        found.extend(logger.handlers)
        if not logger.propagate:
            break
        logger = logger.parent
    return found


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
                 grace_period_s: float = 30.0, signals: Sequence[str] = (),
                 run_dir: Path | None = None, nodes: Nodes | None = None) -> dict[int, Any]:
    """Run ``entrypoint(*args)`` in ``nproc`` local processes (this node's share of
    ``nodes`` when given); returns each local rank's return value by global rank.

    When this process is told to stop (SIGTERM, SIGINT, or any of ``signals``), the agent
    passes the signal on to the workers, gives them ``grace_period_s`` to save, kills
    those still running, and ``LauncherStopped`` is raised. A failed worker raises
    ``WorkerFailure`` telling the first failure in one paragraph (``run_dir``: where
    the workers record their failures, and ``logs/agent.log`` goes); preempted workers
    (all exited ``EXIT_PREEMPTED``) raise it with those exit codes, and a worker that
    found the input wrong raises its ``ConfigError`` here.
    """
    config = launch_config(nproc, max_restarts, grace_period_s, signals)
    chosen: list[str] = []
    if nodes is not None:
        config, chosen = _join_nodes(config, nodes, run_dir)
    started = time.time()
    try:
        with quiet_agent_logs(RunDir(run_dir).agent_log if run_dir is not None else None):
            outcome = run_agent(config, entrypoint, args)
    except SignalException as exc:
        raise LauncherStopped(int(exc.sigval)) from None
    except ChildFailedError as exc:
        codes = [f.exitcode for f in exc.failures.values()]
        bad_input = recorded_bad_input(run_dir, config.run_id, started) if EXIT_BAD_INPUT in codes else None
        if bad_input is not None:
            raise ConfigError(*bad_input) from None
        raise WorkerFailure(_failure_paragraph(exc, run_dir, config, started), codes) from None
    except RendezvousError as exc:
        raise WorkerFailure(_rendezvous_paragraph(exc, nodes), []) from None
    finally:
        for name in chosen:  # the workers had them; this process's caller gets its environment back
            os.environ.pop(name, None)
    if outcome.preempted:
        raise WorkerFailure("the workers were preempted", [EXIT_PREEMPTED] * nproc)
    if outcome.not_needed:
        print(f"meshyard: this node was not needed: {nodes.describe() if nodes else 'the job'} started with "
              "its maximum of nodes without it", flush=True)
    return outcome.return_values


def _join_nodes(config: LaunchConfig, nodes: Nodes, run_dir: Path | None) -> tuple[LaunchConfig, list[str]]:
    """This node's settings in the job of ``nodes``; the interface variables it set for
    the workers (to be given back after). What it found goes to the console and to
    ``logs/agent.log``."""
    chosen = bind_interface(nodes.route, os.environ)
    note = network_note(nodes, os.environ)
    print(note, flush=True)
    if run_dir is not None:
        log = RunDir(run_dir).agent_log
        log.parent.mkdir(parents=True, exist_ok=True)
        with log.open("a") as out:
            out.write(f"{time.strftime('%Y-%m-%d %H:%M:%S')} {note}\n")
    return node_launch_config(nodes, config), chosen


def _rendezvous_paragraph(exc: RendezvousError, nodes: Nodes | None) -> str:
    where = nodes.describe() if nodes is not None else "the local rendezvous"
    if isinstance(exc, RendezvousClosedError):
        return (f"the job ({where}) was ended by another node, which gave up or finished; its console output "
                "says why. Start every node again to run the job again")
    # torch's messages often say "see inner exception": the cause is what names the problem.
    details = [first_line(str(error)) for error in (exc, exc.__cause__) if error is not None and str(error)]
    said = "; ".join(details) or "not enough nodes joined in time"
    return (f"the nodes did not meet ({where}): {type(exc).__name__}: {said}. "
            "Every node must run the same command (the same --nnodes, --rdzv-endpoint and --rdzv-id) within "
            "run.rdzv_timeout_s of each other, and reach the endpoint's host and port")


def _failure_paragraph(exc: ChildFailedError, run_dir: Path | None, config: LaunchConfig, since: float) -> str:
    """The first failure: the earliest one recorded by a rank that raised in the last
    attempt (another rank may have been noticed first, failing after it: a collective
    with a dead peer), else how the first rank the agent noticed ended. The agent gives
    up only once its restarts are spent, so the last attempt is restart ``max_restarts``."""
    rank, failure = exc.get_first_failure()
    recorded = first_failure(run_dir, config.run_id, config.max_restarts, since) if run_dir is not None else None
    if recorded is not None:
        return recorded
    if not os.path.isfile(failure.error_file):  # it did not raise: killed, or exited on purpose
        return exit_description(rank, failure.exitcode, run_dir)
    message = failure.message
    if isinstance(message, dict):
        message = message.get("message", str(message))
    # The agent's copy is "Type: message"; a worker's own paragraph came as a RankFailed.
    prefix = f"{RankFailed.__name__}: "
    return message[len(prefix):] if message.startswith(prefix) else f"rank {rank} failed: {first_line(message)}"
