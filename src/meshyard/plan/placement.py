"""Topology-aware placement of a job's GPUs on the free GPUs of a cluster's nodes.

The inventory (a TOML file, ``meshyard.plan.inventory.load_inventory``) lists each node's free GPUs, their
memory and the node's network path, widest domain first (``["spine-1", "leaf-3"]``).
``place`` chooses, in this order of preference:

1. one node, the one that fits with the fewest free GPUs (best fit: larger free
   blocks stay whole for jobs that need them);
2. otherwise the narrowest domain that has enough free GPUs (a leaf before a spine
   before the whole cluster), and within it the fewest nodes, then the least left
   over on the chosen nodes (nodes filled exactly), then the smallest nodes (the
   largest free blocks stay whole), then the domain with the least free capacity.
   Of equally good nodes, those sharing narrower domains are taken together.

A tensor-parallel group never spans nodes: a node gives whole multiples of ``tp``.
Ranks are numbered node after node along the domain paths (tensor-parallel ranks
innermost, as meshyard's DeviceMesh lays them out), so consecutive pipeline stages sit
on the same node or on nodes of the narrowest domain available. ``round_robin`` is the
naive placement it is compared with: one rank per node in turn, in inventory order.

Nothing here imports torch or the cost model: the costing lives in ``plan/place_cost.py``.
"""

from __future__ import annotations

import math
from collections import Counter
from dataclasses import dataclass
from itertools import product
from typing import Any, Iterable

from meshyard.errors import BadInput
from meshyard.plan.inventory import Inventory, Node, few


class PlacementError(BadInput, ValueError):
    """A job that cannot be placed; the message says what is missing and where GPUs are free."""


@dataclass(frozen=True)
class HostPlacement:
    """Nodes chosen for a job, and the node of every rank."""

    nodes: tuple[Node, ...]
    """In node-rank order: the first node holds rank 0 (and serves the rendezvous)."""
    ranks: tuple[int, ...]
    """For each rank, the index of its node in ``nodes``."""
    domain: tuple[str, ...]
    """The narrowest domain holding every chosen node; () when they share none."""
    how: str
    """Why these nodes, in a phrase."""

    @property
    def gpus(self) -> int:
        return len(self.ranks)

    @property
    def counts(self) -> tuple[int, ...]:
        """GPUs taken on each node of ``nodes``."""
        taken = Counter(self.ranks)
        return tuple(taken[i] for i in range(len(self.nodes)))

    def as_dict(self) -> dict[str, Any]:
        """``{"nodes": [{"name", "gpus"}, ...]}`` in node-rank order."""
        return {"nodes": [{"name": n.name, "gpus": g} for n, g in zip(self.nodes, self.counts)]}


# --- choosing nodes -------------------------------------------------------------------------------

def place(inventory: Inventory, gpus: int, tp: int = 1, min_memory_gb: float = 0.0,
          per_node: int = 0) -> HostPlacement:
    """Topology-aware placement of ``gpus`` ranks in tensor-parallel groups of ``tp`` on
    nodes whose GPUs have at least ``min_memory_gb`` (see the module docstring), exactly
    ``per_node`` GPUs on each node when given. Raises ``PlacementError`` saying what is missing."""
    usable = _usable(inventory, gpus, tp, min_memory_gb, per_node)
    fits = [n for n in inventory.nodes if usable.get(n.name, 0) >= gpus]
    if fits:
        node = min(fits, key=lambda n: n.free_gpus)  # the first of equals: inventory order
        return HostPlacement((node,), (0,) * gpus, node.domains, "the node with the fewest free GPUs that fit")
    for depth in range(inventory.depth, -1, -1):
        found = _best_domain(inventory, usable, gpus, depth)
        if found is not None:
            break
    assert found is not None, "the whole cluster has enough usable GPUs (checked by _usable)"
    prefix, counts = found
    members = [n for n in inventory.nodes if n.domains[:depth] == prefix and usable.get(n.name, 0) > 0]
    chosen = _pick(members, Counter(counts), usable, depth, inventory.depth)
    taken = _fill(chosen, usable, gpus)
    order = sorted(range(len(chosen)), key=lambda i: (chosen[i].domains, -taken[i]))
    nodes = tuple(chosen[i] for i in order)
    ranks = tuple(position for position, i in enumerate(order) for _ in range(taken[i]))
    how = f"the narrowest domain with {gpus} usable GPUs" if prefix else "no one domain has enough free GPUs"
    return HostPlacement(nodes, ranks, prefix, how)


