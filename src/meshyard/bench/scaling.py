"""``meshyard bench scaling``: the same job at several worker counts, side by side.

Weak scaling keeps the batch each worker processes: the per-worker batch is the
config's ``train.global_batch / run.nproc`` and the global batch grows with the
workers. Strong scaling keeps ``train.global_batch`` and splits it further. In both,
speedup = throughput(n) / throughput(n0) and efficiency = speedup / (n / n0), with n0
the smallest worker count; throughput is tokens per second over the steps after the
first (which includes start-up work).
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import torch

from meshyard.bench.report import (BenchInputError, bench_overrides, format_table, new_figure, save_figure,
                                   write_record)
from meshyard.config.load import ConfigError, load_config
from meshyard.config.sections import Config
from meshyard.validate import validate, with_local_nproc

MODES = ("weak", "strong")


def parse_workers(text: str) -> list[int]:
    """'1,2,4' -> [1, 2, 4]: distinct positive integers, in increasing order."""
    parts = [part.strip() for part in text.split(",")]
    if not parts or not all(part.isdigit() and int(part) >= 1 for part in parts):
        raise BenchInputError(
            f"--workers '{text}' is not a comma-separated list of positive worker counts, e.g. --workers 1,2,4"
        )
    counts = [int(part) for part in parts]
    if len(set(counts)) != len(counts):
        raise BenchInputError(f"--workers '{text}' repeats a worker count")
    return sorted(counts)


def plan_configs(config_path: str | None, overrides: list[str], workers: list[int], mode: str,
                 steps: int | None, out_dir: Path) -> dict[int, Config]:
    """The config of each worker count, all validated before anything runs."""
    if mode not in MODES:
        raise BenchInputError(f"--mode '{mode}' is not one of {', '.join(MODES)}")
    base = with_local_nproc(load_config(config_path, overrides))
    if mode == "weak" and base.train.global_batch % base.run.nproc:
        raise BenchInputError(
            f"weak scaling takes the per-worker batch from train.global_batch / run.nproc = "
            f"{base.train.global_batch} / {base.run.nproc}, which is not a whole number; adjust either"
        )
    per_worker = base.train.global_batch // base.run.nproc
    configs, problems = {}, []
    for n in workers:
        batch = per_worker * n if mode == "weak" else base.train.global_batch
        extra = [f"--run.nproc={n}", f"--train.global_batch={batch}", *bench_overrides(out_dir, f"workers{n}")]
        if steps is not None:
            extra.append(f"--train.steps={steps}")
        cfg = load_config(config_path, [*overrides, *extra])
        try:
            validate(cfg, n)
        except ConfigError as exc:
            problems.extend(f"with {n} worker(s): {p}" for p in exc.problems)
        configs[n] = cfg
    if problems:
        raise ConfigError(problems)
    return configs


def run_scaling_bench(config_path: str | None, overrides: list[str], workers: list[int], mode: str,
                      steps: int | None, out_dir: Path) -> list[dict[str, Any]]:
    """Run every worker count; print and write the table, ``scaling.png`` and ``scaling.json``."""
    from meshyard.api import run

    configs = plan_configs(config_path, overrides, workers, mode, steps, out_dir)
    points = []
    for n, cfg in configs.items():
        print(f"meshyard bench scaling: {n} worker(s), global batch {cfg.train.global_batch}", flush=True)
        result = run(cfg, nproc=n)
        summary = result.summary or {}
        points.append({"workers": n, "global_batch": cfg.train.global_batch,
                       "per_worker_batch": cfg.train.global_batch // n, "strategy": cfg.parallel.strategy,
                       "tokens_per_s": summary.get("tokens_per_s"), "step_time_s": summary.get("mean_step_time_s"),
                       "final_loss": summary.get("final_loss"), "run_dir": str(result.run_dir)})
    _add_speedup(points)
    rows = [(p["workers"], p["global_batch"], p["tokens_per_s"], _ms(p["step_time_s"]), p["speedup"],
             p["efficiency"], p["final_loss"]) for p in points]
    table = format_table(["workers", "global_batch", "tokens/s", "step_ms", "speedup", "efficiency",
                          "final_loss"], rows)
    text = f"{mode} scaling\n{table}{_oversubscription_note(workers)}"
    print(text, flush=True)
    write_record(out_dir, "scaling", {"mode": mode, "config": config_path, "overrides": overrides,
                                      "points": points}, text)
    _plot(points, mode, out_dir / "scaling.png")
    return points


def _ms(seconds: float | None) -> float | None:
    return seconds * 1e3 if seconds is not None else None


def _add_speedup(points: list[dict[str, Any]]) -> None:
    base, base_workers = points[0]["tokens_per_s"], points[0]["workers"]
    for point in points:
        speedup = point["tokens_per_s"] / base if point["tokens_per_s"] and base else None
        point["speedup"] = speedup
        point["efficiency"] = speedup / (point["workers"] / base_workers) if speedup is not None else None


def _oversubscription_note(workers: list[int]) -> str:
    cores = os.cpu_count() or 1
    if torch.cuda.is_available() or max(workers) <= cores:
        return ""
    return (f"\nnote: {max(workers)} workers on {cores} CPU cores share cores, so these figures show the cost of "
            "communication and contention, not the speedup more hardware would give")


def _plot(points: list[dict[str, Any]], mode: str, path: Path) -> None:
    figure, (throughput, efficiency) = new_figure(2, f"{mode} scaling")
    workers = [p["workers"] for p in points]
    measured = [p["tokens_per_s"] or 0.0 for p in points]
    throughput.plot(workers, measured, marker="o", label="measured")
    throughput.plot(workers, [measured[0] * n / workers[0] for n in workers], linestyle="--", label="linear")
    throughput.set_ylabel("tokens / s")
    efficiency.plot(workers, [p["efficiency"] or 0.0 for p in points], marker="o")
    efficiency.axhline(1.0, linestyle="--", color="grey")
    efficiency.set_ylabel("scaling efficiency")
    efficiency.set_ylim(bottom=0)
    for axis in (throughput, efficiency):
        axis.set_xlabel("workers")
        axis.set_xticks(workers)
    throughput.legend()
    save_figure(figure, path)
