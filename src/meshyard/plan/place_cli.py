"""``meshyard place``: which nodes a job should run on, and what that saves.

Parsing and the outputs (report, JSON, hostfile, Slurm node list, Kubernetes node
affinity). How nodes are chosen lives in ``plan/placement.py``; the config's layout as
the planner sees it, and its communication on a placement, in ``plan/place_cost.py``.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

from meshyard.plan.inventory import InventoryError, load_inventory
from meshyard.plan.layout import PlannedLayout
from meshyard.plan.place_cost import CommEstimate, estimate_comm, memory_per_gpu_gb, plan_inputs
from meshyard.plan.placement import (
    HostPlacement, PlacementError, hostfile, node_affinity, nodelist, place, round_robin,
)
from meshyard.plan.units import fmt_seconds
from meshyard.validate import load_and_validate

FORMATS = ("text", "json", "hostfile", "nodelist", "affinity")

DESCRIPTION = """\
Choose the nodes for a job from an inventory of free GPUs and the network's domains.
The job goes on one node if one has room; otherwise into the narrowest domain (a leaf
before a spine) that has enough free GPUs, on the fewest nodes there, filling nodes
exactly and leaving large free blocks whole. A tensor-parallel group (parallel.tp)
never spans nodes, and consecutive pipeline stages sit on the same node or the nearest
one. The planner's cost model prices the communication of each step for this placement
and for a naive round-robin one."""

EPILOG = """\
outputs (--format): text (the report), json ({"nodes": [{"name", "gpus"}, ...], ...}),
hostfile ("name slots=G" per node), nodelist (for sbatch/srun --nodelist), affinity
(a Kubernetes nodeAffinity for the pod template). Nodes are listed in node-rank order.

examples:
  meshyard place --nodes nodes.toml run.toml --gpus 16
  meshyard place --nodes nodes.toml run.toml --gpus 16 --json
  sbatch --nodelist=$(meshyard place --nodes nodes.toml run.toml --gpus 16 --format nodelist) job.sh
  meshyard place --nodes nodes.toml run.toml --gpus 16 --hostfile hostfile --parallel.tp=4"""


def register(subparsers: argparse._SubParsersAction) -> None:
    """Add the ``place`` subcommand to a ``meshyard`` argument parser; a bad inventory or a
    job that cannot be placed is told as ``meshyard place: ...``."""
    p = subparsers.add_parser("place", help="choose nodes for a job from a cluster inventory (topology-aware)",
                              description=DESCRIPTION, epilog=EPILOG,
                              formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("config", nargs="?", help="TOML config of the job (optional; its [parallel] and model matter)")
    p.add_argument("--nodes", required=True, metavar="INVENTORY",
                   help="TOML inventory: [[nodes]] with name, free_gpus, gpu_memory_gb, domains")
    p.add_argument("--gpus", type=int, required=True, metavar="N", help="GPUs (ranks) of the job")
    p.add_argument("--gpus-per-node", type=int, default=0, metavar="G",
                   help="take exactly G GPUs on every chosen node, as a launcher that starts the same count on "
                        "each node needs (default: as many as each node has free)")
    p.add_argument("--format", choices=FORMATS, default="text", help="what to print (default: the report)")
    p.add_argument("--json", dest="format", action="store_const", const="json", help="same as --format json")
    p.add_argument("--hostfile", metavar="PATH", help="also write the placement as a hostfile to PATH")
    p.set_defaults(handler=main, own_errors=(InventoryError, PlacementError), error_prefix="meshyard place")


# --- outputs -------------------------------------------------------------------------------------

def placement_json(placement: HostPlacement, naive: HostPlacement, comm: CommEstimate, naive_comm: CommEstimate,
                   layout: PlannedLayout, memory_gb: float) -> dict[str, Any]:
    """``{"nodes": [{"name", "gpus"}, ...]}`` and, under other keys, the rest of the report."""
    return {
        **placement.as_dict(),
        "gpus": placement.gpus,
        "domain": list(placement.domain),
        "layout": {"strategy": layout.strategy, "dp_replicate": layout.dp_replicate, "dp_shard": layout.dp_shard,
                   "tp": layout.tp, "pp": layout.pp},
        "memory_per_gpu_gb": round(memory_gb, 3),
        "communication": comm.as_dict(),
        "round_robin": {**naive.as_dict(), "communication": naive_comm.as_dict()},
    }


def affinity_yaml(placement: HostPlacement) -> str:
    """``affinity:`` with the chosen nodes, as YAML to paste into a pod template."""
    term = node_affinity(placement)["nodeAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"]
    expression = term["nodeSelectorTerms"][0]["matchExpressions"][0]
    return ("affinity:\n  nodeAffinity:\n    requiredDuringSchedulingIgnoredDuringExecution:\n"
            "      nodeSelectorTerms:\n        - matchExpressions:\n"
            f"            - key: {expression['key']}\n              operator: In\n"
            f"              values: {json.dumps(expression['values'])}\n")


def _node_rows(placement: HostPlacement) -> list[str]:
    rows, first = [], 0
    width = max(len(n.name) for n in placement.nodes)
    for node, gpus in zip(placement.nodes, placement.counts):
        ranks = f"{first}" if gpus == 1 else f"{first}-{first + gpus - 1}"
        rows.append(f"  {node.name:<{width}}  {gpus:>4}  ranks {ranks:<9}  {node.path}")
        first += gpus
    return rows


def render_text(placement: HostPlacement, naive: HostPlacement, comm: CommEstimate, naive_comm: CommEstimate,
                layout: PlannedLayout, memory_gb: float) -> str:
    """The report: the nodes, then communication per step beside round-robin's."""
    where = "/".join(placement.domain) or "the whole cluster"
    lines = [f"{placement.gpus} GPUs for {layout.describe()} ({memory_gb:.3g} GB per GPU), on "
             f"{len(placement.nodes)} node(s) in {where}: {placement.how}.", *_node_rows(placement)]
    if len(set(placement.counts)) > 1:
        lines.append("  The nodes take different GPU counts: start each node with its own count, or pass "
                     "--gpus-per-node (a Slurm step and a PyTorchJob start the same count on every node).")
    naive_nodes = ", ".join(f"{n.name} {g}" for n, g in zip(naive.nodes, naive.counts))
    kinds = [k for k, degree in (("tp", layout.tp), ("pp", layout.pp), ("dp", layout.dp)) if degree > 1]
    lines += ["", f"Round-robin for comparison: {naive_nodes}.", "",
              "Exposed communication per step (the planner's cost model):",
              f"  {'':<6}  {'placed':>10}  {'round-robin':>11}"]
    for kind in kinds:
        lines.append(f"  {kind:<6}  {fmt_seconds(comm.seconds[kind]):>10}  {fmt_seconds(naive_comm.seconds[kind]):>11}")
    lines.append(f"  {'total':<6}  {fmt_seconds(comm.total):>10}  {fmt_seconds(naive_comm.total):>11}")
    for label, estimate in (("placed", comm), ("round-robin", naive_comm)):
        lines += [f"Slowest groups, {label}:"] + [f"  {kind}: {estimate.links[kind]}" for kind in kinds]
    return "\n".join(lines) + "\n"


