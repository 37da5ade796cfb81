"""Time of one collective: ring volumes over the slowest link the group crosses.

Volumes are those of the ring algorithms (Patarasuk & Yuan 2009; NCCL's "bus
bandwidth"): for a buffer of ``M`` bytes over ``n`` ranks each rank sends

- all-reduce: ``2 (n - 1) / n x M`` (a reduce-scatter then an all-gather);
- all-gather and reduce-scatter: ``(n - 1) / n x M`` (``M`` is the full, unsharded size);
- all-to-all: ``(n - 1) / n x M`` (``M`` is what one rank sends and receives; it keeps its
  own 1/n), every peer at once, so its latency is one hop's;
- point-to-point: ``M``.

Time is ``volume / bandwidth + hops x latency``. The bandwidth is the group's slowest
link: inside a node the GPU's own link (NVLink, PCIe); across nodes the node's network
bandwidth shared by the groups of the same kind that communicate at once, which is
``node bandwidth x k / gpus_per_node`` for a group with ``k`` ranks on each node (a
full-node group gets every NIC; one rank per node gets one rail). Ranks are laid out
as meshyard's DeviceMesh does: ``pp``, ``dp_replicate``, ``dp_shard``, ``tp``, with ``tp``
innermost (adjacent ranks); under expert parallelism ``dp_shard`` is ``dp_shard / ep`` outer
ranks times ``ep`` inner ones. Latency counts ring hops inside a node and a tree's
``2 log2(nodes)`` hops across nodes, as NCCL switches to trees at scale.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Literal

from meshyard.plan.hardware import Cluster

Collective = Literal["all_reduce", "all_gather", "reduce_scatter", "all_to_all", "p2p"]


def ring_factor(kind: Collective, n: int) -> float:
    """Bytes each rank sends per byte of the buffer, for the ring algorithm."""
    if kind == "p2p":
        return 1.0
    if n <= 1:
        return 0.0
    if kind == "all_reduce":
        return 2.0 * (n - 1) / n
    return (n - 1) / n


@dataclass(frozen=True)
class GroupPlacement:
    """Where a process group's ranks sit: how many per node, over how many nodes."""

    size: int
    ranks_per_node: int
    nodes: int

    @property
    def crosses_nodes(self) -> bool:
        return self.nodes > 1


def place_group(size: int, stride: int, gpus_per_node: int) -> GroupPlacement:
    """Placement of a group of ``size`` ranks ``stride`` apart (node-aligned start)."""
    if size <= 1:
        return GroupPlacement(size=max(size, 1), ranks_per_node=1, nodes=1)
    if stride >= gpus_per_node:
        return GroupPlacement(size=size, ranks_per_node=1, nodes=size)
    per_node = max(1, min(size, gpus_per_node // stride))
    return GroupPlacement(size=size, ranks_per_node=per_node, nodes=math.ceil(size / per_node))


def group_bandwidth(cluster: Cluster, group: GroupPlacement) -> float:
    """Achievable bus bandwidth (bytes/s) of a collective over ``group``."""
    intra = cluster.intra.bandwidth * cluster.link_efficiency
    if not group.crosses_nodes:
        return intra
    share = cluster.inter.bandwidth * group.ranks_per_node / cluster.gpus_per_node
    return min(intra, share * cluster.link_efficiency)


def group_latency(cluster: Cluster, kind: Collective, group: GroupPlacement) -> float:
    """Seconds of per-hop latency for one collective over ``group``."""
    if group.size <= 1:
        return 0.0
    if kind in ("p2p", "all_to_all"):
        return cluster.inter.latency if group.crosses_nodes else cluster.intra.latency
    phases = 2 if kind == "all_reduce" else 1
    intra_hops = group.ranks_per_node - 1
    inter_hops = 2 * math.ceil(math.log2(group.nodes)) if group.crosses_nodes else 0
    return phases * (intra_hops * cluster.intra.latency + inter_hops * cluster.inter.latency)


def collective_time(cluster: Cluster, kind: Collective, nbytes: float, group: GroupPlacement) -> float:
    """Seconds for one ``kind`` collective on a buffer of ``nbytes`` (full size) over ``group``."""
    if group.size <= 1 or nbytes <= 0:
        return 0.0
    volume = ring_factor(kind, group.size) * nbytes
    return volume / group_bandwidth(cluster, group) + group_latency(cluster, kind, group)


def p2p_time(cluster: Cluster, nbytes: float, crosses_nodes: bool) -> float:
    """Seconds to send ``nbytes`` to a neighbour (pipeline stages). Every GPU of a node
    sends at once across a stage boundary, so each gets 1/gpus_per_node of the NICs."""
    if nbytes <= 0:
        return 0.0
    if crosses_nodes:
        bandwidth = cluster.inter.bandwidth / cluster.gpus_per_node * cluster.link_efficiency
        return nbytes / bandwidth + cluster.inter.latency
    return nbytes / (cluster.intra.bandwidth * cluster.link_efficiency) + cluster.intra.latency


@dataclass(frozen=True)
class MeshPlacement:
    """Placements of every process group of a layout on a cluster."""

    tp: GroupPlacement
    dp_shard: GroupPlacement
    dp_replicate: GroupPlacement
    dp: GroupPlacement
    """All data-parallel ranks together (DDP and ZeRO-1 reduce over it)."""
    pp_crosses_nodes: bool
    ep: GroupPlacement = GroupPlacement(1, 1, 1)
    """The ranks that exchange tokens all-to-all (expert parallelism; inner part of dp_shard)."""
    expert_dp_shard: GroupPlacement = GroupPlacement(1, 1, 1)
    """The ranks that shard the same experts (dp_shard / ep of them, ep x tp apart)."""


def place_mesh(cluster: Cluster, dp_replicate: int, dp_shard: int, tp: int, pp: int, ep: int = 1) -> MeshPlacement:
    """Placements for a (pp, dp_replicate, dp_shard, tp) mesh, tp innermost; with ``ep`` > 1
    dp_shard is (dp_shard / ep, ep), the expert-parallel ranks inside."""
    gpn = cluster.gpus_per_node
    stage_size = dp_replicate * dp_shard * tp
    return MeshPlacement(
        ep=place_group(ep, tp, gpn),
        expert_dp_shard=place_group(dp_shard // ep, ep * tp, gpn),
        tp=place_group(tp, 1, gpn),
        dp_shard=place_group(dp_shard, tp, gpn),
        dp_replicate=place_group(dp_replicate, tp * dp_shard, gpn),
        dp=place_group(dp_replicate * dp_shard, tp, gpn),
        # The pipeline runs at the pace of its slowest boundary: one that crosses nodes
        # exists as soon as the whole mesh does not fit in one node.
        pp_crosses_nodes=pp > 1 and pp * stage_size > gpn,
    )
