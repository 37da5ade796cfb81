"""The dashboard's figures from a run directory, read incrementally while the run trains.

Every source answers ``since(offset)`` with one payload (``Payload``): the records after
``offset``, the offset to ask from next, and the run's events. Here the offset is a byte
position in metrics.jsonl, so a page that polls every second reads only what was appended.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Protocol, TypedDict

from meshyard.doctor.figures import slim
from meshyard.metrics.records import read_new_metrics
from meshyard.run_dir import RunDir


class Payload(TypedDict):
    """What the page receives at each poll (``offset``: opaque to it, handed back next time)."""

    title: str
    offset: float
    reset: bool  # drop the records held: the source starts over (a resumed run trimmed its records)
    records: list[dict[str, Any]]
    events: list[dict[str, Any]]  # {"step", "kind": "restart" | "guard", "text"}, oldest first
    finished: bool


class Source(Protocol):
    """Where the figures come from: a run directory or a Prometheus server."""

    title: str

    def since(self, offset: float) -> Payload: ...


def restart_event(entry: dict[str, Any]) -> dict[str, Any]:
    """A line of restarts.jsonl as an event at the step training went on from."""
    how = f"restart {entry['restart']}" if entry.get("restart") else "resumed"
    lost = f", {entry['steps_lost']} step(s) redone" if entry.get("steps_lost") else ""
    took = f", {entry['resume_s']:.1f} s to resume" if "resume_s" in entry else ""
    return {"step": entry.get("resumed_step", 0), "kind": "restart",
            "text": f"{how}: from step {entry.get('resumed_step', 0)}{lost}{took}"}


def guard_event(entry: dict[str, Any]) -> dict[str, Any]:
    """A line of guard.jsonl (a step not kept, or a rollback) as an event."""
    if entry.get("event") == "rollback":
        text = f"rolled back from step {entry['step']} to step {entry.get('to_step')}"
    else:
        text = f"step {entry['step']} not kept ({entry.get('reason', 'guard')})"
    return {"step": entry["step"], "kind": "guard", "text": text}


class RunDirSource:
    """Follows one run directory."""

    def __init__(self, run_dir: str | Path) -> None:
        self.run = RunDir(Path(run_dir))
        self.title = self.run.path.name

    def since(self, offset: float) -> Payload:
        records, next_offset, reset = read_new_metrics(self.run.path, int(offset))
        events = [*map(restart_event, self.run.read_restarts()), *map(guard_event, self.run.read_guard())]
        return Payload(title=self.title, offset=next_offset, reset=reset, records=[slim(r) for r in records],
                       events=sorted(events, key=lambda event: event["step"]), finished=self.run.summary.exists())
