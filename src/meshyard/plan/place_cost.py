"""The planner's view of a placement: a config's layout in the planner's terms, the
memory a rank needs, and the communication a step leaves exposed on chosen nodes.

How nodes are chosen lives in ``plan/placement.py``; the ``meshyard place`` command
(parsing, outputs) in ``plan/place_cli.py``.

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

import dataclasses
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from meshyard.data.corpus import BYTE_VOCAB
from meshyard.plan.comm import place_group
from meshyard.plan.cost import estimate_step
from meshyard.plan.hardware import Cluster, make_cluster
from meshyard.plan.inventory import Inventory
from meshyard.plan.layout import PRECISIONS, PlannedLayout, planner_strategy
from meshyard.plan.memory import estimate_memory
from meshyard.plan.model import ModelDescription
from meshyard.plan.placement import GroupSpan, HostPlacement, PlacementError, group_spans
from meshyard.plan.trace import TraceError, describe_config
from meshyard.plugins import PluginError

if TYPE_CHECKING:
    from meshyard.config.sections import Config
    from meshyard.validate import ValidatedLayout

HEADROOM = 0.1
"""Fraction of each GPU's memory kept free, as ``meshyard plan`` keeps by default."""

_PRECISION = {"auto": "bf16", "bf16": "bf16", "fp16": "fp16", "fp32": "fp32"}
_SCHEDULE = {"gpipe": "gpipe", "1f1b": "1f1b", "interleaved1f1b": "interleaved", "zerobubble": "interleaved"}
_ITEMS = {"tp": ("tp comm",), "pp": ("pp transfers",), "dp": ("dp comm (exposed)", "zero-1 all-gather")}
"""The cost model's terms each kind of process group contributes to the exposed communication."""


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


def plan_inputs(cfg: Config, checked: ValidatedLayout) -> tuple[ModelDescription, PlannedLayout]:
    """The config's model and layout as the planner describes them."""
    dims, batch, par = checked.dims, checked.batch, cfg.parallel
    # A pipeline cuts each micro-batch into chunks: those are the planner's micro-batches.
    chunks = checked.layout.microbatches if dims.pp > 1 else 1
    micro = batch.micro_batch // chunks if batch.micro_batch % chunks == 0 else batch.micro_batch
    schedule = _SCHEDULE[par.pp_schedule]
    layout = PlannedLayout(
        strategy=planner_strategy(par, dims.dp_replicate), dp_replicate=dims.dp_replicate, dp_shard=dims.dp_shard,
        tp=dims.tp, pp=dims.pp, cp=dims.cp, ep=dims.ep,
        micro_batch=max(1, micro), grad_accum=batch.grad_accum * chunks, seq_len=cfg.data.seq_len,
        precision=PRECISIONS[_PRECISION[cfg.precision.dtype]], optimizer=cfg.optim.name, ac=par.ac,
        fused_loss=cfg.train.fused_linear_loss,
        sequence_parallel=par.sequence_parallel, pp_schedule=schedule,  # type: ignore[arg-type]
        pp_virtual=par.pp_virtual_stages if schedule == "interleaved" else 1, bucket_mb=par.bucket_mb,
    )
    vocab = cfg.model.vocab_size or cfg.data.vocab_size or BYTE_VOCAB
    try:
        desc = describe_config(cfg.model, vocab, cfg.data.seq_len)
    except (TraceError, PluginError) as exc:
        raise PlacementError(f"cannot describe model '{cfg.model.name}' for the cost model: {exc}") from None
    return desc, layout


def memory_per_gpu_gb(desc: ModelDescription, layout: PlannedLayout) -> float:
    """GB of GPU memory a rank needs: the planner's peak, with ``HEADROOM`` kept free."""
    return estimate_memory(desc, layout).peak_bytes / (1.0 - HEADROOM) / 1e9


def base_cluster(inventory: Inventory, gpus: int) -> Cluster:
    """The inventory's GPUs as the planner's cluster, every group inside one node."""
    cluster = make_cluster(inventory.gpu, n_gpus=gpus, gpus_per_node=gpus)
    if inventory.node_bandwidth is not None:
        cluster = dataclasses.replace(cluster, intra=dataclasses.replace(cluster.intra,
                                                                         bandwidth=inventory.node_bandwidth))
    return cluster


def estimate_comm(inventory: Inventory, placement: HostPlacement, desc: ModelDescription,
                  layout: PlannedLayout) -> CommEstimate:
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


def _seconds(desc: ModelDescription, layout: PlannedLayout, cluster: Cluster, kind: str) -> float:
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


__all__ = ["HEADROOM", "CommEstimate", "estimate_comm", "memory_per_gpu_gb", "plan_inputs"]
