"""Tables for the terminal: ranked layouts, rejections, memory and time breakdowns, scaling."""

from __future__ import annotations

from rich.console import Console
from rich.table import Table

from meshyard.hardware import GPUS, LINKS
from meshyard.metrics.cost import fmt_usd
from meshyard.plan.cost import StepEstimate
from meshyard.plan.hardware import Cluster
from meshyard.plan.layout import PlannedLayout
from meshyard.plan.memory import MemoryEstimate
from meshyard.plan.model import ModelDescription
from meshyard.plan.scale import ScaleResult
from meshyard.plan.pricing import Pricing
from meshyard.plan.search import Candidate, PlanResult
from meshyard.plan.units import fmt_bytes, fmt_count, fmt_seconds


def render_model(console: Console, desc: ModelDescription, seq_len: int) -> None:
    """One paragraph on the model: size, FLOPs, activations."""
    flops = desc.training_flops_per_token(seq_len)
    experts = ""
    if desc.moe is not None:
        experts = (f", {desc.moe.experts} experts a block (top-{desc.moe.top_k}; "
                   f"{fmt_count(desc.n_layer * desc.expert_params_per_layer)} parameters in routed experts)")
    console.print(
        f"[bold]{desc.name}[/]: {fmt_count(desc.n_params)} parameters ({desc.n_layer} layers x "
        f"{fmt_count(desc.layer_params)} + {fmt_count(desc.n_params - desc.block_params)} outside){experts}, "
        f"d_model={desc.d_model}, vocab={desc.vocab_size}; training {fmt_count(flops)}FLOP/token at "
        f"seq {seq_len}; {desc.activations.total_units:g} x d_model activations saved per token per layer."
    )


def render_cluster(console: Console, cluster: Cluster, dtype: str) -> None:
    console.print(
        f"{cluster.n_gpus} x {cluster.gpu.name} ({fmt_bytes(cluster.gpu.memory)}, "
        f"{cluster.peak(dtype) / 1e12:.0f} TFLOP/s {dtype} x {cluster.compute_efficiency:g} achievable), "
        f"{cluster.gpus_per_node} per node over {cluster.intra.name} ({cluster.intra.bandwidth / 1e9:.0f} GB/s per "
        f"GPU), {cluster.nodes} node(s) over {cluster.inter.name} ({cluster.inter.bandwidth / 1e9:.0f} GB/s per "
        f"node), links at {cluster.link_efficiency:g} of nominal."
    )


def _layout_cells(layout: PlannedLayout) -> list[str]:
    accum = f"{layout.micro_batch} x {layout.grad_accum}"
    saver = layout.ac + (" +offload" if layout.offload else "") + (" +fused loss" if layout.fused_loss else "")
    return [layout.describe(), accum, saver]


def render_plan(console: Console, result: PlanResult, top: int, show_rejected: int,
                pricing: Pricing | None = None) -> None:
    """The ranked feasible layouts (with ``pricing``, what each costs to train its tokens),
    then the families that do not fit and why."""
    table = Table(title=f"Feasible layouts, fastest first ({len(result.feasible)} of "
                        f"{len(result.feasible) + len(result.rejected)} families; usable memory "
                        f"{fmt_bytes(result.usable_bytes)} per device)")
    for name, justify in (("#", "right"), ("layout", "left"), ("micro x accum", "right"), ("savers", "left"),
                          ("memory/device", "right"), ("step", "right"), ("tokens/s", "right"), ("MFU", "right"),
                          ("exposed comm", "right"), *_cost_columns(pricing)):
        table.add_column(name, justify=justify)  # type: ignore[arg-type]
    for rank, cand in enumerate(result.feasible[:top], start=1):
        step = cand.step
        share = step.exposed_comm / step.step_time if step.step_time else 0.0
        table.add_row(str(rank), *_layout_cells(cand.layout), fmt_bytes(cand.memory.peak_bytes),
                      fmt_seconds(step.step_time), fmt_count(step.tokens_per_second), f"{step.mfu:.1%}",
                      f"{share:.0%}", *_cost_cells(pricing, cand))
    console.print(table)
    if pricing is not None:
        render_pricing(console, pricing)
    if result.rejected and show_rejected:
        render_rejections(console, result, show_rejected)


