"""How a rank's host is named in what a run reports: stragglers, hangs, run.json.

Hosts of one job often share a hostname (containers, network namespaces), so a hostname
alone can name two machines. The address a host uses to reach the job's master tells
them apart: it is the source address of the route to ``MASTER_ADDR`` (set for every
worker by torch's agent, torchrun and Kubeflow, derived from the nodelist under Slurm),
so a host is named ``node1 (10.0.0.2)``. With no master to reach (one process), or one
reached over loopback (every rank on one host), the hostname alone names it.

Each rank finds its own label once at start; ``gather_host_labels`` brings every rank's
label to every rank in one collective, and the label list, indexed by rank, is then
passed to what names ranks (the per-rank window, the hang watchdog, run.json).
"""

from __future__ import annotations

import ipaddress
import os
import socket
from typing import Mapping, Sequence

import torch.distributed as dist

from meshyard.runtime.environment import detect_environment
from meshyard.runtime.network import NetworkError, route_to


def master_address(env: Mapping[str, str] | None = None) -> str:
    """The job master's host as this process was told it: ``MASTER_ADDR``, or under
    Slurm the first host of the nodelist; empty for a process outside a job."""
    env = os.environ if env is None else env
    if env.get("MASTER_ADDR"):
        return env["MASTER_ADDR"]
    cluster = detect_environment(env)
    return cluster.master_addr if cluster is not None else ""


def host_label(env: Mapping[str, str] | None = None) -> str:
    """This host's name in reports: ``hostname (address)``, where the address is this
    host's end of the route to the job's master, or the hostname alone when there is no
    master, no route to it, or the route is loopback."""
    env = os.environ if env is None else env
    hostname = socket.gethostname()
    master = master_address(env)
    if not master:
        return hostname
    try:
        local = route_to(master, _port(env.get("MASTER_PORT", ""))).local_addr
    except (NetworkError, OSError, ValueError):  # naming a host must never stop a run
        return hostname
    if ipaddress.ip_address(local.split("%")[0]).is_loopback:
        return hostname  # the master is on this host: the address adds nothing
    return f"{hostname} ({local})"


def _port(text: str) -> int:
    return int(text) if text.isdigit() and int(text) < 65536 else 0


def gather_host_labels(label: str | None = None) -> list[str]:
    """Every rank's host label, indexed by rank, on every rank (one ``all_gather_object``
    on the default group: a collective, so every rank calls it at the same point).
    ``label`` is this rank's, ``host_label()`` when not given."""
    label = host_label() if label is None else label
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return [label]
    labels: list[str | None] = [None] * dist.get_world_size()
    dist.all_gather_object(labels, label)
    return [str(each) for each in labels]


def rank_on_host(rank: int, host: str = "") -> str:
    """``rank 3 on node1 (10.0.0.2)``, or ``rank 3`` when its host is not known."""
    return f"rank {rank} on {host}" if host else f"rank {rank}"


def host_of(hosts: Sequence[str], rank: int) -> str:
    """``hosts[rank]``, or empty when the list (indexed by rank) does not cover ``rank``."""
    return hosts[rank] if 0 <= rank < len(hosts) else ""
