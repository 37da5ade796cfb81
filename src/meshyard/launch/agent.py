"""torch's elastic agent, told that a preempted worker is not a failed one.

The agent restarts a worker group whose worker exited non-zero, as long as
``max_restarts`` allows. A worker that saved and exited with ``EXIT_PREEMPTED`` was told to
stop (a signal on any rank of any node); restarting it would start training again on a
node that is being taken away, or rendezvous with nodes that are already gone. Here such
a group ends at once: every local worker exited ``EXIT_PREEMPTED``, nothing is restarted,
no exit barrier is awaited (the other nodes are stopping too), and the outcome says so.
Nor is a group restarted whose worker found the input wrong (``EXIT_BAD_INPUT``): the
same input fails the same way again.

``run_agent`` does what ``torch.distributed.launcher.api.launch_agent`` does for one
role, with this agent in place of the plain one.
"""

from __future__ import annotations

import os
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator

from torch.distributed.elastic.agent.server.api import RunResult, WorkerGroup, WorkerSpec, WorkerState
from torch.distributed.elastic.agent.server.local_elastic_agent import LocalElasticAgent
from torch.distributed.elastic.multiprocessing import DefaultLogsSpecs
from torch.distributed.elastic.multiprocessing.api import SignalException
from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
from torch.distributed.elastic.rendezvous import RendezvousParameters
from torch.distributed.elastic.rendezvous import registry as rendezvous_registry
from torch.distributed.launcher.api import LaunchConfig

from meshyard.errors import EXIT_BAD_INPUT
from meshyard.fault.preemption import EXIT_PREEMPTED
from meshyard.launch.rendezvous import NODES_BACKEND


@dataclass
class AgentOutcome:
    """How this node's workers ended: their return values by global rank, or preempted."""

    return_values: dict[int, Any] = field(default_factory=dict)
    preempted: bool = False
    not_needed: bool = False


class PreemptionAwareAgent(LocalElasticAgent):
    """A ``LocalElasticAgent`` that ends, without a restart, a group whose workers were
    preempted (every failure so far has exit code ``EXIT_PREEMPTED``)."""

    preempted = False

    def _monitor_workers(self, worker_group: WorkerGroup) -> RunResult:
        result = super()._monitor_workers(worker_group)
        failures = result.failures.values() if result.state == WorkerState.FAILED else ()
        if any(failure.exitcode == EXIT_BAD_INPUT for failure in failures):
            self._remaining_restarts = 0  # the same input fails the same way again
        if failures and all(failure.exitcode == EXIT_PREEMPTED for failure in failures):
            self.preempted = True
            # SUCCEEDED ends the agent's loop without a restart; the workers still
            # running finish their exit within the grace period when the agent shuts down.
            return RunResult(state=WorkerState.SUCCEEDED,
                             return_values={worker.global_rank: None for worker in worker_group.workers})
        return result

    def _exit_barrier(self) -> None:
        if not self.preempted:  # after a preemption, the nodes that got the signal never arrive
            super()._exit_barrier()


def run_agent(config: LaunchConfig, entrypoint: Callable[..., Any], args: tuple) -> AgentOutcome:
    """Run ``entrypoint(*args)`` in ``config.nproc_per_node`` workers on this node, through
    ``config``'s rendezvous; raises ``ChildFailedError`` when they failed for good and
    ``SignalException`` when this process was told to stop."""
    parameters = RendezvousParameters(
        backend=config.rdzv_backend, endpoint=config.rdzv_endpoint, run_id=config.run_id,
        min_nodes=config.min_nodes, max_nodes=config.max_nodes, local_addr=config.local_addr,
        **config.rdzv_configs,
    )
    master_addr, master_port = _static_master(config)
    spec = WorkerSpec(
        role=config.role, local_world_size=config.nproc_per_node, entrypoint=entrypoint, args=tuple(args),
        rdzv_handler=rendezvous_registry.get_rendezvous_handler(parameters),
        max_restarts=config.max_restarts, monitor_interval=config.monitor_interval,
        master_addr=master_addr, master_port=master_port, local_addr=config.local_addr,
    )
    # torch 2.12 gave the launcher and the agent a grace period (launch_config sets it).
    options: dict[str, Any] = {"shutdown_timeout": config.shutdown_timeout} if hasattr(config, "shutdown_timeout") else {}
    agent = PreemptionAwareAgent(spec=spec, logs_specs=config.logs_specs or DefaultLogsSpecs(),
                                 start_method=config.start_method, **options)
    close_rendezvous = True
    try:
        with _torch_settings(config):
            result = agent.run()
        if result is None:  # the rendezvous had its maximum of nodes: this one stood by and was let go
            return AgentOutcome(not_needed=True)
        if agent.preempted:
            return AgentOutcome(preempted=True)
        if result.is_failed():
            raise ChildFailedError(name=getattr(entrypoint, "__qualname__", str(entrypoint)),
                                   failures=result.failures)
        return AgentOutcome(return_values=result.return_values)
    except SignalException:
        # Closing the rendezvous would end it for every node; a stopped node leaves it open.
        close_rendezvous = False
        raise
    finally:
        if close_rendezvous:
            spec.rdzv_handler.shutdown()


def _static_master(config: LaunchConfig) -> tuple[str | None, int | None]:
    """The fixed master address of a static rendezvous (the endpoint); None otherwise."""
    if config.rdzv_backend != "static":
        return None, None
    host, _, port = config.rdzv_endpoint.rpartition(":")
    return host.strip("[]"), int(port)


@contextmanager
def _torch_settings(config: LaunchConfig) -> Iterator[None]:
    """The settings torch's agent reads from the environment, for the block's duration.

    - which signals the agent passes on to the workers (as torch's own launcher sets it);
    - with the c10d rendezvous, a fresh store for the workers every round instead of one
      shared with the rendezvous: the shared one is set up by the node that is rank 0 in
      the first round only, so a node that joins later (a lost host started again)
      waits in vain for its address and fails.
    """
    wanted = {"TORCHELASTIC_SIGNALS_TO_HANDLE": config.signals_to_handle}
    if config.rdzv_backend in ("c10d", NODES_BACKEND):
        wanted["TORCH_DISABLE_SHARE_RDZV_TCP_STORE"] = "1"
    previous = {name: os.environ.get(name) for name in wanted}
    os.environ.update(wanted)
    try:
        yield
    finally:
        for name, value in previous.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value