def _cost_columns(pricing: Pricing | None) -> tuple[tuple[str, str], ...]:
    if pricing is None:
        return ()
    spot = (("spot", "right"),) if pricing.price.spot_per_hour > 0 else ()
    return ("hours", "right"), ("cost", "right"), *spot


def _cost_cells(pricing: Pricing | None, cand: Candidate) -> list[str]:
    if pricing is None:
        return []
    cost = pricing.cost_of(cand.step.tokens_per_second, cand.step.step_time, cand.layout.world_size)
    spot = [fmt_usd(cost.spot_usd)] if cost.spot_usd is not None else []
    return [f"{cost.train_s / 3600:,.3g}", fmt_usd(cost.cost_usd), *spot]


def render_pricing(console: Console, pricing: Pricing) -> None:
    """Which prices the costs are at, and where the spot column's restart overhead comes from."""
    price = pricing.price
    text = (f"Hours and costs to train {fmt_count(pricing.tokens)} tokens, at {fmt_usd(price.per_hour)} per "
            f"GPU-hour ({price.source})")
    if price.spot_per_hour > 0:
        measured = pricing.measured
        text += f"; spot at {fmt_usd(price.spot_per_hour)} per GPU-hour"
        if measured is None:
            text += " without restarts (--restarts RUN_DIR adds a measured run's restart overhead)"
        elif not measured.restarts:
            text += f", no restarts recorded in {measured.run_dir}"
        else:
            resumed = sum(entry.get("resume_s") or 0.0 for entry in measured.restarts)
            lost = sum(entry.get("steps_lost") or 0 for entry in measured.restarts)
            text += (f", with the restart overhead measured in {measured.run_dir}: {len(measured.restarts)} "
                     f"restart(s) in {fmt_seconds(measured.trained_s)} of steps, {fmt_seconds(resumed)} to resume "
                     f"and {lost} step(s) lost")
    console.print(text + ".", highlight=False, soft_wrap=True)


def render_settings(console: Console, layout: PlannedLayout, nodes: int) -> None:
    """The config settings that run the best layout, ready to paste after ``meshyard run``."""
    per_node = layout.world_size // max(1, nodes)
    where = f"--nnodes={nodes} --nproc={per_node}" if nodes > 1 else f"--nproc={layout.world_size}"
    console.print(f"Run #1 with: meshyard run CONFIG {where} {' '.join(layout.config_overrides())}",
                  highlight=False, soft_wrap=True)


def render_rejections(console: Console, result: PlanResult, limit: int) -> None:
    """Rejected families, those with the same reason merged into one row."""
    grouped: dict[str, list[str]] = {}
    for rejection in result.rejected:
        key = rejection.reason if not rejection.needed_bytes else f"{rejection.label}\0{rejection.reason}"
        grouped.setdefault(key, []).append(rejection.label)
    table = Table(title="Rejected layouts")
    table.add_column("layout")
    table.add_column("why it fails")
    for key, labels in list(grouped.items())[:limit]:
        reason = key.split("\0")[-1]
        shown = ", ".join(labels[:3]) + (f" (+{len(labels) - 3} more)" if len(labels) > 3 else "")
        table.add_row(shown, reason)
    console.print(table)
    if len(grouped) > limit:
        console.print(f"... {len(grouped) - limit} more reasons; raise --show-rejected to see them.")


