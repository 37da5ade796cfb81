"""Step records of a small made-up run, for the dashboard's tests."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from meshyard.run_dir import RunDir


def record(step: int) -> dict[str, Any]:
    """A GPU run's record at ``step``, with every figure the dashboard draws."""
    return {"step": step, "loss": 4.0 / step ** 0.5, "lr": 1e-3, "grad_norm": 1.0, "step_time_s": 0.1 + 0.01 * step,
            "data_time_s": 0.01, "tokens_per_s": 40000.0 + 500 * step, "samples_per_s": 40.0, "mfu": 0.3 + 0.01 * step,
            "tokens_seen": 1024 * step, "time": 1.7e9 + step, "data_s": 0.01, "forward_s": 0.03, "backward_s": 0.04,
            "comm_s": 0.01, "optimizer_s": 0.005, "other_s": 0.005 + 0.01 * step, "gpu_peak_reserved_bytes": 2**30,
            "gpu_peak_allocated_bytes": 2**29, "gpu_utilization_pct": 80.0 + step, "cost_per_step_usd": 0.001,
            "cost_so_far_usd": 0.001 * step, "cost_projected_usd": 0.1, "ranks": {"busy_s": [0.1, 0.1]}}


def append_records(run_dir: Path, steps: range) -> None:
    with RunDir(run_dir).metrics.open("a") as handle:
        handle.write("".join(json.dumps(record(step)) + "\n" for step in steps))


def make_run(run_dir: Path, steps: range) -> Path:
    """A run directory with ``steps`` recorded, one restart and one guard event."""
    run_dir.mkdir(parents=True, exist_ok=True)
    append_records(run_dir, steps)
    RunDir(run_dir).append_restart({"restart": 1, "resumed_step": 2, "steps_lost": 1, "resume_s": 4.5})
    RunDir(run_dir).guard.write_text(json.dumps({"event": "not kept", "step": 3, "reason": "loss spike"}) + "\n")
    return run_dir
