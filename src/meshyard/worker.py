"""What every rank runs: join the job, build everything from the config, train, record.

``run_worker`` is the entry point of local workers started by the elastic agent, of
processes started by torchrun/Slurm/Kubeflow, and of single-process runs.
"""

from __future__ import annotations

import json
import os
import platform
import sys
import threading
import time
from pathlib import Path
from typing import Any, Callable

import torch
import torch.distributed as dist

from meshyard.checkpoint.manager import CheckpointManager, NullCheckpointManager
from meshyard.checkpoint.resume import (ResumePoint, agree_resume_point, checkpoint_root, load_resume_point,
                                        restart_count)
from meshyard.checkpoint.storage import CheckpointStore
from meshyard.config.dump import config_hash, config_to_toml
from meshyard.config.load import config_from_dict
from meshyard.config.sections import Config
from meshyard.config.validate import validate
from meshyard.data.loader import build_data
from meshyard.metrics.console import NullDisplay, ProgressDisplay
from meshyard.metrics.setup import build_exporters, build_meter, build_timer
from meshyard.fault.watchdog import HangWatchdog, NullWatchdog
from meshyard.fault.preemption import EXIT_PREEMPTED, NullWatcher, Preempted, PreemptionWatcher
from meshyard.metrics.records import JsonlWriter, NullWriter, Sinks, rank_logger, read_metrics, truncate_metrics
from meshyard.models.registry import build_model
from meshyard.parallel.data_parallel import unwrap
from meshyard.parallel.materialize import build_model_deferred, materialize, meta_init_applies
from meshyard.parallel.parallelize import parallelize, replicates_with_fsdp, uses_loss_parallel
from meshyard.train.pipeline_step import build_step_runner
from meshyard.train.step import MicroBatchStep
from meshyard.run_dir import resolve_run_dir, run_id_of
from meshyard.runtime.devices import require_deterministic_cublas
from meshyard.runtime.distributed import Runtime, init_distributed, shutdown_distributed
from meshyard.runtime.environment import detect_environment
from meshyard.train.optim import build_optimizer, build_scheduler, scaled_peak_lr
from meshyard.train.precision import build_precision, resolve_dtype
from meshyard.train.trainer import Trainer


def _cluster_job_id() -> str:
    """An id that stays the same when a cluster job restarts or is requeued, so the run
    directory (and its checkpoints) is found again."""
    if os.environ.get("SLURM_JOB_ID"):
        return f"slurm{os.environ['SLURM_JOB_ID']}"
    return os.environ.get("TORCHELASTIC_RUN_ID", "") if os.environ.get("TORCHELASTIC_RUN_ID") != "none" else ""


def _agree(decide: Callable[[], Any], is_main: bool) -> Any:
    """Rank 0's answer to ``decide()``, on every rank; if rank 0's decision raised, every
    rank raises it (instead of the others waiting forever for an answer)."""
    box: list[Any] = [None]
    if is_main:
        try:
            box[0] = decide()
        except Exception as exc:  # handed to every rank below
            box[0] = exc
    if dist.get_world_size() > 1:
        dist.broadcast_object_list(box, src=0)
    if isinstance(box[0], Exception):
        raise box[0]
    return box[0]


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


def run_worker(config_values: dict[str, Any], run_dir: str = "", resume: str = "auto") -> dict[str, Any] | None:
    """Train as one rank of the job; rank 0 returns the run summary, others None.

    Raises ``Preempted`` after the preemption checkpoint when a stop signal arrived.
    """
    cfg = config_from_dict(config_values)
    # Before the device is chosen: cuBLAS reads its workspace setting when CUDA starts.
    require_deterministic_cublas(cfg.train.deterministic, cfg.run.device, os.environ)
    runtime = init_distributed(detect_environment(), cfg.run.device, cfg.run.threads_per_rank,
                               cfg.fault.collective_timeout_s, share_gpus=cfg.run.share_gpus)
    watcher = _watch_signals(cfg.fault.signals)
    try:
        return _train(cfg, runtime, run_dir, resume, watcher)
    finally:
        watcher.restore()
        shutdown_distributed()


def spawned_worker(config_values: dict[str, Any], run_dir: str, resume: str) -> dict[str, Any] | None:
    """Entry point of workers started by the local elastic agent: a preempted worker
    exits with ``EXIT_PREEMPTED`` so the launcher can tell preemption from a crash."""
    try:
        return run_worker(config_values, run_dir, resume)
    except Preempted:
        sys.exit(EXIT_PREEMPTED)


def _watch_signals(names: list[str]) -> PreemptionWatcher | NullWatcher:
    if threading.current_thread() is not threading.main_thread():
        return NullWatcher()
    return PreemptionWatcher(names)


