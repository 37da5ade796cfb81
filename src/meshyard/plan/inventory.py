"""The inventory of a cluster for placement: nodes, their free GPUs and memory, their
network path (domains, widest first) and the bandwidth of each level of the network.

``load_inventory`` reads the TOML file and reports every problem in one paragraph
(``InventoryError``); ``meshyard.plan.placement`` places jobs on what it returns.
"""

from __future__ import annotations

import re
import sys
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterable

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - exercised on Python 3.10 only
    import tomli as tomllib

from meshyard.errors import BadInput
from meshyard.hardware import CatalogError, gpu_spec, link_spec

DEFAULT_LINK_PER_GPU = link_spec("ib-ndr-8x").bandwidth / 8
"""Bytes/s per GPU between nodes when the inventory names none: one 400 Gb/s NIC per GPU."""

CLUSTER_LINK = "cluster"
"""Bandwidth key of the link between nodes that share no domain."""
NODE_LINK = "node"
"""Bandwidth key of the link between GPUs of one node."""


class InventoryError(BadInput, ValueError):
    """A bad inventory file; the message names every problem and the fix, in one paragraph."""


@dataclass(frozen=True)
class Node:
    """One node of the inventory."""

    name: str
    free_gpus: int
    gpu_memory_gb: float
    """Memory of each of its GPUs, GB (10^9 bytes)."""
    domains: tuple[str, ...]
    """Its network path, widest domain first (e.g. spine, then leaf)."""

    @property
    def path(self) -> str:
        return "/".join(self.domains) or "(no domain)"


@dataclass(frozen=True)
class Inventory:
    """Nodes with free GPUs, the names of the domain levels and the bandwidth of each link."""

    nodes: tuple[Node, ...]
    levels: tuple[str, ...]
    """Level names, widest first: one per entry of a node's domains."""
    level_bandwidth: tuple[float, ...]
    """Bytes/s per GPU between nodes whose narrowest shared domain is at each level."""
    cluster_bandwidth: float
    """Bytes/s per GPU between nodes that share no domain."""
    node_bandwidth: float | None = None
    """Bytes/s per GPU inside a node; None takes the GPU's own link from the catalog."""
    gpu: str = "h100"
    """Catalog name of the GPUs (compute speed and default link inside a node)."""
    source: str = "the inventory"

    @property
    def depth(self) -> int:
        return len(self.levels)

    def link(self, shared: int) -> tuple[str, float]:
        """Name and bytes/s per GPU of the link between nodes whose paths share their
        first ``shared`` domains (0: none)."""
        if shared <= 0:
            return CLUSTER_LINK, self.cluster_bandwidth
        return self.levels[shared - 1], self.level_bandwidth[shared - 1]


# --- the inventory file ---------------------------------------------------------------------------

_RATE = re.compile(r"^\s*(\d+(?:\.\d*)?|\.\d+)\s*([kMGT])(b|B)(?:/s|ps)\s*$")
_PREFIX = {"k": 1e3, "M": 1e6, "G": 1e9, "T": 1e12}
_TOP_KEYS = ("gpu", "levels", "bandwidth", "nodes")
_NODE_KEYS = ("name", "free_gpus", "gpu_memory_gb", "domains")


def parse_rate(value: object) -> float:
    """Bytes/s in a bandwidth: ``"400Gb/s"`` (bits), ``"50GB/s"`` (bytes) or a bare number
    of GB/s. Raises ValueError naming the accepted forms."""
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        rate = float(value) * 1e9
    elif isinstance(value, str) and (match := _RATE.match(value)):
        number, prefix, unit = match.groups()
        rate = float(number) * _PREFIX[prefix] / (8 if unit == "b" else 1)
    else:
        raise ValueError(f"{value!r} is not a bandwidth; write it like \"400Gb/s\" (bits), \"50GB/s\" "
                         "(bytes) or a number of GB/s")
    if not rate > 0:
        raise ValueError(f"bandwidth {value!r} must be larger than zero")
    return rate


def load_inventory(path: str | Path) -> Inventory:
    """Read and check an inventory TOML file; raises ``InventoryError`` naming every problem."""
    path = Path(path)
    try:
        data = tomllib.loads(path.read_text())
    except FileNotFoundError:
        raise InventoryError(f"the inventory {path} does not exist; pass the TOML file that lists the "
                             "nodes with --nodes") from None
    except (OSError, UnicodeDecodeError) as exc:
        raise InventoryError(f"cannot read the inventory {path} ({exc}); pass a readable TOML file") from None
    except tomllib.TOMLDecodeError as exc:
        raise InventoryError(f"the inventory {path} is not valid TOML ({exc}); fix the syntax there") from None
    return parse_inventory(data, str(path))


