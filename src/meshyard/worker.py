"""What every rank runs: join the job, build everything from the config, train, record.

``run_worker`` is the entry point of local workers started by the elastic agent, of
processes started by torchrun/Slurm/Kubeflow, and of single-process runs.
"""

from __future__ import annotations

import json
import platform
import time
import warnings
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from meshyard.config.dump import config_hash, config_to_toml
from meshyard.config.load import config_from_dict
from meshyard.config.sections import Config
from meshyard.config.validate import validate
from meshyard.data.loader import build_data
from meshyard.metrics.console import NullDisplay, ProgressDisplay
from meshyard.metrics.records import JsonlWriter, NullWriter, rank_logger
from meshyard.models.registry import build_model
from meshyard.parallel.data_parallel import unwrap
from meshyard.parallel.parallelize import parallelize
from meshyard.run_dir import resolve_run_dir
from meshyard.runtime.distributed import init_distributed, shutdown_distributed
from meshyard.runtime.environment import detect_environment
from meshyard.train.optim import build_optimizer, build_scheduler, scaled_peak_lr
from meshyard.train.precision import build_precision, resolve_dtype
from meshyard.train.trainer import Sinks, Trainer


def _agree_on_run_dir(cfg: Config, run_dir: str, is_main: bool) -> Path:
    """Rank 0 chooses the directory when the launcher did not; every rank adopts it."""
    choice = [run_dir or (str(resolve_run_dir(cfg.run)) if is_main else "")]
    if dist.get_world_size() > 1:
        dist.broadcast_object_list(choice, src=0)
    return Path(choice[0])


def _write_run_record(run_dir: Path, cfg: Config, facts: dict[str, Any]) -> None:
    (run_dir / "config.toml").write_text(config_to_toml(cfg))
    record = {
        "config_hash": config_hash(cfg),
        "started": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "host": platform.node(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        **facts,
    }
    (run_dir / "run.json").write_text(json.dumps(record, indent=2))


def run_worker(config_values: dict[str, Any], run_dir: str = "") -> dict[str, Any] | None:
    """Train as one rank of the job; rank 0 returns the run summary, others None."""
    cfg = config_from_dict(config_values)
    # torchdata calls a deprecated torch function on every loader start; nothing to act on.
    warnings.filterwarnings("ignore", message=".*set_vital.*")
    runtime = init_distributed(detect_environment(), cfg.run.device, cfg.run.threads_per_rank)
    try:
        return _train(cfg, runtime, run_dir)
    finally:
        shutdown_distributed()


def _train(cfg: Config, runtime, run_dir_text: str) -> dict[str, Any] | None:
    layout = validate(cfg, runtime.world_size)
    dims, batch = layout.dims, layout.batch
    run_dir = _agree_on_run_dir(cfg, run_dir_text, runtime.is_main)
    run_dir.mkdir(parents=True, exist_ok=True)
    mesh, dp_mesh = dims.build_mesh(runtime.device.type)
    dp_rank = dp_mesh.get_local_rank()

    torch.manual_seed(cfg.train.seed)  # identical initial weights on every rank
    if cfg.train.deterministic:
        torch.use_deterministic_algorithms(True)
    data = build_data(cfg.data, batch.global_batch, batch.micro_batch, dp_rank, dims.dp, cfg.train.seed)
    with runtime.device:
        model = build_model(cfg.model, data.vocab_size, cfg.data.seq_len)
    n_params = sum(p.numel() for p in model.parameters())

    dtype = resolve_dtype(cfg.precision.dtype, runtime.device)
    sharded = cfg.parallel.strategy == "fsdp"
    model = parallelize(model, dims, mesh, cfg.parallel, dtype, cfg.precision.reduce_fp32)
    peak_lr = scaled_peak_lr(cfg.optim, batch.global_batch)
    zero_group = mesh["dp_replicate"].get_group() if cfg.parallel.strategy == "zero1" and dims.dp > 1 else None
    optimizer = build_optimizer(unwrap(model), cfg.optim, peak_lr, zero_group)
    scheduler = build_scheduler(optimizer, cfg.optim, cfg.train.steps)
    precision = build_precision(dtype, runtime.device, sharded)
    # Different dropout masks per data-parallel rank, the same across model-parallel peers.
    torch.manual_seed(cfg.train.seed + 1 + dp_rank)

    facts = {
        "world_size": runtime.world_size, "backend": runtime.backend, "device": str(runtime.device),
        "strategy": cfg.parallel.strategy, "dp_replicate": dims.dp_replicate, "dp_shard": dims.dp_shard,
        "global_batch": batch.global_batch, "micro_batch": batch.micro_batch, "grad_accum": batch.grad_accum,
        "dtype": str(dtype).removeprefix("torch."), "parameters": n_params, "peak_lr": peak_lr,
        "data": data.description, "train_samples": data.train_samples,
    }
    if runtime.is_main:
        _write_run_record(run_dir, cfg, facts)
    display = (ProgressDisplay(cfg.train.steps, cfg.metrics.log_every, cfg.metrics.progress_bar)
               if runtime.is_main else NullDisplay())
    writer = JsonlWriter(run_dir / "metrics.jsonl") if runtime.is_main and cfg.metrics.jsonl else NullWriter()
    logger = rank_logger(run_dir, runtime.rank)
    logger.info("started: %s", json.dumps(facts))
    display.note(
        f"meshyard: {n_params:,} parameters, {runtime.world_size} rank(s) on {runtime.device.type}/"
        f"{runtime.backend}, strategy {cfg.parallel.strategy}, global batch {batch.global_batch} = "
        f"{batch.micro_batch} x {batch.grad_accum} accum x {dims.dp} dp; data {data.description}"
    )
    trainer = Trainer(model, optimizer, scheduler, precision, data, batch, cfg.train, runtime.device,
                      dp_mesh.get_group(), dp_rank, cfg.data.seq_len, Sinks(display, writer, logger))
    try:
        summary = trainer.fit()
    finally:
        writer.close()
    logger.info("finished: %s", json.dumps(summary))
    dist.barrier()
    if not runtime.is_main:
        return None
    summary = {**summary, "run_dir": str(run_dir), "world_size": runtime.world_size,
               "strategy": cfg.parallel.strategy, "parameters": n_params}
    (run_dir / "summary.json").write_text(json.dumps(summary, indent=2))
    display.summary(summary)
    return summary
