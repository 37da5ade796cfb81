"""Reading a run's records and naming its bottleneck, with evidence and advice.

Inputs are the run directory's ``run.json`` (layout, capacity, FLOPs facts),
``config.toml`` and ``metrics.jsonl`` (per-step breakdown, and every
``metrics.gather_every`` steps each rank's figures). The first steps are skipped:
they carry start-up costs (allocator warm-up, first collectives, compilation).

Verdicts, checked in this order because an earlier cause distorts the later figures
(a straggler inflates everyone's communication wait, a starved loader makes compute look
idle): straggler, data-bound, communication-bound, memory-bound, compute-bound, healthy.
A mixture-of-experts run is also judged on its expert load ("expert-imbalance"): an
expert taking far more tokens than the mean, or a capacity limit dropping many. Any run is
judged on its garbage-collection pauses ("gc-pauses", from the records' ``gc_s``): a
collector that takes a large share of the steps, or pauses longer than a whole step.
Beside the verdicts, the waste of the steady steps (``metrics.waste``: idle GPU, data
stalls, exposed communication) as shares of the paid time.
"""

from __future__ import annotations

import dataclasses
import statistics
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from meshyard.config.checks import fused_loss_problems
from meshyard.config.load import load_config
from meshyard.config.sections import (CommConfig, Config, DataConfig, MetricsConfig, ModelConfig, ParallelConfig,
                                      PrecisionConfig, TrainConfig)
from meshyard.errors import BadInput
from meshyard.metrics.records import read_metrics
from meshyard.metrics.schema import PHASES, phase_key
from meshyard.metrics.waste import Waste, find_waste
from meshyard.plugins import is_custom_reference
from meshyard.run_dir import RunDir
from meshyard.runtime.hosts import host_of, rank_on_host

MEMORY_BOUND_FRACTION = 0.90
LOW_MFU = 0.30
IMBALANCED_LOAD = 1.5
"""A MoE layer whose busiest expert takes this many times the mean expert's tokens is imbalanced."""
DROPPED_SHARE = 0.05
"""Share of token assignments dropped by the capacity limit above which it is named."""
GC_SHARE = 0.05
"""Share of the steady steps' time spent in garbage collections above which they are named."""
GC_PAUSE_STEPS = 1.0
"""A single collection longer than this many median steps is named too."""


class DoctorError(BadInput, ValueError):
    """The directory is not a meshyard run with step records."""


@dataclass
class Finding:
    verdict: str
    evidence: list[str]
    advice: list[str]


@dataclass
class RunEvidence:
    """The figures a diagnosis rests on."""

    steps: int
    shares: dict[str, float]
    step_time_s: float
    mfu: float | None
    memory_fraction: float | None
    straggler_windows: dict[int, int] = field(default_factory=dict)
    straggler_hosts: dict[int, str] = field(default_factory=dict)
    """Each straggler's host, as the latest window naming it recorded it."""
    windows: int = 0
    busy_by_rank: list[float] = field(default_factory=list)


@dataclass
class Diagnosis:
    run_dir: Path
    findings: list[Finding]
    evidence: RunEvidence
    waste: list[Waste] = field(default_factory=list)

    @property
    def verdict(self) -> str:
        return self.findings[0].verdict

    def to_dict(self) -> dict[str, Any]:
        return {"run_dir": str(self.run_dir), "verdict": self.verdict,
                "findings": [f.__dict__ for f in self.findings], "evidence": self.evidence.__dict__,
                "waste": [waste.to_dict() for waste in self.waste]}


def load_run(run_dir: Path) -> tuple[Config, dict[str, Any], list[dict[str, Any]]]:
    paths = RunDir(run_dir)
    if not paths.metrics.exists():
        raise DoctorError(f"{run_dir} has no {RunDir.METRICS}; give the run directory that 'meshyard run' printed")
    records = read_metrics(run_dir)
    if not records:
        raise DoctorError(f"{paths.metrics} is empty: the run recorded no step yet")
    facts = paths.read_run_facts()
    config = load_config(paths.config) if paths.config.exists() else Config()
    return config, facts, records


