"""``meshyard report``: one self-contained HTML page about a run (plots inlined as PNG)."""

from __future__ import annotations

import base64
import html
import io
from pathlib import Path
from typing import Any, Sequence

from meshyard.extras import require

# Imported by 'meshyard report' only, so the rest of the command line runs without it.
matplotlib = require("matplotlib", "meshyard report")
matplotlib.use("Agg")  # no display needed; must precede pyplot
import matplotlib.pyplot as plt  # noqa: E402

from meshyard.doctor.diagnose import Diagnosis, diagnose, load_run  # noqa: E402
from meshyard.doctor.figures import MIB, memory_key  # noqa: E402
from meshyard.metrics.cost import Price, cost_summary, fmt_usd  # noqa: E402
from meshyard.metrics.schema import OTHER, PHASES, phase_key  # noqa: E402
from meshyard.run_dir import RunDir  # noqa: E402
from meshyard.runtime.hosts import host_of, rank_on_host  # noqa: E402

_STYLE = """
body{font-family:system-ui,-apple-system,Segoe UI,Roboto,sans-serif;margin:2rem auto;max-width:1100px;color:#1d2330}
h1{font-size:1.6rem}h2{font-size:1.2rem;margin-top:2rem;border-bottom:1px solid #dde}
.verdict{display:inline-block;padding:.3rem .8rem;border-radius:1rem;background:#1d4ed8;color:#fff;font-weight:600}
.verdict.healthy{background:#15803d}table{border-collapse:collapse}td,th{padding:.25rem .8rem;border-bottom:1px solid #eee;
text-align:left}.plots{display:grid;grid-template-columns:1fr 1fr;gap:1rem}img{width:100%}li{margin:.2rem 0}
"""


def _png(fig: plt.Figure) -> str:
    buffer = io.BytesIO()
    fig.savefig(buffer, format="png", dpi=110, bbox_inches="tight")
    plt.close(fig)
    return base64.b64encode(buffer.getvalue()).decode()


def _figure(title: str, ylabel: str) -> tuple[plt.Figure, Any]:
    fig, ax = plt.subplots(figsize=(6, 3.4))
    ax.set_title(title)
    ax.set_xlabel("step")
    ax.set_ylabel(ylabel)
    ax.grid(alpha=0.3)
    return fig, ax


def plot_loss(records: list[dict[str, Any]]) -> str:
    fig, ax = _figure("Loss", "cross-entropy")
    ax.plot([r["step"] for r in records], [r["loss"] for r in records], label="train")
    evals = [r for r in records if "eval_loss" in r]
    if evals:
        ax.plot([r["step"] for r in evals], [r["eval_loss"] for r in evals], "o-", label="eval")
    ax.legend()
    return _png(fig)


def plot_breakdown(records: list[dict[str, Any]]) -> str:
    fig, ax = _figure("Step time breakdown", "ms")
    timed = [r for r in records if "forward_s" in r]
    steps = [r["step"] for r in timed]
    parts = [[1000 * r[phase_key(p)] for r in timed] for p in (*PHASES, OTHER)]
    ax.stackplot(steps, parts, labels=[*PHASES, OTHER], alpha=0.85)
    ax.legend(loc="upper right", fontsize=8)
    return _png(fig)


def plot_throughput(records: list[dict[str, Any]]) -> str:
    fig, ax = _figure("Throughput", "tokens/s (all ranks)")
    ax.plot([r["step"] for r in records], [r["tokens_per_s"] for r in records])
    if any("mfu" in r for r in records):
        twin = ax.twinx()
        twin.plot([r["step"] for r in records if "mfu" in r], [100 * r["mfu"] for r in records if "mfu" in r],
                  color="tab:orange", alpha=0.6)
        twin.set_ylabel("MFU %")
    return _png(fig)


def plot_ranks(records: list[dict[str, Any]], hosts: Sequence[str] = ()) -> str:
    """Each rank's busy time per gathered window, labelled with its host (``hosts``,
    indexed by rank, from run.json) when the run recorded one per rank."""
    fig, ax = _figure("Per-rank busy time per step (gathered windows)", "ms")
    gathered = [r for r in records if "ranks" in r]
    ranks = len(gathered[0]["ranks"]["busy_s"]) if gathered else 0
    hosts = hosts if len(hosts) == ranks else ()  # another world size (an elastic restart): no guessing
    for rank in range(ranks):
        ax.plot([r["step"] for r in gathered], [1000 * r["ranks"]["busy_s"][rank] for r in gathered], "o-",
                label=rank_on_host(rank, host_of(hosts, rank)))
    if gathered:
        ax.legend(fontsize=8)
    return _png(fig)