def _output(args: argparse.Namespace, placement: HostPlacement, report: dict[str, Any], text: str) -> str:
    if args.format != "text" and len(set(placement.counts)) > 1:
        # A file for another tool carries no report: say it where a person sees it.
        print(f"meshyard: the nodes take different GPU counts ({' + '.join(map(str, placement.counts))}); "
              "launchers that start the same count on every node (meshyard run --nproc-per-node, the Slurm "
              "script, Kubernetes jobs) need --gpus-per-node", file=sys.stderr)
    if args.format == "json":
        return json.dumps(report, indent=2) + "\n"
    if args.format == "hostfile":
        return hostfile(placement)
    if args.format == "nodelist":
        return nodelist(placement) + "\n"
    if args.format == "affinity":
        return affinity_yaml(placement)
    return text


def main(args: argparse.Namespace, overrides: list[str]) -> int:
    """Run ``meshyard place``. Bad input raises: ``InventoryError`` or ``PlacementError`` (told
    as the command's), a bad config ``ConfigError``."""
    inventory = load_inventory(args.nodes)
    if args.gpus < 1:
        raise PlacementError(f"--gpus {args.gpus} must be at least 1")
    cfg, checked = load_and_validate(args.config, overrides, world_size=args.gpus)
    desc, layout = plan_inputs(cfg, checked)
    memory_gb = memory_per_gpu_gb(desc, layout)
    placement = place(inventory, args.gpus, tp=layout.tp, min_memory_gb=memory_gb, per_node=args.gpus_per_node)
    naive = round_robin(inventory, args.gpus, min_memory_gb=memory_gb)
    comm, naive_comm = (estimate_comm(inventory, p, desc, layout) for p in (placement, naive))
    if args.hostfile:
        try:
            Path(args.hostfile).write_text(hostfile(placement))
        except OSError as exc:
            raise PlacementError(f"cannot write the hostfile '{args.hostfile}' ({exc.strerror or exc}); pass a "
                                 "writable path") from None
    report = placement_json(placement, naive, comm, naive_comm, layout, memory_gb)
    text = render_text(placement, naive, comm, naive_comm, layout, memory_gb)
    print(_output(args, placement, report, text), end="")
    return 0


__all__ = ["affinity_yaml", "main", "placement_json", "register", "render_text"]