def steady_records(records: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The records after the start-up steps, less those recorded by torch.profiler (which
    slows the steps it records)."""
    steady = records[max(1, len(records) // 10):] or records
    return [r for r in steady if not r.get("profiled")] or steady


def gather_evidence(facts: dict[str, Any], records: list[dict[str, Any]]) -> RunEvidence:
    steady = steady_records(records)
    timed = [r for r in steady if "forward_s" in r]
    if not timed:
        raise DoctorError("the run was recorded without a step-time breakdown (metrics.breakdown = false); "
                          "run it again with the default metrics settings")
    shares = {p: statistics.mean(r[phase_key(p)] / r["step_time_s"] for r in timed) for p in PHASES}
    mfus = [r["mfu"] for r in timed if "mfu" in r]
    evidence = RunEvidence(steps=len(records), shares=shares,
                           step_time_s=statistics.median(r["step_time_s"] for r in timed),
                           mfu=statistics.mean(mfus) if mfus else None,
                           memory_fraction=_memory_fraction(facts, timed))
    gathered = [r for r in steady if "ranks" in r]
    evidence.windows = len(gathered)
    for record in gathered:
        hosts = record.get("straggler_hosts", [])
        for index, rank in enumerate(record.get("stragglers", [])):
            evidence.straggler_windows[rank] = evidence.straggler_windows.get(rank, 0) + 1
            if host_of(hosts, index):
                evidence.straggler_hosts[rank] = host_of(hosts, index)
    if gathered:
        busy = [r["ranks"]["busy_s"] for r in gathered]
        evidence.busy_by_rank = [statistics.mean(window[rank] for window in busy) for rank in range(len(busy[0]))]
    return evidence


def _memory_fraction(facts: dict[str, Any], records: list[dict[str, Any]]) -> float | None:
    capacity = facts.get("memory_capacity_bytes")
    if not capacity:
        return None
    if any("gpu_peak_reserved_bytes" in r for r in records):
        return max(r.get("gpu_peak_reserved_bytes", 0) for r in records) / capacity
    # On CPU the ranks of a host share its memory.
    peak = max(r.get("peak_rss_bytes", 0) for r in records)
    return peak * facts.get("local_world_size", 1) / capacity


def _pct(value: float) -> str:
    return f"{100 * value:.0f}%"


def diagnose(run_dir: str | Path) -> Diagnosis:
    run_dir = Path(run_dir)
    config, facts, records = load_run(run_dir)
    ev = gather_evidence(facts, records)
    steady = steady_records(records)
    findings = [f for f in (_straggler(ev, config.metrics, config.data), _data(ev, config.data, config.metrics),
                            _comm(ev, config.train, config.parallel, config.comm, config.metrics, facts),
                            _memory(ev, config), _compute(ev, config.train, config.precision),
                            _expert_load(steady, config.model, config.parallel),
                            _collector(steady, ev, config.data)) if f]
    if not findings:
        findings = [Finding("healthy", [
            f"compute (forward + backward + optimizer) takes {_pct(ev.shares['forward'] + ev.shares['backward'] + ev.shares['optimizer'])} "
            f"of the {ev.step_time_s * 1000:.0f} ms step; data {_pct(ev.shares['data'])}, exposed communication "
            f"{_pct(ev.shares['comm'])}" + (f"; MFU {_pct(ev.mfu)}" if ev.mfu is not None else "")],
            ["nothing stands out; for more throughput per device raise train.micro_batch while memory allows"])]
    return Diagnosis(run_dir, findings, ev, find_waste(steady, config.metrics))


def _straggler(ev: RunEvidence, metrics: MetricsConfig, data: DataConfig) -> Finding | None:
    if not ev.straggler_windows or not ev.windows:
        return None
    rank, count = max(ev.straggler_windows.items(), key=lambda item: item[1])
    if count < max(1, ev.windows // 3):
        return None
    median = statistics.median(ev.busy_by_rank)
    host = ev.straggler_hosts.get(rank, "")
    machine = f"{host}, the host of rank {rank}, and its device" if host else f"the host and device of rank {rank}"
    return Finding("straggler", [
        f"{rank_on_host(rank, host)} was the slowest in {count} of {ev.windows} gathered windows: "
        f"{ev.busy_by_rank[rank] * 1000:.0f} ms busy per step against a median of {median * 1000:.0f} ms "
        f"(threshold x{metrics.straggler_factor})",
        f"the other ranks wait for it: exposed communication is {_pct(ev.shares['comm'])} of the step",
    ], [
        f"check {machine}: throttling (nvidia-smi -q -d PERFORMANCE), other jobs, a slower GPU model, or a slower "
        "disk feeding its data",
        f"if its data loading is slow, raise data.num_workers (now {data.num_workers}) on that node",
        "restart the job without that node (fault.max_restarts lets the elastic agent resume from the checkpoint)",
    ])


def _data(ev: RunEvidence, data: DataConfig, metrics: MetricsConfig) -> Finding | None:
    if ev.shares["data"] < metrics.data_stall_share:
        return None
    return Finding("data-bound", [
        f"waiting for data takes {_pct(ev.shares['data'])} of the {ev.step_time_s * 1000:.0f} ms step "
        f"(threshold {_pct(metrics.data_stall_share)})",
    ], [
        f"raise data.num_workers (now {data.num_workers}) so batches are prepared in parallel processes",
        f"raise data.prefetch_factor (now {data.prefetch_factor}) so more batches are ready ahead",
        "tokenize ahead of time: data.source = 'tokens' reads memory-mapped token files with no per-sample work",
    ])


def _comm(ev: RunEvidence, train: TrainConfig, parallel: ParallelConfig, comm: CommConfig, metrics: MetricsConfig,
          facts: dict[str, Any]) -> Finding | None:
    if ev.shares["comm"] < metrics.exposed_comm_share:
        return None
    advice = [f"accumulate more: train.grad_accum (now {facts.get('grad_accum', train.grad_accum)}) syncs "
              "gradients once per optimizer step, so fewer syncs per sample"]
    if parallel.strategy in ("ddp", "zero1"):
        advice += [f"larger gradient buckets overlap better: parallel.bucket_mb (now {parallel.bucket_mb})",
                   f"compress gradients: comm.compression = 'bf16' (2x less traffic) or 'powersgd' (now "
                   f"'{comm.compression}'; see meshyard bench compression)"]
    else:
        advice += ["keep gathered weights between forward and backward: parallel.reshard_after_forward = false "
                   "(ZeRO-2, one all-gather less per step)",
                   "across nodes, shard within a node and replicate across: parallel.dp_replicate = number of nodes (HSDP)"]
    return Finding("communication-bound", [
        f"exposed (not overlapped) communication takes {_pct(ev.shares['comm'])} of the step "
        f"(threshold {_pct(metrics.exposed_comm_share)}); strategy {parallel.strategy} on {facts.get('world_size', '?')} ranks",
    ], advice)


def _memory(ev: RunEvidence, config: Config) -> Finding | None:
    if ev.memory_fraction is None or ev.memory_fraction < MEMORY_BOUND_FRACTION:
        return None
    train = config.train
    return Finding("memory-bound", [
        f"peak memory reaches {_pct(ev.memory_fraction)} of capacity (threshold {_pct(MEMORY_BOUND_FRACTION)}): the "
        "allocator is close to failing, and a larger batch will not fit",
    ], [
        "shard model states: parallel.strategy = 'fsdp' (or 'zero1' to shard only the optimizer)",
        "recompute activations in backward: parallel.ac = 'selective' or 'full'",
        *_fused_loss_advice(config),
        f"halve train.micro_batch (now {train.micro_batch or 'derived'}) and double train.grad_accum: same "
        "global batch, less activation memory",
    ])


def _fused_loss_advice(config: Config) -> list[str]:
    """The fused head and loss, where the run could take it and does not yet."""
    asked = dataclasses.replace(config.train, fused_linear_loss=True)
    if (config.train.fused_linear_loss or fused_loss_problems(asked, config.model, config.parallel)
            or is_custom_reference(config.model.name)):  # a builder's model may return logits only
        return []
    return ["compute the output head and the loss together, a block of tokens at a time: train.fused_linear_loss "
            "= true (the tokens x vocabulary logits, often the largest activation, never exist whole; 'meshyard "
            "plan --fused-loss on' estimates the saving)"]


def _expert_load(steady: list[dict[str, Any]], model: ModelConfig, parallel: ParallelConfig) -> Finding | None:
    """A MoE run whose router sends one expert far more than its share, or whose capacity
    limit drops many tokens (figures of rank 0, over the steady steps)."""
    loads = [r for r in steady if "moe_imbalance" in r]
    if not loads:
        return None
    imbalance = statistics.median(r["moe_imbalance"] for r in loads)
    routed = sum(sum(map(sum, r.get("moe_tokens_per_expert", []))) for r in loads)
    dropped = sum(r.get("moe_dropped_tokens", 0) for r in loads)
    dropped_share = dropped / routed if routed else 0.0
    if imbalance < IMBALANCED_LOAD and dropped_share < DROPPED_SHARE:
        return None
    evidence = [f"the busiest expert takes {imbalance:.2f}x the mean expert's tokens (median over {len(loads)} "
                f"steps, worst layer; threshold {IMBALANCED_LOAD}x)"]
    last = loads[-1].get("moe_tokens_per_expert", [])
    if last:
        layer = max(range(len(last)), key=lambda i: max(last[i]) / max(sum(last[i]) / len(last[i]), 1e-12))
        busiest = max(range(len(last[layer])), key=lambda e: last[layer][e])
        evidence.append(f"at the last step, layer {layer}'s experts took {last[layer]} tokens (expert {busiest} "
                        "the most)")
    if dropped:
        evidence.append(f"the capacity limit dropped {_pct(dropped_share)} of the token assignments "
                        f"(model.moe_capacity_factor = {model.moe_capacity_factor})")
    advice = [f"weigh the load-balancing loss more: model.moe_aux_loss_weight (now {model.moe_aux_loss_weight}; "
              "0.01 is usual, up to 0.1)"]
    if dropped:
        advice.append(f"raise model.moe_capacity_factor (now {model.moe_capacity_factor}) or set it to 0 "
                      "(dropless): dropped tokens skip their experts")
    if parallel.ep > 1:
        advice.append(f"under expert parallelism (parallel.ep = {parallel.ep}) the rank holding the busiest expert "
                      "sets the pace of every all-to-all: the others wait for it")
    return Finding("expert-imbalance", evidence, advice)


def _compute(ev: RunEvidence, train: TrainConfig, precision: PrecisionConfig) -> Finding | None:
    if ev.mfu is None or ev.mfu >= LOW_MFU:
        return None
    return Finding("compute-bound", [
        f"compute dominates ({_pct(ev.shares['forward'] + ev.shares['backward'] + ev.shares['optimizer'])} of the "
        f"step) but reaches only {_pct(ev.mfu)} of the device's peak FLOP/s",
    ], [
        f"give the device larger matmuls: raise train.micro_batch (now {train.micro_batch or 'derived'})",
        f"compute in bf16 on GPUs that support it: precision.dtype = 'bf16' (now '{precision.dtype}')",
        "if activation checkpointing is on and memory allows, turn it off: parallel.ac = 'none'",
    ])


def _collector(steady: list[dict[str, Any]], ev: RunEvidence, data: DataConfig) -> Finding | None:
    """Python's garbage collector taking a large share of the steady steps, or one pause
    longer than a whole step (rank 0's process, any thread: ``gc_s``)."""
    paused = [r for r in steady if r.get("gc_s", 0) > 0]
    if not paused:
        return None
    total = sum(r["gc_s"] for r in paused)
    share = total / sum(r["step_time_s"] for r in steady)
    longest = max(paused, key=lambda r: r["gc_s"])
    if share < GC_SHARE and longest["gc_s"] < GC_PAUSE_STEPS * ev.step_time_s:
        return None
    return Finding("gc-pauses", [
        f"Python's garbage collector ran {total * 1000:.0f} ms over the {len(steady)} steady steps, "
        f"{_pct(share)} of their time (gc_s: any thread of rank 0's process)",
        f"its longest pause took {longest['gc_s'] * 1000:.0f} ms at step {longest['step']}, "
        f"{longest['gc_s'] / ev.step_time_s:.1f}x the median step of {ev.step_time_s * 1000:.0f} ms",
    ], [
        "keep what piles up during training (caches, histories, samples tokenized as they are read) in tensors "
        "or NumPy arrays, not in Python lists, dicts or objects: a full collection walks every Python object "
        "made after the first step (meshyard freezes what set-up and the first step made)",
        f"with data.num_workers > 0 (now {data.num_workers}), a map-style dataset's objects live in the loader's "
        "worker processes instead of the training process",
        "reference cycles made at every step (closures or lists holding tensors, exceptions kept with their "
        "tracebacks) make the collector run often: break them",
    ])
