"""``meshyard doctor RUN_DIR`` and ``meshyard report RUN_DIR``: parsing and printing only."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from rich.console import Console

from meshyard.doctor.diagnose import DoctorError, diagnose
from meshyard.metrics.cost import fmt_usd
from meshyard.metrics.waste import Waste
from meshyard.run_dir import RunDir

# What a run directory that cannot be read raises: told as 'meshyard doctor: ...' (or report).
UNREADABLE_RUN = (DoctorError, OSError, ValueError)


def register(subparsers: argparse._SubParsersAction) -> None:
    """Register ``meshyard doctor`` and ``meshyard report``; neither takes config overrides."""
    doctor = subparsers.add_parser(
        "doctor", help="name a run's bottleneck with evidence and advice",
        description="Read a run directory's records and say whether the run is data-bound, communication-bound, "
        "compute-bound, memory-bound, held back by a straggler, or healthy; with the evidence and the config keys "
        "to change.")
    doctor.add_argument("run_dir", type=Path, metavar="RUN_DIR")
    doctor.add_argument("--json", action="store_true", help="print the diagnosis as JSON")
    doctor.set_defaults(handler=doctor_main, takes_overrides=False, own_errors=UNREADABLE_RUN,
                        error_prefix="meshyard doctor")
    report = subparsers.add_parser(
        "report", help="write a self-contained HTML page with plots and the diagnosis",
        description=f"Write RUN_DIR/{RunDir.REPORT} (or --out): loss and eval curves, stacked step-time breakdown, "
        "throughput and MFU, per-rank busy times, memory, and the doctor's diagnosis.")
    report.add_argument("run_dir", type=Path, metavar="RUN_DIR")
    report.add_argument("--out", type=Path, help=f"output file (default: RUN_DIR/{RunDir.REPORT})")
    report.set_defaults(handler=report_main, takes_overrides=False, own_errors=UNREADABLE_RUN,
                        error_prefix="meshyard report")


def doctor_main(args: argparse.Namespace, overrides: list[str]) -> int:
    """Print the diagnosis of a run directory (as JSON with ``--json``)."""
    diagnosis = diagnose(args.run_dir)
    if args.json:
        print(json.dumps(diagnosis.to_dict(), indent=2))
        return 0
    console = Console()
    console.print(f"[bold]verdict: {diagnosis.verdict}[/bold]  ({diagnosis.evidence.steps} steps, {args.run_dir})")
    for finding in diagnosis.findings:
        console.print(f"\n[bold]{finding.verdict}[/bold]")
        for line in finding.evidence:
            console.print(f"  evidence: {line}", highlight=False)
        for line in finding.advice:
            console.print(f"  change:   {line}", highlight=False)
    if diagnosis.waste:
        console.print(f"\n[bold]waste[/bold] (share of paid time: {diagnosis.waste[0].paid_s:.1f} s of step time "
                      f"over {diagnosis.waste[0].steps} steady steps)")
        for waste in diagnosis.waste:
            console.print(f"  {waste_line(waste)}", highlight=False, markup=False)
    return 0


def waste_line(waste: Waste) -> str:
    """'data stall  30%  (3.0 s, $0.12)  over its threshold'."""
    money = f", {fmt_usd(waste.wasted_usd)}" if waste.wasted_usd is not None else ""
    over = "  over its threshold" if waste.flagged else ""
    return f"{waste.kind:<13} {100 * waste.fraction:3.0f}%  ({waste.wasted_s:.1f} s{money}){over}"


def report_main(args: argparse.Namespace, overrides: list[str]) -> int:
    """Write the HTML report of a run directory."""
    from meshyard.doctor.report import write_report  # needs matplotlib, an optional extra

    out = write_report(args.run_dir, args.out)
    print(f"meshyard: report written to {out}")
    return 0