def round_robin(inventory: Inventory, gpus: int, min_memory_gb: float = 0.0) -> HostPlacement:
    """The naive placement: rank after rank on the next node with a free GPU, in
    inventory order (one GPU per node in turn), blind to domains and tensor groups."""
    nodes = [n for n in inventory.nodes if n.free_gpus > 0 and n.gpu_memory_gb >= min_memory_gb]
    if sum(n.free_gpus for n in nodes) < gpus:
        _usable(inventory, gpus, 1, min_memory_gb)  # raises, saying where GPUs are free
    left = [n.free_gpus for n in nodes]
    ranks: list[int] = []
    while len(ranks) < gpus:
        for i in range(len(nodes)):
            if left[i] and len(ranks) < gpus:
                ranks.append(i)
                left[i] -= 1
    used = sorted(set(ranks))
    chosen = tuple(nodes[i] for i in used)
    position = {i: p for p, i in enumerate(used)}
    return HostPlacement(chosen, tuple(position[i] for i in ranks), common_domain(chosen), "round-robin")


def common_domain(nodes: Iterable[Node]) -> tuple[str, ...]:
    """The longest path of domains every node in ``nodes`` shares."""
    paths = [n.domains for n in nodes]
    shared: list[str] = []
    for parts in zip(*paths):
        if any(p != parts[0] for p in parts):
            break
        shared.append(parts[0])
    return tuple(shared)