def plot_memory(records: list[dict[str, Any]]) -> str:
    key = memory_key(records)
    fig, ax = _figure("Memory (rank 0)", "MiB " + ("peak reserved" if key.startswith("gpu") else "resident"))
    ax.plot([r["step"] for r in records if key in r], [r[key] * MIB for r in records if key in r])
    return _png(fig)


def cost_section(facts: dict[str, Any], records: list[dict[str, Any]], restarts: list[dict[str, Any]]) -> str:
    """The run's cost, its projection and what spot capacity would have cost, from the
    price run.json recorded (``metrics.cost``, as summary.json has it); empty without one."""
    price = Price.from_facts(facts)
    costed = [r for r in records if "cost_so_far_usd" in r]
    if price is None or not costed:
        return ""
    steady = [r["step_time_s"] for r in records[1:]] or [records[0]["step_time_s"]]
    summary = cost_summary(price, facts.get("world_size", 1), costed[-1]["cost_so_far_usd"],
                           sum(steady) / len(steady), restarts)
    rows = [("price", f"{fmt_usd(price.per_hour)} per device-hour ({price.source})"),
            ("device-hours", f"{summary['device_hours']:.4g}"),
            ("cost so far", fmt_usd(summary["cost_usd"])),
            ("projected to the last step", fmt_usd(costed[-1]["cost_projected_usd"])),
            ("restart overhead", f"{summary['restart_overhead_s']:.1f} s, {fmt_usd(summary['restart_cost_usd'])} "
                                 f"({len(restarts)} restart(s))")]
    if "spot_cost_usd" in summary:
        rows.append(("on spot capacity", f"{fmt_usd(summary['spot_cost_usd'])} at "
                                         f"{fmt_usd(price.spot_per_hour)} per device-hour, restart overhead included"))
    cells = "".join(f"<tr><th>{html.escape(k)}</th><td>{html.escape(v)}</td></tr>" for k, v in rows)
    return f"<h2>Cost</h2><table>{cells}</table>"


def render(diagnosis: Diagnosis, facts: dict[str, Any], records: list[dict[str, Any]],
           restarts: Sequence[dict[str, Any]] = ()) -> str:
    first = diagnosis.findings[0]
    rows = "".join(f"<tr><th>{html.escape(k.replace('_', ' '))}</th><td>{html.escape(str(v))}</td></tr>"
                   for k, v in facts.items() if not isinstance(v, (dict, list)))
    findings = "".join(
        f"<h3>{html.escape(f.verdict)}</h3><p><b>Evidence</b></p><ul>"
        + "".join(f"<li>{html.escape(e)}</li>" for e in f.evidence)
        + "</ul><p><b>What to change</b></p><ul>" + "".join(f"<li>{html.escape(a)}</li>" for a in f.advice)
        + "</ul>" for f in diagnosis.findings)
    plots = "".join(f'<figure><img alt="{name}" src="data:image/png;base64,{data}"></figure>' for name, data in (
        ("loss", plot_loss(records)), ("breakdown", plot_breakdown(records)),
        ("throughput", plot_throughput(records)), ("ranks", plot_ranks(records, facts.get("hosts", []))),
        ("memory", plot_memory(records))))
    return (f"<!doctype html><html><head><meta charset='utf-8'><title>meshyard report: "
            f"{html.escape(diagnosis.run_dir.name)}</title><style>{_STYLE}</style></head><body>"
            f"<h1>meshyard run {html.escape(diagnosis.run_dir.name)}</h1>"
            f"<p>Verdict: <span class='verdict {html.escape(first.verdict)}'>{html.escape(first.verdict)}</span> "
            f"after {len(records)} steps.</p><h2>Diagnosis</h2>{findings}"
            f"{cost_section(facts, records, list(restarts))}"
            f"<h2>Plots</h2><div class='plots'>{plots}</div><h2>Run</h2><table>{rows}</table></body></html>")


def write_report(run_dir: str | Path, out: Path | None = None) -> Path:
    run_dir = Path(run_dir)
    _, facts, records = load_run(run_dir)
    out = out or RunDir(run_dir).report
    out.write_text(render(diagnose(run_dir), facts, records, RunDir(run_dir).read_restarts()))
    return out
