"""A job on several nodes: the same ``meshyard run`` on every node, one agent per node.

Each node's agent meets the others at the rendezvous endpoint (torch's c10d rendezvous,
``launch.rendezvous.NODES_BACKEND``; with ``run.node_rank`` given, its static one, as
torchrun does) and starts
``run.nproc`` workers. With ``run.nnodes = "MIN:MAX"`` nodes may leave and join: the
agents restart their workers (``fault.max_restarts``) with whoever is there, and the
workers resume from the newest checkpoint, resharded to the new world size.

Nothing about the network is set by hand (``meshyard.runtime.network``): each node finds
the address and interface on its route to the endpoint, serves the rendezvous store when
the endpoint is one of its own addresses, advertises that address to the others, and has
gloo and NCCL bind that interface unless the user chose one.
"""

from __future__ import annotations

import os
import socket
from dataclasses import dataclass
from typing import Any, MutableMapping

from torch.distributed.launcher.api import LaunchConfig

from meshyard.config.checks import DEFAULT_RDZV_PORT, node_range, split_endpoint
from meshyard.config.sections import RunConfig
from meshyard.launch.rendezvous import NODES_BACKEND, register_node_backend
from meshyard.runtime.network import Route, route_to

SOCKET_INTERFACE_VARIABLES = ("GLOO_SOCKET_IFNAME", "NCCL_SOCKET_IFNAME")
"""Where gloo and NCCL read the interface to bind (torch's and NCCL's own settings)."""


@dataclass(frozen=True)
class Nodes:
    """The nodes of a job, as ``[run]`` describes them, and this node's route to them."""

    min_nodes: int
    max_nodes: int
    host: str
    port: int
    rdzv_id: str
    node_rank: int
    join_timeout_s: float
    last_call_s: float
    route: Route
    serves_rendezvous: bool
    """This node's agent serves the rendezvous store: node 0 of a static job; in a c10d
    job, the node that owns the endpoint's address, unless another agent on it serves it
    already (several agents on one host)."""

    @classmethod
    def of(cls, run: RunConfig, rdzv_id: str) -> Nodes:
        """The nodes of ``run`` (its fields checked by ``config.checks``); ``rdzv_id`` is
        ``run.rdzv_id`` or, when that is empty, the scheduler's job id. Raises
        ``NetworkError`` when this node has no route to the endpoint."""
        low, high = node_range(run.nnodes) or (1, 1)
        host, port = split_endpoint(run.rdzv_endpoint) if run.rdzv_endpoint else ("127.0.0.1", DEFAULT_RDZV_PORT)
        route = route_to(host, port)
        serves = run.node_rank == 0 if run.node_rank >= 0 else route.is_local and port_is_free(route.endpoint_addr, port)
        return cls(low, high, host, port, rdzv_id, run.node_rank, run.rdzv_timeout_s, run.rdzv_last_call_s,
                   route, serves)

    @property
    def endpoint(self) -> str:
        return f"[{self.host}]:{self.port}" if ":" in self.host else f"{self.host}:{self.port}"

    @property
    def static(self) -> bool:
        """Ranks fixed by ``run.node_rank``: torch's static rendezvous, node 0 serves it."""
        return self.node_rank >= 0

    def describe(self) -> str:
        count = f"{self.min_nodes}" if self.min_nodes == self.max_nodes else f"{self.min_nodes} to {self.max_nodes}"
        return f"{count} nodes meeting at {self.endpoint} as '{self.rdzv_id}'"


def port_is_free(address: str, port: int) -> bool:
    """Whether a server could listen on ``address:port`` now (connections closing on it do
    not count: the store binds with SO_REUSEADDR too)."""
    family = socket.AF_INET6 if ":" in address else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as probe:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            probe.bind((address, port))
        except OSError:
            return False
    return True


def node_launch_config(nodes: Nodes, base: LaunchConfig) -> LaunchConfig:
    """``base`` (this node's settings: workers, restarts, signals, grace period) turned
    into its part of the multi-node job."""
    register_node_backend()
    if nodes.static:
        configs: dict[str, Any] = {"rank": nodes.node_rank, "timeout": int(nodes.join_timeout_s)}
    else:
        configs = {"is_host": nodes.serves_rendezvous, "join_timeout": int(nodes.join_timeout_s),
                   "last_call_timeout": max(1, int(nodes.last_call_s))}
    base.min_nodes, base.max_nodes = nodes.min_nodes, nodes.max_nodes
    base.run_id = nodes.rdzv_id
    base.rdzv_backend = "static" if nodes.static else NODES_BACKEND
    base.rdzv_endpoint = nodes.endpoint
    base.rdzv_configs = configs
    base.local_addr = nodes.route.local_addr
    return base


def bind_interface(route: Route, environ: MutableMapping[str, str]) -> list[str]:
    """Have gloo and NCCL bind the interface on ``route``, unless ``environ`` names one
    already; returns the variables set (the workers inherit them)."""
    chosen = []
    for name in SOCKET_INTERFACE_VARIABLES:
        if not environ.get(name):
            environ[name] = route.interface
            chosen.append(name)
    return chosen


def network_note(nodes: Nodes, environ: MutableMapping[str, str]) -> str:
    """One line for the console and the agent's log: what this node found and uses."""
    route = nodes.route
    serves = "serves the rendezvous" if nodes.serves_rendezvous else "joins it"
    interfaces = ", ".join(f"{name}={environ.get(name, '')}" for name in SOCKET_INTERFACE_VARIABLES)
    return (f"meshyard: {nodes.describe()}; this node is {route.local_addr} on {route.interface} and {serves} "
            f"({interfaces}; pid {os.getpid()})")