def _usable(inventory: Inventory, gpus: int, tp: int, min_memory_gb: float, per_node: int = 0) -> dict[str, int]:
    """GPUs each roomy-enough node can give in whole tensor groups (``per_node`` or none
    when given); refuses a job they cannot hold."""
    for option, value, least in (("--gpus", gpus, 1), ("parallel.tp =", tp, 1), ("--gpus-per-node", per_node, 0)):
        if value < least:
            raise PlacementError(f"{option} {value} must be at least {max(least, 1)}")
    if per_node and (gpus % per_node or per_node % tp):
        raise PlacementError(f"--gpus-per-node {per_node} must divide --gpus {gpus} and be a multiple of "
                             f"parallel.tp = {tp}; choose one that does, or leave it out to fill nodes as they fit")
    roomy = [n for n in inventory.nodes if n.gpu_memory_gb >= min_memory_gb]
    small = [n.name for n in inventory.nodes if n.gpu_memory_gb < min_memory_gb]
    if not roomy:
        largest = max(inventory.nodes, key=lambda n: n.gpu_memory_gb)
        raise PlacementError(f"the job needs {min_memory_gb:.3g} GB of memory per GPU and no node in "
                             f"{inventory.source} has that much (the most is {largest.gpu_memory_gb:g} GB, on "
                             f"{largest.name}); use GPUs with more memory or a layout that needs less per GPU "
                             "(more sharding, tensor or pipeline parallelism, activation checkpointing)")
    most = max(roomy, key=lambda n: n.free_gpus)
    if tp > 1 and most.free_gpus < tp:
        raise PlacementError(f"parallel.tp = {tp} keeps each tensor-parallel group on one node, but no node"
                             f"{' with enough memory' if small else ''} has {tp} free GPUs (the most is "
                             f"{most.free_gpus}, on {most.name}); lower parallel.tp to {max(most.free_gpus, 1)} or "
                             "less, or free GPUs on one node")
    if per_node:
        return _equal_shares(inventory, roomy, gpus, per_node)
    usable = {n.name: n.free_gpus // tp * tp for n in roomy}
    if sum(usable.values()) < gpus:
        raise PlacementError(_shortage(inventory, gpus, tp, usable, small, min_memory_gb))
    return usable


def _shortage(inventory: Inventory, gpus: int, tp: int, usable: dict[str, int], small: list[str],
              min_memory_gb: float) -> str:
    """One paragraph: how many GPUs are free, where, and what keeps some of them out."""
    free = sum(n.free_gpus for n in inventory.nodes)
    total = sum(usable.values())
    where = f"{inventory.source} ({_where_free(inventory.nodes)})"
    if tp > 1 and free >= gpus:
        text = (f"the job needs {gpus} GPUs in whole tensor-parallel groups of {tp} (a group never spans nodes), "
                f"but the {free} free GPUs in {where} make only {total} that way")
    else:
        text = f"the job needs {gpus} GPUs but only {free} are free in {where}"
        if tp > 1:
            text += f"; in whole tensor-parallel groups of {tp} (a group never spans nodes) {total} of them are usable"
    if small:
        text += (f"; {few(small)} cannot take it, their GPUs having less than the {min_memory_gb:.3g} GB "
                 "each rank needs")
    if not total:
        return text + ". Wait for GPUs to be free, or add nodes to the inventory."
    return text + f". Ask for at most {total} GPUs (--gpus), or wait for more to be free."


def _equal_shares(inventory: Inventory, roomy: list[Node], gpus: int, per_node: int) -> dict[str, int]:
    """``per_node`` GPUs on each node that has them; refuses when too few do."""
    usable = {n.name: per_node for n in roomy if n.free_gpus >= per_node}
    if len(usable) * per_node < gpus:
        raise PlacementError(f"the job needs {gpus // per_node} nodes with {per_node} free GPUs each "
                             f"(--gpus-per-node), but only {len(usable)} have that many in {inventory.source} "
                             f"({_where_free(inventory.nodes)}); ask for fewer GPUs per node or fewer GPUs")
    return usable


def _where_free(nodes: Iterable[Node], per_domain: int = 6) -> str:
    """'spine-1/leaf-1: n1 3, n2 3; spine-1/leaf-2: n4 1' for the nodes with free GPUs."""
    by_domain: dict[str, list[Node]] = {}
    for node in nodes:
        if node.free_gpus:
            by_domain.setdefault(node.path, []).append(node)
    if not by_domain:
        return "no node has a free GPU"
    parts = []
    for path, members in by_domain.items():
        shown = ", ".join(f"{n.name} {n.free_gpus}" for n in members[:per_domain])
        rest = members[per_domain:]
        if rest:
            shown += f" and {len(rest)} more nodes with {sum(n.free_gpus for n in rest)}"
        parts.append(f"{path}: {shown}")
    return "; ".join(parts)


def _best_domain(inventory: Inventory, usable: dict[str, int], gpus: int,
                 depth: int) -> tuple[tuple[str, ...], Counter[int]] | None:
    """The domain at ``depth`` (path length; 0 is the whole cluster) that holds the job
    best, and how many nodes of each usable size it takes there; None if none can."""
    capacities: dict[tuple[str, ...], list[int]] = {}
    for node in inventory.nodes:
        if usable.get(node.name, 0):
            capacities.setdefault(node.domains[:depth], []).append(usable[node.name])
    best: tuple[tuple, tuple[str, ...], Counter[int]] | None = None
    for prefix, caps in capacities.items():
        counts = fewest_nodes(caps, gpus)
        if counts is None:
            continue
        sizes = sorted(counts.elements(), reverse=True)
        key = (len(sizes), sum(sizes) - gpus, sizes, sum(caps))
        if best is None or key < best[0]:
            best = (key, prefix, counts)
    return None if best is None else (best[1], best[2])


def fewest_nodes(capacities: list[int], gpus: int) -> Counter[int] | None:
    """How many nodes of each free size to take from ``capacities`` for ``gpus``: the
    fewest nodes, then the least left over on them, then the smallest sizes (the largest
    stay whole). None when they do not add up to ``gpus``.

    A subset-sum over the distinct sizes, with sums as bits of an integer: cheap even
    for thousands of nodes, as nodes come in few sizes.
    """
    caps = sorted((c for c in capacities if c > 0), reverse=True)
    if sum(caps) < gpus:
        return None
    k = next(i for i in range(1, len(caps) + 1) if sum(caps[:i]) >= gpus)
    # Any k nodes hold less than the top k, which is under gpus + the largest size.
    mask = (1 << (gpus + caps[0])) - 1
    sizes = sorted(Counter(caps).items())
    layers = [[1] + [0] * k]  # layers[j][c]: sums reachable with c nodes of the first j sizes
    for size, available in sizes:
        prev = layers[-1]
        layers.append([mask & _or(prev[c - x] << (x * size) for x in range(min(available, c) + 1))
                       for c in range(k + 1)])
    reachable = layers[-1][k] >> gpus
    total = gpus + (reachable & -reachable).bit_length() - 1
    counts: Counter[int] = Counter()
    c, s = k, total
    for j in range(len(sizes), 0, -1):
        size, available = sizes[j - 1]
        # Fewest of the largest size first: the smallest nodes are taken.
        x = next(x for x in range(min(available, c) + 1)
                 if s >= x * size and layers[j - 1][c - x] >> (s - x * size) & 1)
        counts[size] += x
        c, s = c - x, s - x * size
    return +counts


def _or(values: Iterable[int]) -> int:
    result = 0
    for value in values:
        result |= value
    return result


def _pick(nodes: list[Node], need: Counter[int], usable: dict[str, int], depth: int, max_depth: int) -> list[Node]:
    """Concrete nodes with the sizes in ``need``: level by level, the sub-domain that can
    supply the most GPUs first, so that the chosen nodes share narrow domains."""
    if depth >= max_depth:
        chosen = []
        # Of nodes giving the same, those with the fewest free GPUs: filled most exactly.
        for node in sorted(nodes, key=lambda n: n.free_gpus):
            if need[usable[node.name]] > 0:
                need[usable[node.name]] -= 1
                chosen.append(node)
        return chosen
    groups: dict[str, list[Node]] = {}
    for node in nodes:
        groups.setdefault(node.domains[depth], []).append(node)
    chosen = []
    while +need:
        supply = {key: Counter(usable[n.name] for n in members) & need for key, members in groups.items()}
        key = max(supply, key=lambda k: sum(size * count for size, count in supply[k].items()))
        chosen += _pick(groups.pop(key), Counter(supply[key]), usable, depth + 1, max_depth)
        need -= supply[key]
    return chosen


def _fill(chosen: list[Node], usable: dict[str, int], gpus: int) -> list[int]:
    """GPUs taken on each chosen node: all they can give, less what is left over, taken
    from the largest node (its groups keep the most ranks per node)."""
    taken = [usable[n.name] for n in chosen]
    largest = max(range(len(taken)), key=lambda i: taken[i])
    taken[largest] -= sum(taken) - gpus
    return taken


# --- what the scheduler and the cost model are given ----------------------------------------------

def hostfile(placement: HostPlacement) -> str:
    """``name slots=G`` per node, in node-rank order (DeepSpeed's and Open MPI's format)."""
    return "".join(f"{n.name} slots={g}\n" for n, g in zip(placement.nodes, placement.counts))


def nodelist(placement: HostPlacement) -> str:
    """The nodes as Slurm's ``--nodelist`` takes them: names joined by commas."""
    return ",".join(n.name for n in placement.nodes)


def node_affinity(placement: HostPlacement, key: str = "kubernetes.io/hostname") -> dict[str, Any]:
    """A pod's ``affinity`` that requires one of the chosen nodes (by ``key``, the hostname label)."""
    term = {"matchExpressions": [{"key": key, "operator": "In", "values": [n.name for n in placement.nodes]}]}
    return {"nodeAffinity": {"requiredDuringSchedulingIgnoredDuringExecution": {"nodeSelectorTerms": [term]}}}


MESH_KINDS = {"tp": (3,), "dp": (1, 2), "dp_shard": (2,), "dp_replicate": (1,)}
"""Process groups by the mesh dimensions they vary, in (pp, dp_replicate, dp_shard, tp) order."""


@dataclass(frozen=True)
class GroupSpan:
    """Where one process group's ranks sit: how many nodes, how many ranks on the
    emptiest and the fullest of them, and how many domains the nodes share."""

    size: int
    nodes: int
    min_per_node: int
    max_per_node: int
    shared: int
    """Length of the domain path all its nodes share (0: none); meaningless on one node."""

    @property
    def crosses_nodes(self) -> bool:
        return self.nodes > 1


def group_spans(placement: HostPlacement, dp_replicate: int, dp_shard: int, tp: int, pp: int) -> dict[str, set[GroupSpan]]:
    """The distinct spans of every tp, dp, dp_shard and dp_replicate group and of every
    pair of neighbouring pipeline stages ('pp'), ranks laid out as meshyard's DeviceMesh
    (pp, dp_replicate, dp_shard, tp; tp innermost)."""
    shape = (pp, dp_replicate, dp_shard, tp)
    if math.prod(shape) != placement.gpus:
        raise ValueError(f"degrees {shape} do not multiply to the {placement.gpus} placed ranks")
    coords = list(product(*(range(d) for d in shape)))  # rank order: the last dimension fastest
    spans: dict[str, set[GroupSpan]] = {}
    for kind, varied in MESH_KINDS.items():
        groups: dict[tuple[int, ...], list[int]] = {}
        for rank, coord in enumerate(coords):
            groups.setdefault(tuple(c for d, c in enumerate(coord) if d not in varied), []).append(rank)
        spans[kind] = {_span(placement, ranks) for ranks in groups.values()}
    stage = placement.gpus // pp
    spans["pp"] = {_span(placement, [r, r + stage]) for r in range(placement.gpus - stage)}
    return spans


def _span(placement: HostPlacement, ranks: list[int]) -> GroupSpan:
    per_node = Counter(placement.ranks[r] for r in ranks)
    shared = len(common_domain(placement.nodes[i] for i in per_node))
    return GroupSpan(size=len(ranks), nodes=len(per_node), min_per_node=min(per_node.values()),
                     max_per_node=max(per_node.values()), shared=shared)