def render_memory(console: Console, memory: MemoryEstimate, title: str) -> None:
    """Every line of a memory estimate with its formula."""
    table = Table(title=f"{title}: peak {fmt_bytes(memory.peak_bytes)} at the {memory.peak_moment} "
                        f"(pipeline stage {memory.stage})")
    table.add_column("memory")
    table.add_column("bytes", justify="right")
    table.add_column("arithmetic")
    for item in memory.items:
        table.add_row(item.name, fmt_bytes(item.bytes), item.formula)
    others = ", ".join(f"{k} {fmt_bytes(v)}" for k, v in memory.moments.items() if k != memory.peak_moment)
    console.print(table)
    console.print(f"Other moments of the step: {others}."
                  + (f" Host memory for offloaded states: {fmt_bytes(memory.host_bytes)}." if memory.host_bytes else ""))


def render_step(console: Console, step: StepEstimate, title: str) -> None:
    """Every term of a step-time estimate."""
    table = Table(title=f"{title}: step {fmt_seconds(step.step_time)}, {fmt_count(step.tokens_per_second)} "
                        f"tokens/s, MFU {step.mfu:.1%}")
    table.add_column("time")
    table.add_column("seconds", justify="right")
    table.add_column("on critical path")
    table.add_column("how")
    for item in step.items:
        table.add_row(item.name, fmt_seconds(item.seconds), "yes" if item.exposed else "overlapped", item.formula)
    console.print(table)


def render_scale(console: Console, result: ScaleResult) -> None:
    table = Table(title=f"Scaling of {result.layout_label} ({result.mode})")
    for name in ("GPUs", "nodes", "layout", "global batch", "micro x accum", "memory/device", "step",
                 "tokens/s", "MFU", "efficiency"):
        table.add_column(name, justify="left" if name == "layout" else "right")
    for point in result.points:
        cand = point.candidate
        nodes = str(-(-point.n_gpus // result.gpus_per_node))
        if cand is None:
            table.add_row(str(point.n_gpus), nodes, f"[red]{point.reason}[/]", str(point.global_batch),
                          "", "", "", "", "", "")
            continue
        table.add_row(str(point.n_gpus), nodes, cand.layout.describe() + _saver(cand.layout),
                      str(cand.layout.global_batch), f"{cand.layout.micro_batch} x {cand.layout.grad_accum}",
                      fmt_bytes(cand.memory.peak_bytes), fmt_seconds(cand.step.step_time),
                      fmt_count(cand.step.tokens_per_second), f"{cand.step.mfu:.1%}", f"{point.efficiency:.1%}")
    console.print(table)


def _saver(layout: PlannedLayout) -> str:
    parts = [] if layout.ac == "none" else [f"ac={layout.ac}"]
    parts += ["offload"] if layout.offload else []
    parts += ["fused loss"] if layout.fused_loss else []
    return f" ({', '.join(parts)})" if parts else ""


def render_catalog(console: Console) -> None:
    """The built-in GPUs and interconnects."""
    gpus = Table(title="GPUs (dense peak; override with --gpu-memory / --peak-tflops)")
    for name in ("name", "memory", "bf16 TFLOP/s", "fp32 TFLOP/s", "HBM", "intra-node link"):
        gpus.add_column(name)
    for g in GPUS.values():
        bf16 = g.peak_flops.get("bf16", g.peak_flops.get("fp16", 0.0))
        gpus.add_row(g.name, fmt_bytes(g.memory), f"{bf16 / 1e12:g}", f"{g.peak_flops['fp32'] / 1e12:g}",
                     f"{g.hbm_bandwidth / 1e9:.0f} GB/s", g.intra_link)
    console.print(gpus)
    links = Table(title="Interconnects (one direction; override with --intra-bw / --inter-bw)")
    for name in ("name", "bandwidth", "latency", "what"):
        links.add_column(name)
    for link in LINKS.values():
        links.add_row(link.name, f"{link.bandwidth / 1e9:g} GB/s", f"{link.latency * 1e6:g} us", link.description)
    console.print(links)
