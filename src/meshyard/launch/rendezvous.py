"""Rendezvous backends of meshyard's launcher, registered with torch's registry.

``BACKEND``: for the workers of one machine, listening on the loopback interface only.
``NODES_BACKEND``: torch's c10d rendezvous for several nodes, with the store served by
the node that owns the endpoint (see ``node_store``).

torch's c10d rendezvous hosts two TCP stores in the launcher, its own and the one the
elastic agent shares with its workers (``MASTER_ADDR``/``MASTER_PORT``), and both listen on
every network interface. A local run has no peer outside this machine, so nothing of it
should be reachable from the network: this handler serves both roles with one store bound
to 127.0.0.1. It is registered with torch's rendezvous registry under ``BACKEND`` and used
through the elastic agent like any other backend.
"""

from __future__ import annotations

import socket
from datetime import timedelta

import torch.distributed as dist
from torch.distributed.elastic.rendezvous import (
    RendezvousConnectionError,
    RendezvousHandler,
    RendezvousInfo,
    RendezvousParameters,
    RendezvousStoreInfo,
    rendezvous_handler_registry,
)
from torch.distributed.elastic.rendezvous.c10d_rendezvous_backend import C10dRendezvousBackend
from torch.distributed.elastic.rendezvous.dynamic_rendezvous import create_handler as dynamic_handler
from torch.distributed.elastic.rendezvous.utils import parse_rendezvous_endpoint

from meshyard.config.checks import DEFAULT_RDZV_PORT
from meshyard.fault.failure import first_line

LOOPBACK = "127.0.0.1"
BACKEND = "meshyard-loopback"
DEFAULT_TIMEOUT_S = 900  # what torch's launcher puts in the rendezvous parameters by default


def loopback_store(timeout: timedelta) -> dist.TCPStore:
    """A TCPStore server on 127.0.0.1, at a port the kernel picks (so no race for a free port)."""
    listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    listener.bind((LOOPBACK, 0))
    listener.listen()
    port = listener.getsockname()[1]
    # The store takes over the bound socket; given only a port, it would bind the
    # wildcard address instead.
    return dist.TCPStore(LOOPBACK, port, is_master=True, wait_for_workers=False, timeout=timeout,
                         master_listen_fd=listener.detach())


class LoopbackRendezvous(RendezvousHandler):
    """One node (rank 0 of 1) whose store, on the loopback interface, the workers share."""

    def __init__(self, run_id: str, timeout: timedelta) -> None:
        self.run_id = run_id
        self.timeout = timeout
        self.store: dist.TCPStore | None = None
        self._closed = False

    def get_backend(self) -> str:
        return BACKEND

    @property
    def use_agent_store(self) -> bool:
        # Workers connect to this same store as clients: no second server is started.
        return True

    def next_rendezvous(self) -> RendezvousInfo:
        """The same store every round; restarted workers keep their keys apart by round."""
        if self.store is None:
            self.store = loopback_store(self.timeout)
        # The agent's own keys live under the run id, as with torch's static rendezvous.
        return RendezvousInfo(dist.PrefixStore(self.run_id, self.store), 0, 1,
                              RendezvousStoreInfo(LOOPBACK, self.store.port))

    def is_closed(self) -> bool:
        return self._closed

    def set_closed(self) -> None:
        self._closed = True

    def num_nodes_waiting(self) -> int:
        return 0  # one node: nobody ever waits to join

    def get_run_id(self) -> str:
        return self.run_id

    def shutdown(self) -> bool:
        self._closed = True
        return True


def create_handler(params: RendezvousParameters) -> LoopbackRendezvous:
    """The registry's constructor for ``BACKEND``."""
    return LoopbackRendezvous(params.run_id, timedelta(seconds=params.get_as_int("timeout", DEFAULT_TIMEOUT_S)))


def register_backend() -> None:
    """Make ``BACKEND`` known to torch's rendezvous registry (repeating it is harmless)."""
    rendezvous_handler_registry.register(BACKEND, create_handler)


NODES_BACKEND = "meshyard-c10d"
"""torch's c10d rendezvous for the nodes of a job, with the store served by the node
that owns the endpoint (``launch.nodes``) and taken over as a client when another agent
on that host serves it already."""


def node_store(params: RendezvousParameters) -> dist.TCPStore:
    """The c10d rendezvous store: served here when ``is_host`` is set and the port can
    be had, else reached as a client. torch's own backend, told ``is_host``, gives up
    when the port is taken, as it is when two agents of one job start together on the
    endpoint's host; its guess without ``is_host`` compares the endpoint with the
    hostname's address, which hosts sharing a hostname (containers, namespaces) defeat."""
    host, port = parse_rendezvous_endpoint(params.endpoint, default_port=DEFAULT_RDZV_PORT)
    timeout = timedelta(seconds=params.get_as_int("read_timeout", 60))
    for serve in ([True, False] if params.get_as_bool("is_host", False) else [False]):
        try:
            return dist.TCPStore(host, port, is_master=serve, multi_tenant=True, timeout=timeout)
        except (ValueError, RuntimeError, TimeoutError) as exc:
            if not serve:
                raise RendezvousConnectionError(
                    f"cannot reach the rendezvous store at {host}:{port} ({first_line(str(exc))})") from exc
    raise AssertionError("unreachable: the last attempt is a client's, which returns or raises")


class _NodesBackend(C10dRendezvousBackend):
    """torch's c10d state backend under this backend's name (the registry checks it)."""

    @property
    def name(self) -> str:
        return NODES_BACKEND


def create_node_handler(params: RendezvousParameters) -> RendezvousHandler:
    """The registry's constructor for ``NODES_BACKEND``."""
    store = node_store(params)
    return dynamic_handler(store, _NodesBackend(store, params.run_id), params)


def register_node_backend() -> None:
    """Make ``NODES_BACKEND`` known to torch's rendezvous registry (repeating it is harmless)."""
    rendezvous_handler_registry.register(NODES_BACKEND, create_node_handler)
