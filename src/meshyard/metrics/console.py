"""Rank 0's terminal output: a live progress bar (or periodic lines off a terminal) and a summary."""

from __future__ import annotations

import sys
from typing import Any

from rich.console import Console as RichConsole
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn, TimeRemainingColumn
from rich.table import Table

from meshyard.metrics.cost import fmt_usd
from meshyard.metrics.schema import PHASES, phase_key
from meshyard.metrics.waste import WasteWatch

# How the breakdown names the phases on one line.
_SHORT = {"forward": "fwd", "backward": "bwd", "optimizer": "opt"}


class ProgressDisplay:
    """Shows step, loss, tokens/s and ETA. Off a terminal (CI, pipes, log files) a bar
    would only produce escape codes, so one line is printed every ``log_every`` steps.

    With a ``waste`` watch, the waste above its thresholds (idle GPU, data stall, exposed
    communication) over the watch's window is flagged: judged every ``log_every`` steps,
    shown on the bar until the next judgement, or on that step's line."""

    def __init__(self, total_steps: int, log_every: int, use_bar: bool, waste: WasteWatch | None = None) -> None:
        self.console = RichConsole(file=sys.stdout)
        self.total = total_steps
        self.log_every = log_every
        self.live = use_bar and self.console.is_terminal
        self.waste = waste
        self.flags = ""
        self._progress: Progress | None = None
        self._task = None

    def start(self, first_step: int) -> None:
        if not self.live:
            return
        self._progress = Progress(
            TextColumn("[bold]step"), MofNCompleteColumn(), BarColumn(),
            TextColumn("loss {task.fields[loss]:.4f}  {task.fields[tps]:,.0f} tok/s  {task.fields[split]}"
                       "{task.fields[cost]}{task.fields[waste]}"),
            TimeElapsedColumn(), TextColumn("eta"), TimeRemainingColumn(),
            console=self.console, transient=False,
        )
        self._progress.start()
        self._task = self._progress.add_task("train", total=self.total, completed=first_step, loss=float("nan"),
                                             tps=0.0, split="", cost="", waste="")

    def update(self, record: dict[str, Any]) -> None:
        step = record["step"]
        logs = step % self.log_every == 0
        if self.waste is not None:
            self.waste.add(record)
            if logs:
                self.flags = "; ".join(self.waste.flags())
        if self._progress is not None:
            self._progress.update(self._task, completed=step, loss=record["loss"], tps=record["tokens_per_s"],
                                  split=breakdown(record), cost=_spaced(cost_text(record)),
                                  waste=_spaced(waste_text(self.flags)))
        elif logs or step == self.total or step == 1:
            extra = f"  eval {record['eval_loss']:.4f}" if "eval_loss" in record else ""
            split = f"  ({breakdown(record)})" if "forward_s" in record else ""
            self.console.print(
                f"step {step:>6}/{self.total}  loss {record['loss']:.4f}{extra}  lr {record['lr']:.2e}  "
                f"{record['tokens_per_s']:,.0f} tok/s  {record['step_time_s'] * 1000:.0f} ms/step{split}"
                f"{_spaced(cost_text(record))}{_spaced(waste_text(self.flags) if logs else '')}",
                highlight=False, soft_wrap=True,
            )

    def note(self, text: str) -> None:
        # Notes quote paths, configs and exception messages, whose brackets are not markup.
        (self._progress.console if self._progress else self.console).print(text, highlight=False, soft_wrap=True,
                                                                             markup=False)

    def stop(self) -> None:
        if self._progress is not None:
            self._progress.stop()
            self._progress = None

    def summary(self, summary: dict[str, Any]) -> None:
        table = Table(title="meshyard run summary", show_header=False)
        for key, value in summary.items():
            table.add_row(key.replace("_", " "), _format(value))
        self.console.print(table)


def breakdown(record: dict[str, Any]) -> str:
    """'data 1% fwd 30% bwd 51% comm 16% opt 2%' of one step (empty when not measured)."""
    if "forward_s" not in record:
        return ""
    total = record["step_time_s"]
    text = " ".join(f"{_SHORT.get(phase, phase)} {100 * record[phase_key(phase)] / total:.0f}%" for phase in PHASES)
    return text + (f" mfu {100 * record['mfu']:.0f}%" if "mfu" in record else "")


def cost_text(record: dict[str, Any]) -> str:
    """'cost $1.23, projected $4.56' of one step (empty without a price)."""
    if "cost_so_far_usd" not in record:
        return ""
    return f"cost {fmt_usd(record['cost_so_far_usd'])}, projected {fmt_usd(record['cost_projected_usd'])}"


def waste_text(flags: str) -> str:
    """'waste: idle GPU 42% of last 50 steps' (empty without flags)."""
    return f"waste: {flags}" if flags else ""


def _spaced(text: str) -> str:
    return f"  {text}" if text else ""


def _format(value: Any) -> str:
    if isinstance(value, float):
        return f"{value:,.0f}" if abs(value) >= 1000 else f"{value:.4g}"
    if isinstance(value, int):
        return f"{value:,}"
    return str(value)


class NullDisplay:
    """Every rank but 0 shows nothing."""

    def start(self, first_step: int) -> None: ...
    def update(self, record: dict[str, Any]) -> None: ...
    def note(self, text: str) -> None: ...
    def stop(self) -> None: ...
    def summary(self, summary: dict[str, Any]) -> None: ...