def _train(cfg: Config, runtime: Runtime, run_dir_text: str, resume: str,
           watcher: PreemptionWatcher | NullWatcher) -> dict[str, Any] | None:
    layout = validate(cfg, runtime.world_size)
    dims, batch = layout.dims, layout.batch
    run_dir = Path(_agree(lambda: run_dir_text or str(resolve_run_dir(cfg.run, _cluster_job_id())), runtime.is_main))
    run_dir.mkdir(parents=True, exist_ok=True)
    run_id = _agree(lambda: run_id_of(run_dir), runtime.is_main)  # marks this run's checkpoints
    display = (ProgressDisplay(cfg.train.steps, cfg.metrics.log_every, cfg.metrics.progress_bar)
               if runtime.is_main else NullDisplay())
    logger = rank_logger(run_dir, runtime.rank)
    report = _reporter(display, logger)
    # Watches start-up from here (with its own, longer timeout) and each step from the first.
    watched = cfg.fault.hang_timeout_s > 0 or cfg.fault.startup_timeout_s > 0
    watchdog = (HangWatchdog(run_dir, runtime.rank, runtime.world_size, runtime.store, cfg.fault.hang_timeout_s,
                             cfg.fault.hang_abort, report, startup_timeout_s=cfg.fault.startup_timeout_s)
                if watched and runtime.store is not None else NullWatchdog())
    timer = build_timer(cfg.metrics, runtime.device, watchdog.at)
    mesh, dp_mesh = dims.build_mesh(runtime.device.type)
    dp_rank = dp_mesh.get_local_rank()

    torch.manual_seed(cfg.train.seed)  # identical initial weights on every rank
    if cfg.train.deterministic:
        torch.use_deterministic_algorithms(True)
    data = build_data(cfg.data, batch.global_batch, batch.micro_batch, dp_rank, dims.dp, cfg.train.seed,
                      runtime.device)
    # Under FSDP and pipelining on the meta device: no rank ever holds the whole model.
    model, init_record = build_model_deferred(lambda: build_model(cfg.model, data.vocab_size, cfg.data.seq_len),
                                              runtime.device, meta_init_applies(cfg.parallel.strategy, dims.pp),
                                              logger.info, report)
    n_params = sum(p.numel() for p in model.parameters())  # meta parameters count too
    meter, throughput_facts = build_meter(cfg.metrics, timer, model, cfg.data.seq_len, runtime.device,
                                          resolve_dtype(cfg.precision.dtype, runtime.device), runtime.world_size)

    dtype = resolve_dtype(cfg.precision.dtype, runtime.device)
    # FSDP casts parameters itself; 'ddp' over pipeline stages or TP is FSDP replication.
    fsdp_casts = cfg.parallel.strategy == "fsdp" or replicates_with_fsdp(cfg.parallel, dims)
    model, compression = parallelize(model, dims, mesh, cfg.parallel, dtype, cfg.precision.reduce_fp32, cfg.comm,
                                     hook_wrapper=timer.comm.wrap if timer.comm else None)
    model_init = "meta" if init_record is not None else "device"
    if init_record is not None:
        materialize(model, init_record)  # this rank's shards and stages, valued as in a full build
    del init_record  # it holds the values of tensors built with them, in full
    if timer.enabled and runtime.device.type != "cuda" and dims.pp == 1:
        timer.fsdp.attach(model)  # FSDP's forward all-gather waits count as communication
    peak_lr = scaled_peak_lr(cfg.optim, batch.global_batch)
    zero_group = mesh["dp_replicate"].get_group() if cfg.parallel.strategy == "zero1" and dims.dp > 1 else None
    optimizer = build_optimizer(unwrap(model), cfg.optim, peak_lr, zero_group)
    scheduler = build_scheduler(optimizer, cfg.optim, cfg.train.steps)
    precision = build_precision(dtype, runtime.device, sharded_grads=fsdp_casts or dims.tp > 1 or dims.pp > 1,
                                model_casts=fsdp_casts, growth_interval=cfg.precision.loss_scale_growth_interval)

    facts = {
        "world_size": runtime.world_size, "backend": runtime.backend, "device": str(runtime.device),
        "strategy": cfg.parallel.strategy, "dp_replicate": dims.dp_replicate, "dp_shard": dims.dp_shard,
        "tp": dims.tp, "pp": dims.pp, "activation_checkpointing": cfg.parallel.ac,
        "global_batch": batch.global_batch, "micro_batch": batch.micro_batch, "grad_accum": batch.grad_accum,
        "dtype": str(dtype).removeprefix("torch."), "parameters": n_params, "peak_lr": peak_lr,
        "data": data.description, "train_samples": data.train_samples, **throughput_facts,
        "memory_capacity_bytes": meter.memory.capacity, "local_world_size": _local_world_size(runtime),
        "model_init": model_init,
    }
    logger.info("started: pid %d restart %d %s", os.getpid(), restart_count(), json.dumps(facts))
    own_root = checkpoint_root(cfg.checkpoint, run_dir)
    manifest_facts = {key: facts[key] for key in ("world_size", "strategy", "dp_replicate", "dp_shard",
                                                  "global_batch", "micro_batch")}
    manifest_facts.update(config_hash=config_hash(cfg), config=config_to_toml(cfg))
    checkpoints = (CheckpointManager(cfg.checkpoint, CheckpointStore(own_root, cfg.checkpoint.storage_options),
                                     runtime.rank, report, manifest_facts, run_id)
                   if cfg.checkpoint.enabled else NullCheckpointManager())
    writer = JsonlWriter(run_dir / "metrics.jsonl") if runtime.is_main and cfg.metrics.jsonl else NullWriter()
    exporters = build_exporters(cfg.metrics, run_dir) if runtime.is_main else []
    sinks = Sinks(display, writer, logger, exporters)
    trainer = Trainer(model, optimizer, scheduler, precision, data, batch, cfg.train, runtime.device,
                      dp_rank, cfg.data.seq_len, sinks, checkpoints, watcher,
                      extra_state={"comm": compression} if compression.state_dict() else None,
                      meter=meter, compression=compression, on_nonfinite=cfg.fault.on_nonfinite,
                      runner=build_step_runner(model, mesh, cfg.parallel, precision, runtime.device)
                      or MicroBatchStep(model, precision, runtime.device, timer,
                                        loss_parallel=uses_loss_parallel(cfg.parallel, dims)))
    verify_start = time.perf_counter()
    point = agree_resume_point(resume, own_root, cfg.checkpoint, restart_count() > 0, report, runtime.rank,
                               runtime.world_size)
    verify_s = time.perf_counter() - verify_start
    restored_rng = False
    if point is not None:
        load_start = time.perf_counter()
        restored_rng = load_resume_point(point, cfg.checkpoint, trainer, runtime.rank)
        facts["resumed_from"] = {"checkpoint": point.location, "step": trainer.progress.step,
                                 "load_s": time.perf_counter() - load_start, "verify_s": verify_s}
    if not restored_rng:
        # Different dropout masks per data-parallel rank; after a resume on another
        # layout, also different from the masks of the steps already taken.
        torch.manual_seed(cfg.train.seed + 1 + dp_rank + 1_000_003 * trainer.progress.step)
    if runtime.is_main:
        _write_run_record(run_dir, cfg, facts)
        _record_restart(run_dir, point, trainer.progress.step)
    display.note(
        f"meshyard: {n_params:,} parameters, {runtime.world_size} rank(s) on {runtime.device.type}/"
        f"{runtime.backend}, strategy {cfg.parallel.strategy}, global batch {batch.global_batch} = "
        f"{batch.micro_batch} x {batch.grad_accum} accum x {dims.dp} dp; data {data.description}"
        + (f"; resumed from {point.location} at step {trainer.progress.step}" if point else "")
    )
    try:
        summary = trainer.fit()
    except Preempted as stop:
        if runtime.is_main:
            _record_preemption(run_dir, stop, cfg.fault.grace_period_s)
        raise
    finally:
        watchdog.stop()
        sinks.close()
    logger.info("finished: %s", json.dumps(summary))
    dist.barrier()
    if not runtime.is_main:
        return None
    summary = {**summary, "run_dir": str(run_dir), "world_size": runtime.world_size,
               "strategy": cfg.parallel.strategy, "parameters": n_params}
    (run_dir / "summary.json").write_text(json.dumps(summary, indent=2))
    display.summary(summary)
    return summary


