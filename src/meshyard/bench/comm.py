"""``meshyard bench comm``: bandwidth and latency of the collectives on this machine.

Local workers are started by the elastic agent (as ``meshyard run`` does) on the
backend a run would use (NCCL on GPUs, gloo on CPU); each sweeps the operations over
the message sizes with ``meshyard.comm.collectives``.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

from meshyard.bench.report import BenchInputError, format_table, new_figure, save_figure, write_record
from meshyard.comm.collectives import OPERATIONS, sweep
from meshyard.launch.local import launch_local

_UNITS = {"": 1, "B": 1, "K": 2**10, "KB": 2**10, "KIB": 2**10, "M": 2**20, "MB": 2**20, "MIB": 2**20,
          "G": 2**30, "GB": 2**30, "GIB": 2**30}


def parse_size(text: str) -> int:
    """'4096', '64K', '16M', '1G' (binary units) -> bytes."""
    match = re.fullmatch(r"\s*(\d+)\s*([A-Za-z]*)\s*", text)
    if not match or match.group(2).upper() not in _UNITS or int(match.group(1)) < 1:
        raise BenchInputError(f"message size '{text}' is not a positive size such as 4096, 64K, 16M or 1G")
    return int(match.group(1)) * _UNITS[match.group(2).upper()]


def parse_ops(text: str) -> list[str]:
    ops = [op.strip().replace("-", "_") for op in text.split(",") if op.strip()]
    unknown = [op for op in ops if op not in OPERATIONS]
    if unknown or not ops:
        raise BenchInputError(f"--ops '{text}' names unknown collectives ({', '.join(unknown) or 'none given'}); "
                              f"known: {', '.join(OPERATIONS)}")
    return ops


def message_sizes(smallest: int, largest: int, factor: int = 4) -> list[int]:
    if smallest > largest:
        raise BenchInputError(f"--min-bytes ({smallest}) is larger than --max-bytes ({largest})")
    sizes = [smallest]
    while sizes[-1] * factor <= largest:
        sizes.append(sizes[-1] * factor)
    return sizes


def comm_worker(ops: list[str], sizes: list[int], iters: int, warmup: int) -> list[dict[str, Any]] | None:
    """One rank: join the job like a training worker, sweep, return rank 0's records."""
    from meshyard.runtime.distributed import init_distributed, shutdown_distributed
    from meshyard.runtime.environment import detect_environment

    runtime = init_distributed(detect_environment(), "auto", threads_per_rank=1)
    try:
        records = sweep(ops, sizes, iters, warmup, runtime.device)
        return [{**r, "backend": runtime.backend} for r in records] if runtime.is_main else None
    finally:
        shutdown_distributed()


def run_comm_bench(nproc: int, ops: list[str], sizes: list[int], iters: int, warmup: int,
                   out_dir: Path) -> list[dict[str, Any]]:
    """Measure, print the table and write ``comm.json``, ``comm.txt`` and ``comm.png``."""
    if nproc < 1 or iters < 1 or warmup < 0:
        raise BenchInputError(f"--nproc ({nproc}) and --iters ({iters}) must be at least 1, --warmup ({warmup}) "
                              "at least 0")
    records = launch_local(comm_worker, (ops, sizes, iters, warmup), nproc)[0]
    rows = [(r["op"], _human(r["size_bytes"]), r["count"], r["time_us"], r["algbw_gbps"], r["busbw_gbps"])
            for r in records]
    table = format_table(["op", "size", "count", "time_us", "algbw_GB/s", "busbw_GB/s"], rows)
    latency: dict[str, float] = {}
    for r in records:  # in order of size within each operation: the first is the smallest
        latency.setdefault(r["op"], r["time_us"])
    peak = {op: max(r["busbw_gbps"] for r in records if r["op"] == op) for op in ops}
    summary = "\n".join(f"{op}: latency {latency[op]:.1f} us (smallest message), peak busbw {peak[op]:.3f} GB/s"
                        for op in ops)
    backend = records[0]["backend"] if records else "?"
    text = f"{nproc} rank(s), backend {backend}\n{table}\n{summary}"
    print(text, flush=True)
    write_record(out_dir, "comm", {"nproc": nproc, "iters": iters, "warmup": warmup, "results": records,
                                   "latency_us": latency, "peak_busbw_gbps": peak}, text)
    _plot(records, ops, nproc, out_dir / "comm.png")
    return records


def _plot(records: list[dict[str, Any]], ops: list[str], nproc: int, path: Path) -> None:
    figure, (bandwidth, latency) = new_figure(2, f"collectives on {nproc} rank(s)")
    for op in ops:
        mine = [r for r in records if r["op"] == op]
        sizes = [r["size_bytes"] for r in mine]
        bandwidth.plot(sizes, [r["busbw_gbps"] for r in mine], marker="o", label=op)
        latency.plot(sizes, [r["time_us"] for r in mine], marker="o", label=op)
    for axis, label in ((bandwidth, "bus bandwidth (GB/s)"), (latency, "time per call (us)")):
        axis.set_xscale("log", base=2)
        axis.set_xlabel("message size (bytes)")
        axis.set_ylabel(label)
        axis.legend()
    latency.set_yscale("log")
    save_figure(figure, path)


def _human(size: int) -> str:
    for unit, scale in (("G", 2**30), ("M", 2**20), ("K", 2**10)):
        if size >= scale and size % scale == 0:
            return f"{size // scale}{unit}"
    return str(size)
