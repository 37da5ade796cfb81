"""``meshyard place``: which nodes a job should run on, and what that saves.

Parsing, the config's layout as the planner sees it, the planner's communication
estimate for a placement, and the outputs (report, JSON, hostfile, Slurm node list,
Kubernetes node affinity). How nodes are chosen lives in ``launch/placement.py``.

The planner's cost model (``meshyard.plan.cost.estimate_step``) prices a layout on
uniform nodes. A placement's nodes are not uniform (3 + 3 + 1 GPUs), so each kind of
process group is priced on the uniform cluster that gives its slowest group the same
thing: as many ranks per node as the group's fullest node, the bandwidth of the
narrowest domain its nodes share, per GPU, times the ranks on its emptiest node (a
ring runs at the pace of its slowest node), and for pipeline stages the link between
the farthest pair of neighbouring stages. Only that kind's terms are read from each
estimate; together they are the communication a step leaves exposed. On uniform nodes
this is the planner's own estimate for that cluster. HSDP is priced on its replicas'
groups when its shards stay inside nodes, else on its whole data-parallel group.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from meshyard.config.sections import Config
from meshyard.data.corpus import BYTE_VOCAB
from meshyard.fault.failure import EXIT_BAD_INPUT
from meshyard.launch.inventory import Inventory, InventoryError, load_inventory
from meshyard.launch.placement import (
    GroupSpan, Placement, PlacementError, group_spans, hostfile, node_affinity, nodelist, place, round_robin,
)
from meshyard.plan.comm import place_group
from meshyard.plan.cost import estimate_step
from meshyard.plan.hardware import Cluster, make_cluster
from meshyard.plan.layout import PRECISIONS
from meshyard.plan.layout import Layout as PlanLayout
from meshyard.plan.memory import estimate_memory
from meshyard.plan.model import ModelDescription
from meshyard.plan.trace import TraceError, describe_config
from meshyard.plan.units import fmt_seconds
from meshyard.plugins import PluginError
from meshyard.validate import ValidatedLayout, load_and_validate

HEADROOM = 0.1
"""Fraction of each GPU's memory kept free, as ``meshyard plan`` keeps by default."""

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

_PRECISION = {"auto": "bf16", "bf16": "bf16", "fp16": "fp16", "fp32": "fp32"}
_SCHEDULE = {"gpipe": "gpipe", "1f1b": "1f1b", "interleaved1f1b": "interleaved", "zerobubble": "interleaved"}
_ITEMS = {"tp": ("tp comm",), "pp": ("pp transfers",), "dp": ("dp comm (exposed)", "zero-1 all-gather")}
"""The cost model's terms each kind of process group contributes to the exposed communication."""


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    """Add the ``place`` subcommand to a ``meshyard`` argument parser."""
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


@dataclass(frozen=True)
class CommEstimate:
    """Communication a step leaves exposed on one placement, by kind of process group."""

    seconds: dict[str, float]
    """'tp', 'pp' and 'dp' seconds per step (0 where the layout has no such group)."""
    links: dict[str, str]
    """What the slowest group of each kind crosses, in words."""

    @property
    def total(self) -> float:
        return sum(self.seconds.values())

    def as_dict(self) -> dict[str, Any]:
        return {"seconds": {**self.seconds, "total": self.total}, "links": self.links}


def plan_inputs(cfg: Config, checked: ValidatedLayout) -> tuple[ModelDescription, PlanLayout]:
    """The config's model and layout as the planner describes them."""
    dims, batch, par = checked.dims, checked.batch, cfg.parallel
    strategy = par.strategy
    if strategy == "fsdp":
        strategy = "hsdp" if dims.dp_replicate > 1 else ("fsdp3" if par.reshard_after_forward else "fsdp2")
    # A pipeline cuts each micro-batch into chunks: those are the planner's micro-batches.
    chunks = checked.layout.microbatches if dims.pp > 1 else 1
    micro = batch.micro_batch // chunks if batch.micro_batch % chunks == 0 else batch.micro_batch
    schedule = _SCHEDULE[par.pp_schedule]
    layout = PlanLayout(
        strategy=strategy, dp_replicate=dims.dp_replicate, dp_shard=dims.dp_shard, tp=dims.tp, pp=dims.pp,
        micro_batch=max(1, micro), grad_accum=batch.grad_accum * chunks, seq_len=cfg.data.seq_len,
        precision=PRECISIONS[_PRECISION[cfg.precision.dtype]], optimizer=cfg.optim.name, ac=par.ac,
        sequence_parallel=par.sequence_parallel, pp_schedule=schedule,  # type: ignore[arg-type]
        pp_virtual=par.pp_virtual_stages if schedule == "interleaved" else 1, bucket_mb=par.bucket_mb,
    )
    vocab = cfg.model.vocab_size or cfg.data.vocab_size or BYTE_VOCAB
    try:
        desc = describe_config(cfg.model, vocab, cfg.data.seq_len)
    except (TraceError, PluginError) as exc:
        raise PlacementError(f"cannot describe model '{cfg.model.name}' for the cost model: {exc}") from None
    return desc, layout