def parse_inventory(data: dict[str, Any], source: str = "the inventory") -> Inventory:
    """Check an inventory read from TOML; raises one ``InventoryError`` listing every problem."""
    problems = [f"unknown key '{key}' (known: {', '.join(_TOP_KEYS)})" for key in data if key not in _TOP_KEYS]
    entries = data.get("nodes")
    nodes: list[Node] = []
    if not isinstance(entries, list) or not entries:
        problems.append("no [[nodes]] tables: list each node with name, free_gpus, gpu_memory_gb and domains")
    else:
        for index, entry in enumerate(entries, start=1):
            node, found = _parse_node(index, entry)
            problems += found
            nodes += [node] if node else []
    names = Counter(e.get("name") for e in entries if isinstance(e, dict) and isinstance(e.get("name"), str)) \
        if isinstance(entries, list) else Counter()
    problems += [f"node name '{name}' appears {count} times; names must be unique"
                 for name, count in names.items() if count > 1]
    levels, found = _parse_levels(data.get("levels"), nodes)
    problems += found
    gpu = data.get("gpu", "h100")
    try:
        gpu_spec(str(gpu))
    except CatalogError as exc:
        problems.append(f"gpu: {exc}")
    links, found = _parse_bandwidth(data.get("bandwidth", {}), levels)
    problems += found
    if problems:
        count = len(problems)
        raise InventoryError(f"{source} has {count} problem{'s' if count > 1 else ''}: " + "; ".join(problems)
                             + f". Fix them in {source}.")
    level_bw, cluster_bw, node_bw = links
    return Inventory(nodes=tuple(nodes), levels=levels, level_bandwidth=level_bw, cluster_bandwidth=cluster_bw,
                     node_bandwidth=node_bw, gpu=str(gpu), source=source)


def _parse_node(index: int, entry: object) -> tuple[Node | None, list[str]]:
    """One [[nodes]] table, or the problems that stop it."""
    if not isinstance(entry, dict):
        return None, [f"nodes entry {index} is not a table; write each as [[nodes]] with its keys"]
    name = entry.get("name")
    where = f"node {index} ('{name}')" if isinstance(name, str) and name.strip() else f"node {index}"
    problems = [f"{where}: unknown key '{key}' (known: {', '.join(_NODE_KEYS)})" for key in entry
                if key not in _NODE_KEYS]
    if not isinstance(name, str) or not name.strip() or any(c.isspace() or c == "," for c in name):
        problems.append(f"{where}: name must be the node's hostname (a string without spaces or commas)")
    free = entry.get("free_gpus")
    if not isinstance(free, int) or isinstance(free, bool) or free < 0:
        problems.append(f"{where}: free_gpus = {free!r} must be a whole number of at least 0")
    memory = entry.get("gpu_memory_gb")
    if not isinstance(memory, (int, float)) or isinstance(memory, bool) or not memory > 0:
        problems.append(f"{where}: gpu_memory_gb = {memory!r} must be the memory of one GPU in GB, e.g. 80")
    domains = entry.get("domains", [])
    if not isinstance(domains, list) or not all(isinstance(d, str) and d.strip() for d in domains):
        problems.append(f"{where}: domains = {domains!r} must list the node's network domains, widest first, "
                        "e.g. [\"spine-1\", \"leaf-3\"]")
    if problems:
        return None, problems
    return Node(name=name, free_gpus=free, gpu_memory_gb=float(memory), domains=tuple(domains)), []


def _parse_levels(levels: object, nodes: list[Node]) -> tuple[tuple[str, ...], list[str]]:
    """The level names, and whether every node's path has one domain per level."""
    depths: dict[int, list[str]] = {}
    for node in nodes:
        depths.setdefault(len(node.domains), []).append(node.name)
    if len(depths) > 1:
        mix = "; ".join(f"{depth} level(s): {few(names)}" for depth, names in sorted(depths.items()))
        return (), [f"nodes list different numbers of domains ({mix}); every node names its path from the widest "
                    "domain to the narrowest, with the same levels (e.g. [\"spine-1\", \"leaf-3\"] on every node)"]
    depth = next(iter(depths), 0)
    if levels is None:
        return tuple(f"level-{i}" for i in range(1, depth + 1)), []
    if not isinstance(levels, list) or not all(isinstance(v, str) and v.strip() for v in levels):
        return (), [f"levels = {levels!r} must name the domain levels, widest first, e.g. [\"spine\", \"leaf\"]"]
    if len(levels) != depth or len(set(levels)) != len(levels) or {NODE_LINK, CLUSTER_LINK} & set(levels):
        return (), [f"levels = {levels!r} must name each of the {depth} domain level(s) the nodes list, once each, "
                    f"widest first (not '{NODE_LINK}' or '{CLUSTER_LINK}', which name the links inside a node and "
                    "between nodes sharing no domain)"]
    return tuple(levels), []


def _parse_bandwidth(table: object, levels: tuple[str, ...]
                     ) -> tuple[tuple[tuple[float, ...], float, float | None], list[str]]:
    """(per-level bytes/s, between domains, inside a node) from [bandwidth]. A level not
    given takes the next narrower level's; the narrowest, one 400 Gb/s NIC per GPU."""
    if not isinstance(table, dict):
        return ((), 0.0, None), [f"bandwidth must be a table ([bandwidth]) of link -> rate, not {table!r}"]
    known = (NODE_LINK, *levels, CLUSTER_LINK)
    problems, rates = [], {}
    for key, value in table.items():
        if key not in known:
            problems.append(f"bandwidth.{key}: not a link; name one of {', '.join(known)} (levels are named by "
                            "levels = [...], widest first)")
            continue
        try:
            rates[key] = parse_rate(value)
        except ValueError as exc:
            problems.append(f"bandwidth.{key}: {exc}")
    per_level, narrower = [], DEFAULT_LINK_PER_GPU
    for level in reversed(levels):
        narrower = rates.get(level, narrower)
        per_level.insert(0, narrower)
    return (tuple(per_level), rates.get(CLUSTER_LINK, narrower), rates.get(NODE_LINK)), problems


def few(names: Iterable[str], limit: int = 4) -> str:
    names = list(names)
    shown = ", ".join(names[:limit])
    return shown + (f" and {len(names) - limit} more" if len(names) > limit else "")


