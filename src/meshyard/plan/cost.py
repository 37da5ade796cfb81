"""Step time of a layout on a cluster: compute, communication, pipeline bubble, optimizer.

The model, in the order a step runs (every term is a line of ``StepEstimate.items``):

- compute: a micro-batch's forward FLOPs on the busiest pipeline stage (its blocks'
  share, split by TP, plus the output head on the last stage) over ``peak x
  compute_efficiency``; backward is twice the forward; activation checkpointing
  re-runs the forward of the recomputed blocks. The fused loss (``layout.fused_loss``)
  runs the head's three matmuls block by block, the same FLOPs, so it costs the plain
  loss's time: neither's memory traffic over the logits is modelled.
- tensor parallelism: per block and micro-batch, two all-reduces of ``t x d x c`` bytes
  in forward and two in backward (Megatron; sequence parallelism swaps each for an
  all-gather plus a reduce-scatter of the same volume), and two more per recomputed
  block. On the critical path: no overlap.
- pipeline: ``m`` micro-batches through ``p`` stages take ``(m + p - 1)`` slots of one
  micro-batch's forward + backward (GPipe and 1F1B alike); the interleaved schedule with
  ``v`` chunks shrinks the bubble to ``(p - 1) / v`` slots at ``v`` times the sends.
  Each slot includes sending activations forward and gradients back.
- data parallelism: DDP and ZeRO-1 all-reduce gradients once per step, overlapped with
  the last micro-batch's backward except for the final bucket; ZeRO-1 then all-gathers
  the updated parameters (exposed). FSDP2 all-gathers each micro-batch's parameters in
  forward (and again in backward for ZeRO-3), overlapped with that pass's compute
  except the first block's gather; gradients are reduce-scattered on the last
  micro-batch (meshyard accumulates unsharded before that); HSDP adds an all-reduce of
  the shard across replicas. Overlap hides at most ``overlap x`` the compute it runs
  beside.
- context parallelism: per block and micro-batch, the ring passes the keys and values
  (2 x t x d x c bytes) ``cp - 1`` times in forward and again in backward, where their
  fp32 gradients travel ``cp`` hops too; each hop overlaps one block pair's attention,
  so only what attention's share of compute cannot hide is exposed.
- expert parallelism: per MoE block and micro-batch, the tokens go all-to-all to the ranks
  holding their experts and the outputs come back (dispatch and combine), in forward and
  again for their gradients in backward: 4 all-to-alls of ``t x top_k x d x c`` bytes, of
  which each rank sends ``(ep - 1) / ep``, and 2 more per recomputed block. They sit between
  the router and the experts, so nothing overlaps them. FSDP gathers and reduces the
  experts a rank holds over the ``dp_shard / ep`` ranks that hold the same ones. Under
  tensor parallelism a MoE block's router and routed experts are whole on every tp rank,
  which all compute them (only attention and shared experts are split).
- optimizer: memory-bound; each parameter the rank updates reads and writes its value,
  gradient and states once at the device's memory bandwidth. CPU offload moves the
  update to host memory bandwidth and adds PCIe copies of parameters and gradients.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from meshyard.hardware import link_spec
from meshyard.plan.comm import MeshPlacement, collective_time, p2p_time, place_mesh
from meshyard.plan.hardware import Cluster
from meshyard.plan.layout import PlannedLayout
from meshyard.plan.model import ModelDescription
from meshyard.plan.stage import stage_shapes
from meshyard.plan.units import fmt_seconds


@dataclass(frozen=True)
class TimeItem:
    """One term of the step time, and whether it is on the critical path."""

    name: str
    seconds: float
    formula: str
    exposed: bool = True


@dataclass(frozen=True)
class StepEstimate:
    """Predicted time of one optimizer step and the throughput it implies."""

    step_time: float
    tokens_per_step: int
    model_flops_per_token: float
    n_gpus: int
    peak_flops: float
    items: tuple[TimeItem, ...]

    @property
    def tokens_per_second(self) -> float:
        return self.tokens_per_step / self.step_time if self.step_time > 0 else 0.0

    @property
    def mfu(self) -> float:
        """Model FLOPs utilisation (PaLM): useful FLOPs per second over the cluster's peak."""
        return self.model_flops_per_token * self.tokens_per_second / (self.n_gpus * self.peak_flops)

    def seconds(self, name: str) -> float:
        return sum(i.seconds for i in self.items if i.name == name)

    @property
    def exposed_comm(self) -> float:
        """Communication seconds on the critical path."""
        return sum(i.seconds for i in self.items if i.exposed and i.name in _COMM_ITEMS)