def memory_per_gpu_gb(desc: ModelDescription, layout: PlanLayout) -> float:
    """GB of GPU memory a rank needs: the planner's peak, with ``HEADROOM`` kept free."""
    return estimate_memory(desc, layout).peak_bytes / (1.0 - HEADROOM) / 1e9


def base_cluster(inventory: Inventory, gpus: int) -> Cluster:
    """The inventory's GPUs as the planner's cluster, every group inside one node."""
    cluster = make_cluster(inventory.gpu, n_gpus=gpus, gpus_per_node=gpus)
    if inventory.node_bandwidth is not None:
        cluster = dataclasses.replace(cluster, intra=dataclasses.replace(cluster.intra,
                                                                         bandwidth=inventory.node_bandwidth))
    return cluster


def estimate_comm(inventory: Inventory, placement: Placement, desc: ModelDescription,
                  layout: PlanLayout) -> CommEstimate:
    """Exposed communication per step of ``layout`` on ``placement`` (module docstring)."""
    base = base_cluster(inventory, placement.gpus)
    spans = group_spans(placement, layout.dp_replicate, layout.dp_shard, layout.tp, layout.pp)
    dp_spans, dp_stride = spans["dp"], layout.tp
    if layout.dp_replicate > 1 and layout.dp_shard > 1 and not any(s.crosses_nodes for s in spans["dp_shard"]):
        # HSDP with its shards inside nodes: only the replicas' all-reduce crosses them.
        dp_spans, dp_stride = spans["dp_replicate"], layout.tp * layout.dp_shard
    seconds, links = {}, {}
    for kind, kind_spans, stride in (("tp", spans["tp"], 1), ("dp", dp_spans, dp_stride)):
        priced = [(_seconds(desc, layout, _uniform(base, inventory, s, stride), kind), s) for s in kind_spans]
        seconds[kind], worst = max(priced, key=lambda item: item[0])
        links[kind] = _describe(inventory, worst)
    crossing = [s for s in spans["pp"] if s.crosses_nodes]
    worst_pp = min(crossing, key=lambda s: inventory.link(s.shared)[1]) if crossing else None
    seconds["pp"] = _seconds(desc, layout, _pipeline(base, inventory, worst_pp, placement.gpus // layout.pp), "pp")
    links["pp"] = _describe(inventory, worst_pp) if worst_pp else "inside one node"
    return CommEstimate(seconds=seconds, links=links)


def _seconds(desc: ModelDescription, layout: PlanLayout, cluster: Cluster, kind: str) -> float:
    step = estimate_step(desc, layout, cluster)
    return sum(step.seconds(item) for item in _ITEMS[kind])


def _uniform(base: Cluster, inventory: Inventory, span: GroupSpan, stride: int) -> Cluster:
    """The uniform cluster on which the planner places a group of ranks ``stride`` apart
    as ``span`` sits: its fullest node's ranks per node, its emptiest node's bandwidth."""
    if not span.crosses_nodes:
        return base
    gpus_per_node = span.max_per_node * stride
    modelled = place_group(span.size, stride, gpus_per_node).ranks_per_node
    # The planner gives a group inter x ranks_per_node / gpus_per_node of the network.
    inter = inventory.link(span.shared)[1] * span.min_per_node * gpus_per_node / modelled
    return dataclasses.replace(base, gpus_per_node=gpus_per_node,
                               inter=dataclasses.replace(base.inter, bandwidth=inter))


def _pipeline(base: Cluster, inventory: Inventory, span: GroupSpan | None, stage: int) -> Cluster:
    """The uniform cluster whose stage boundaries cross ``span``'s link (None: none crosses)."""
    if span is None:
        return base
    # Nodes of one stage each: every boundary crosses, at inter / gpus_per_node per GPU.
    inter = inventory.link(span.shared)[1] * stage
    return dataclasses.replace(base, gpus_per_node=stage, inter=dataclasses.replace(base.inter, bandwidth=inter))


def _describe(inventory: Inventory, span: GroupSpan) -> str:
    if not span.crosses_nodes:
        return "inside one node"
    name, rate = inventory.link(span.shared)
    spread = (f"{span.min_per_node}" if span.min_per_node == span.max_per_node
              else f"{span.min_per_node}-{span.max_per_node}")
    shared = f"sharing a {name}" if span.shared else "sharing no domain"
    return (f"{span.nodes} nodes ({spread} rank{'s' if span.max_per_node > 1 else ''} on each) {shared}, "
            f"{rate / 1e9:.3g} GB/s per GPU")


# --- outputs -------------------------------------------------------------------------------------

def placement_json(placement: Placement, naive: Placement, comm: CommEstimate, naive_comm: CommEstimate,
                   layout: PlanLayout, memory_gb: float) -> dict[str, Any]:
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


def affinity_yaml(placement: Placement) -> str:
    """``affinity:`` with the chosen nodes, as YAML to paste into a pod template."""
    term = node_affinity(placement)["nodeAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"]
    expression = term["nodeSelectorTerms"][0]["matchExpressions"][0]
    return ("affinity:\n  nodeAffinity:\n    requiredDuringSchedulingIgnoredDuringExecution:\n"
            "      nodeSelectorTerms:\n        - matchExpressions:\n"
            f"            - key: {expression['key']}\n              operator: In\n"
            f"              values: {json.dumps(expression['values'])}\n")


def _node_rows(placement: Placement) -> list[str]:
    rows, first = [], 0
    width = max(len(n.name) for n in placement.nodes)
    for node, gpus in zip(placement.nodes, placement.counts):
        ranks = f"{first}" if gpus == 1 else f"{first}-{first + gpus - 1}"
        rows.append(f"  {node.name:<{width}}  {gpus:>4}  ranks {ranks:<9}  {node.path}")
        first += gpus
    return rows


def render_text(placement: Placement, naive: Placement, comm: CommEstimate, naive_comm: CommEstimate,
                layout: PlanLayout, memory_gb: float) -> str:
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


def _output(args: argparse.Namespace, placement: Placement, report: dict[str, Any], text: str) -> str:
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
    """Run ``meshyard place``; returns the exit code (2 for bad input, with one paragraph).
    A bad config raises ``ConfigError`` for the ``meshyard`` command to report."""
    try:
        inventory = load_inventory(args.nodes)
        if args.gpus < 1:
            raise PlacementError(f"--gpus {args.gpus} must be at least 1")
        cfg, checked = load_and_validate(args.config, overrides, world_size=args.gpus)
        desc, layout = plan_inputs(cfg, checked)
        memory_gb = memory_per_gpu_gb(desc, layout)
        placement = place(inventory, args.gpus, tp=layout.tp, min_memory_gb=memory_gb, per_node=args.gpus_per_node)
        naive = round_robin(inventory, args.gpus, min_memory_gb=memory_gb)
    except (InventoryError, PlacementError) as exc:
        print(f"meshyard place: {exc}", file=sys.stderr)
        return EXIT_BAD_INPUT
    comm, naive_comm = (estimate_comm(inventory, p, desc, layout) for p in (placement, naive))
    if args.hostfile:
        try:
            Path(args.hostfile).write_text(hostfile(placement))
        except OSError as exc:
            print(f"meshyard place: cannot write the hostfile '{args.hostfile}' ({exc.strerror or exc}); pass a "
                  "writable path", file=sys.stderr)
            return EXIT_BAD_INPUT
    report = placement_json(placement, naive, comm, naive_comm, layout, memory_gb)
    text = render_text(placement, naive, comm, naive_comm, layout, memory_gb)
    print(_output(args, placement, report, text), end="")
    return 0


__all__ = ["CommEstimate", "add_parser", "estimate_comm", "main", "plan_inputs"]