def _local_world_size(runtime: Runtime) -> int:
    """Ranks sharing this host (they share its memory on CPU)."""
    return int(os.environ.get("LOCAL_WORLD_SIZE", runtime.world_size if runtime.store is None else 1))


def _reporter(display: Any, logger: Any):
    def report(message: str) -> None:
        logger.warning(message)
        display.note(f"meshyard: {message}")
    return report


def _record_restart(run_dir: Path, point: ResumePoint | None, resumed_step: int) -> None:
    """After a restart or resume, drop metrics of steps that will be redone and note the cost."""
    if restart_count() == 0 and point is None:
        return
    records = read_metrics(run_dir) if (run_dir / "metrics.jsonl").exists() else []
    last_step = records[-1]["step"] if records else 0
    truncate_metrics(run_dir, resumed_step)
    entry = {"time": time.strftime("%Y-%m-%dT%H:%M:%S%z"), "restart": restart_count(),
             "resumed_from": point.location if point else None, "resumed_step": resumed_step,
             "last_recorded_step": last_step, "steps_lost": max(0, last_step - resumed_step)}
    with (run_dir / "restarts.jsonl").open("a") as handle:
        handle.write(json.dumps(entry) + "\n")


def _record_preemption(run_dir: Path, stop: Preempted, grace_s: float) -> None:
    elapsed = time.time() - stop.signal_time if stop.signal_time else None
    entry = {"time": time.strftime("%Y-%m-%dT%H:%M:%S%z"), "signal": stop.signal_name, "step": stop.step,
             "checkpoint": stop.checkpoint, "seconds_from_signal_to_commit": elapsed,
             "grace_period_s": grace_s, "within_grace": elapsed is None or elapsed <= grace_s}
    (run_dir / "preemption.json").write_text(json.dumps(entry, indent=2))
