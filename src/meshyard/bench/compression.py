"""``meshyard bench compression``: one job, trained with each gradient compression.

Every method runs the same config for the same steps on the same workers. Reported per
method: bytes each rank sends per step once compression is on, the compression ratio,
the estimated wire bytes (ring all-reduce, all-gather for top-k), the step time over
the compressed steps, and the final loss with its gap to uncompressed training.

Where the bytes come from: the step records (``metrics.jsonl`` keys ``comm_bytes``,
``comm_bytes_uncompressed``, ``compression_ratio``, ``comm_wire_bytes``) when the run
wrote them; otherwise a short accounting run in this process: the same model and
hook on a one-rank group, stepped past the warm-up. The payload a rank contributes
does not depend on the number of ranks and is the same for every compressed step, so
that measurement is exact; the wire estimate is computed for the benchmark's ranks.
"""

from __future__ import annotations

import dataclasses
import statistics
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from meshyard.bench.report import (BenchInputError, bench_overrides, format_table, new_figure, save_figure,
                                   write_record)
from meshyard.comm import COMPRESSION_METHODS, build_compression
from meshyard.config.load import ConfigError, load_config
from meshyard.config.sections import Config
from meshyard.metrics.schema import keys_from
from meshyard.run_dir import RunDir
from meshyard.validate import validate, with_local_nproc


def parse_methods(text: str) -> list[str]:
    methods = [m.strip() for m in text.split(",") if m.strip()]
    unknown = [m for m in methods if m not in COMPRESSION_METHODS]
    if unknown or not methods:
        raise BenchInputError(f"--methods '{text}' names unknown compression methods "
                              f"({', '.join(unknown) or 'none given'}); known: {', '.join(COMPRESSION_METHODS)}")
    return list(dict.fromkeys(methods))


def plan_configs(config_path: str | None, overrides: list[str], methods: list[str], steps: int | None,
                 nproc: int | None, out_dir: Path) -> dict[str, Config]:
    """The config of each method, all validated before anything runs."""
    configs, problems = {}, []
    for method in methods:
        extra = [f"--comm.compression={method}", *bench_overrides(out_dir, method)]
        extra += [f"--train.steps={steps}"] if steps is not None else []
        extra += [f"--run.nproc={nproc}"] if nproc is not None else []
        cfg = with_local_nproc(load_config(config_path, [*overrides, *extra]))
        try:
            validate(cfg, cfg.run.nproc)
        except ConfigError as exc:
            problems.extend(f"with comm.compression = '{method}': {p}" for p in exc.problems)
        configs[method] = cfg
    if problems:
        raise ConfigError(sorted(set(problems), key=problems.index))
    return configs


def run_compression_bench(config_path: str | None, overrides: list[str], methods: list[str], steps: int | None,
                          nproc: int | None, out_dir: Path) -> list[dict[str, Any]]:
    """Train with each method; print and write the table, ``compression.png`` and ``.json``."""
    from meshyard.api import run

    configs = plan_configs(config_path, overrides, methods, steps, nproc, out_dir)
    results = []
    for method, cfg in configs.items():
        print(f"meshyard bench compression: {method}", flush=True)
        result = run(cfg, nproc=cfg.run.nproc)
        results.append(_summarise(method, cfg, result.metrics(), str(result.run_dir)))
    _add_loss_gap(results)
    rows = [(r["method"], r["comm_bytes_per_step"], r["compression_ratio"], r["comm_wire_bytes_per_step"],
             r["step_time_ms"], r["final_loss"], r["loss_gap_vs_none"]) for r in results]
    table = format_table(["method", "bytes/step", "ratio", "wire_bytes/step", "step_ms", "final_loss",
                          "loss_vs_none"], rows)
    first = next(iter(configs.values()))
    text = (f"{first.run.nproc} worker(s), {first.parallel.strategy}, {first.train.steps} steps, "
            f"compression from step {first.comm.warmup_steps + 1}; bytes per rank per compressed step "
            f"(source: {', '.join(sorted({r['bytes_source'] for r in results}))})\n{table}")
    print(text, flush=True)
    write_record(out_dir, "compression", {"config": config_path, "overrides": overrides, "results": results}, text)
    _plot(results, out_dir / "compression.png")
    return results