_COMM_ITEMS = ("tp comm", "cp ring", "ep all-to-all", "pp transfers", "dp comm (exposed)", "zero-1 all-gather", "offload copies")

DEFAULT_OVERLAP = 0.9
"""Fraction of concurrent compute that hides communication (collectives share the GPU)."""


@dataclass(frozen=True)
class _MicroBatch:
    forward: float
    backward: float
    recompute: float
    tp: float
    p2p: float
    cp: float = 0.0
    """The ring's exposed transfer time (context parallelism)."""
    ep: float = 0.0
    """The all-to-alls of token dispatch and combine (expert parallelism)."""

    @property
    def slot(self) -> float:
        return self.forward + self.backward + self.recompute + self.tp + self.p2p + self.cp + self.ep


def _micro_batch(desc: ModelDescription, layout: PlannedLayout, cluster: Cluster, mesh: MeshPlacement) -> _MicroBatch:
    """Per-micro-batch times on the busiest pipeline stage."""
    t, tp = layout.tokens_per_micro_batch, layout.tp
    rate = cluster.peak(layout.precision.peak_dtype) * cluster.compute_efficiency
    if rate <= 0:
        raise ValueError(f"{cluster.gpu.name} has no {layout.precision.peak_dtype} support; choose another precision")
    # A MoE block's router and routed experts run whole on every tp rank.
    whole = desc.tp_whole_forward_flops_per_token()
    layer = ((desc.layer_forward_flops_per_token(layout.seq_len) - whole) / tp + whole) * t
    head_split = tp if layout.vocab_parallel else 1
    head = desc.head_forward_flops_per_token() * t / head_split
    shapes = stage_shapes(desc, layout)
    stage_flops = max(s.layers * layer + (head if s.last else 0.0) for s in shapes)
    layers = max(s.layers for s in shapes)
    recomputed = {"none": 0, "selective": layers // 2, "full": layers}[layout.ac]
    forward = stage_flops / rate
    recompute = recomputed * layer / rate
    act_bytes = t * desc.d_model * layout.precision.compute
    all_reduces = layers * 4 + recomputed * 2
    tp_time = all_reduces * collective_time(cluster, "all_reduce", act_bytes, mesh.tp) if tp > 1 else 0.0
    p2p = 0.0
    if layout.pp > 1:
        # Activation sent forward, its gradient back; the interleaved schedule sends v times.
        sends = 2 * (layout.pp_virtual if layout.pp_schedule == "interleaved" else 1)
        p2p = sends * p2p_time(cluster, act_bytes / (tp if layout.sequence_parallel else 1), mesh.pp_crosses_nodes)
    cp = _ring_time(desc, layout, cluster, layers, rate) if layout.cp > 1 else 0.0
    ep = 0.0
    if layout.ep > 1 and desc.moe is not None:
        routed_bytes = t * desc.moe.top_k * desc.d_model * layout.precision.compute
        ep = (layers * 4 + recomputed * 2) * collective_time(cluster, "all_to_all", routed_bytes, mesh.ep)
    return _MicroBatch(forward=forward, backward=2 * forward, recompute=recompute, tp=tp_time, p2p=p2p, cp=cp,
                       ep=ep)


def _ring_time(desc: ModelDescription, layout: PlannedLayout, cluster: Cluster, layers: int, rate: float) -> float:
    """Exposed seconds of the context-parallel ring per micro-batch: transfers of keys and
    values (and in backward their fp32 gradients) beyond the attention they overlap.
    The ring spans nodes when cp x tp ranks do not fit in one."""
    t, cp, tp = layout.tokens_per_micro_batch, layout.cp, layout.tp
    kv = 2 * t * desc.d_model * layout.precision.compute / tp
    crosses = cp * tp > cluster.gpus_per_node
    forward_hops, backward_hops = (cp - 1) * p2p_time(cluster, kv, crosses), (
        (cp - 1) * p2p_time(cluster, kv, crosses) + cp * p2p_time(cluster, kv * 4 / layout.precision.compute, crosses))
    # Attention's own FLOPs (the part of a block's that grows with the sequence), one hop's worth.
    attention = (desc.layer_forward_flops_per_token(layout.seq_len) - desc.layer_forward_flops_per_token(0)) * t / tp
    per_hop = attention / rate / cp
    exposed = max(0.0, forward_hops - (cp - 1) * per_hop) + max(0.0, backward_hops - 2 * (cp - 1) * per_hop)
    return layers * exposed


def _pipeline_slots(layout: PlannedLayout) -> float:
    m, p = layout.grad_accum, layout.pp
    if p == 1:
        return float(m)
    virtual = layout.pp_virtual if layout.pp_schedule == "interleaved" else 1
    return m + (p - 1) / virtual


def _dp_items(desc: ModelDescription, layout: PlannedLayout, cluster: Cluster, mesh: MeshPlacement,
              mb: _MicroBatch, overlap: float) -> list[TimeItem]:
    """Data-parallel communication: its total time, and what is left after overlap."""
    if layout.dp * layout.cp == 1:
        return []
    shapes = stage_shapes(desc, layout)
    busiest = max(shapes, key=lambda s: s.params)
    layers = max(1, max(s.layers for s in shapes))
    if layout.zero_stage <= 1:
        return _replicated_dp_items(layout, cluster, mesh, mb, overlap, busiest.params)
    experts = busiest.expert_params if layout.ep > 1 else 0
    return _sharded_dp_items(layout, cluster, mesh, mb, overlap, busiest.params - experts, layers, experts)


def _replicated_dp_items(layout: PlannedLayout, cluster: Cluster, mesh: MeshPlacement, mb: _MicroBatch,
                         overlap: float, psi: int) -> list[TimeItem]:
    """DDP (and ZeRO-1): bucketed all-reduce overlapped with the last backward."""
    prec = layout.precision
    grads = prec.grad * psi
    bucket = min(grads, layout.bucket_mb * 2**20)
    buckets = math.ceil(grads / bucket)
    total = buckets * collective_time(cluster, "all_reduce", grads / buckets, mesh.dp)
    last_bucket = collective_time(cluster, "all_reduce", bucket, mesh.dp)
    items = [
        TimeItem("dp comm", total, f"all-reduce of g*Psi = {grads / 1e9:.3g} GB in {buckets} buckets over "
                 f"dp={layout.dp}", exposed=False),
        TimeItem("dp comm (exposed)", max(total - overlap * mb.backward, last_bucket),
                 f"not hidden by the last micro-batch's backward ({fmt_seconds(mb.backward)}); the last "
                 f"{layout.bucket_mb:g} MiB bucket always"),
    ]
    if layout.zero_stage == 1:
        gather = collective_time(cluster, "all_gather", prec.param * psi, mesh.dp)
        items.append(TimeItem("zero-1 all-gather", gather, "updated parameters p*Psi from their owners"))
    return items


def _sharded_dp_items(layout: PlannedLayout, cluster: Cluster, mesh: MeshPlacement, mb: _MicroBatch,
                      overlap: float, psi: int, layers: int, experts: int = 0) -> list[TimeItem]:
    """FSDP2/HSDP: per-block gathers overlapped with each pass, one reduce-scatter per step.
    ``psi`` is gathered over dp_shard; ``experts`` (a rank's share under expert parallelism)
    over the dp_shard / ep ranks that hold the same experts."""
    prec, m = layout.precision, layout.grad_accum
    # One collective per block and one for the root: latency is paid layers + 1 times.
    units = layers + 1
    groups = [(psi, units, mesh.dp_shard, layout.shard_degree)]
    if experts:
        groups.append((experts, layers, mesh.expert_dp_shard, layout.expert_shard_degree))
    gather = scatter = replicate = 0.0
    for count, pieces, group, shards in groups:
        gather += pieces * collective_time(cluster, "all_gather", prec.compute * count / pieces, group)
        scatter += pieces * collective_time(cluster, "reduce_scatter", prec.grad * count / pieces, group)
        replicate += pieces * collective_time(cluster, "all_reduce", prec.grad * count / shards / pieces,
                                              mesh.dp_replicate)
    backward_gather = gather if layout.zero_stage == 3 else 0.0
    # Forward: every micro-batch gathers; only the first block's gather cannot overlap.
    exposed = m * (max(0.0, gather - overlap * mb.forward) + gather / units)
    # Backward: ZeRO-3 gathers again; the last micro-batch also reduces the gradients,
    # and its last block's reduction runs after all compute.
    exposed += (m - 1) * max(0.0, backward_gather - overlap * mb.backward)
    last = backward_gather + scatter + replicate
    exposed += max(0.0, last - overlap * mb.backward) + (scatter + replicate) / units
    what = (f"{m} x {'2' if backward_gather else '1'} all-gathers of c*Psi + reduce-scatter of g*Psi over "
            f"{layout.shard_degree}")
    if experts:
        what += f" (the experts a rank holds over {layout.expert_shard_degree})"
    if layout.dp_replicate > 1:
        what += f" + all-reduce of g*Psi/{layout.shard_degree} over {layout.dp_replicate} replicas"
    total = m * (gather + backward_gather) + scatter + replicate
    return [TimeItem("dp comm", total, what, exposed=False),
            TimeItem("dp comm (exposed)", exposed,
                     "beyond the compute it overlaps, plus the first gather and last reduce-scatter")]


def _optimizer_items(desc: ModelDescription, layout: PlannedLayout, cluster: Cluster) -> list[TimeItem]:
    prec = layout.precision
    busiest = max(stage_shapes(desc, layout), key=lambda s: s.params)
    local = (busiest.stored_params(layout.shard_degree, layout.expert_shard_degree) if layout.zero_stage >= 1
             else busiest.params)
    k = prec.optimizer_bytes(layout.n_optimizer_states)
    touched = 2 * prec.param + prec.grad + 2 * k
    if not layout.offload:
        return [TimeItem("optimizer", local * touched / cluster.gpu.hbm_bandwidth,
                         f"{touched} B/param read+written x {local / 1e6:.3g}M params at HBM bandwidth")]
    host_share = cluster.host_bandwidth / cluster.gpus_per_node
    pcie = cluster_host_link(cluster)
    copies = layout.grad_accum * (2 if layout.zero_stage == 3 else 1) * prec.param * local + prec.grad * local
    return [TimeItem("optimizer", local * touched / host_share, "on the host, sharing its memory bandwidth"),
            TimeItem("offload copies", copies / pcie, "parameters to the GPU per gather, gradients back")]


def cluster_host_link(cluster: Cluster) -> float:
    """Bytes/s between one GPU and host memory (PCIe generation of the GPU)."""
    return link_spec(cluster.gpu.host_link).bandwidth * cluster.link_efficiency


def estimate_step(desc: ModelDescription, layout: PlannedLayout, cluster: Cluster,
                  overlap: float = DEFAULT_OVERLAP) -> StepEstimate:
    """Predicted step time of ``layout`` on ``cluster`` (see the module docstring)."""
    # cp sits between dp_shard and tp: FSDP's shard group (and DDP's, with dp_shard = 1)
    # spans dp_shard x cp contiguous ranks.
    mesh = place_mesh(cluster, layout.dp_replicate, layout.dp_shard * layout.cp, layout.tp, layout.pp, layout.ep)
    mb = _micro_batch(desc, layout, cluster, mesh)
    slots = _pipeline_slots(layout)
    m = layout.grad_accum
    items = [
        TimeItem("compute", m * (mb.forward + mb.backward), f"{m} x (forward "
                 f"{fmt_seconds(mb.forward)} + backward {fmt_seconds(mb.backward)})"),
    ]
    if mb.recompute:
        items.append(TimeItem("recompute", m * mb.recompute, f"checkpointed blocks' forward again ({layout.ac})"))
    if mb.tp:
        items.append(TimeItem("tp comm", m * mb.tp, f"all-reduces of t x d x c over tp={layout.tp}, not overlapped"))
    if mb.cp:
        items.append(TimeItem("cp ring", m * mb.cp, f"keys and values round a ring of cp={layout.cp} per block, "
                              "beyond the attention each hop overlaps"))
    if mb.ep:
        items.append(TimeItem("ep all-to-all", m * mb.ep, f"tokens to their experts and back over ep={layout.ep}, "
                              "4 per MoE block (dispatch and combine, forward and backward), not overlapped"))
    if layout.pp > 1:
        items.append(TimeItem("pp transfers", m * mb.p2p, "activations forward and gradients back per micro-batch"))
        items.append(TimeItem("pipeline bubble", (slots - m) * mb.slot,
                              f"{slots - m:.3g} idle slots of {fmt_seconds(mb.slot)} ({layout.pp_schedule})"))
    items += _dp_items(desc, layout, cluster, mesh, mb, overlap)
    items += _optimizer_items(desc, layout, cluster)
    step = sum(i.seconds for i in items if i.exposed)
    return StepEstimate(
        step_time=step,
        tokens_per_step=layout.global_batch * layout.seq_len,
        model_flops_per_token=desc.training_flops_per_token(layout.seq_len),
        n_gpus=layout.world_size,
        peak_flops=cluster.peak(layout.precision.peak_dtype),
        items=tuple(items),
    )