def _summarise(method: str, cfg: Config, records: list[dict[str, Any]], run_dir: str) -> dict[str, Any]:
    warmup = 0 if method == "none" else cfg.comm.warmup_steps
    compressed = records[warmup:] or records
    timed = records[max(warmup, 1):] or records  # step 1 also carries start-up work
    if "comm_bytes" in records[-1]:
        source = RunDir.METRICS
        figures = {key: statistics.fmean(r[key] for r in compressed)
                   for key in keys_from("comm.accounting") if key in records[-1]}
    else:
        source = "accounting run"
        figures = measure_step_bytes(cfg, cfg.run.nproc)
    return {
        "method": method, "bytes_source": source,
        "comm_bytes_per_step": figures.get("comm_bytes"), "compression_ratio": figures.get("compression_ratio"),
        "comm_wire_bytes_per_step": figures.get("comm_wire_bytes"),
        "step_time_ms": 1e3 * statistics.fmean(r["step_time_s"] for r in timed),
        "final_loss": records[-1]["loss"], "losses": [r["loss"] for r in records], "run_dir": run_dir,
    }


def _add_loss_gap(results: list[dict[str, Any]]) -> None:
    baseline = next((r["final_loss"] for r in results if r["method"] == "none"), None)
    for r in results:
        r["loss_gap_vs_none"] = r["final_loss"] - baseline if baseline is not None else None


def measure_step_bytes(cfg: Config, world_size: int) -> dict[str, Any]:
    """One compressed step's accounting for ``cfg``'s model, measured on a one-rank group
    in this process (see the module docstring for why that is exact)."""
    from torch.nn.parallel import DistributedDataParallel

    from meshyard.data.loader import custom_datasets, split_corpus
    from meshyard.models.registry import build_model
    from meshyard.plugins import is_custom_reference
    from meshyard.models.outputs import logits_of
    from meshyard.train.loss import next_token_loss

    if dist.is_initialized():
        return {}  # inside a job already: a private one-rank group cannot be made here
    vocab = (custom_datasets if is_custom_reference(cfg.data.source) else split_corpus)(cfg.data)[2]
    model = build_model(cfg.model, vocab, cfg.data.seq_len)
    # The payload after warm-up does not depend on the warm-up's length: use the shortest.
    comm = dataclasses.replace(cfg.comm, warmup_steps=2 if cfg.comm.compression == "powersgd" else 0)
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        ddp = DistributedDataParallel(model, bucket_cap_mb=cfg.parallel.bucket_mb)
        compression = build_compression(comm)
        compression.register(ddp)
        compression.counter.world_size = world_size  # wire estimate for the benchmark's ranks
        tokens = torch.randint(0, vocab, (1, cfg.data.seq_len + 1))
        for _ in range(comm.warmup_steps + 1):
            next_token_loss(logits_of(ddp(tokens[:, :-1])), tokens[:, 1:]).backward()  # the trainer's loss
            stats = compression.take_step_stats()
        return stats
    finally:
        dist.destroy_process_group()


def _plot(results: list[dict[str, Any]], path: Path) -> None:
    figure, (losses, sizes) = new_figure(2, "gradient compression")
    for r in results:
        losses.plot(range(1, len(r["losses"]) + 1), r["losses"], label=r["method"])
    losses.set_xlabel("step")
    losses.set_ylabel("loss")
    losses.legend()
    names = [r["method"] for r in results]
    sizes.bar(names, [r["comm_bytes_per_step"] or 0 for r in results])
    sizes.set_yscale("log")
    sizes.set_ylabel("bytes per rank per compressed step")
    save_figure(figure, path)
