"""``build_trainer``: from a config and a joined process group to a Trainer ready to fit.

Every rank of a run calls it (``meshyard.worker``); tests and notebooks can call it
in-process too. The steps, in order, each a function below:

1. observe: every rank's host, display, rank log, hang watchdog, step timer;
2. layout: ``Layout`` from the parallel config and the world size, the batch plan, the
   one DeviceMesh;
3. data: the stateful sampler at this rank's data-parallel index;
4. model: built (on the meta device where the layout shards it), parallelized, then
   materialized (``model.init_from``'s source is checked against the data before);
5. optimization: optimizer (ZeRO-1 partitioned when the layout says so), LR schedule,
   precision;
6. checkpointer: the bundle of Stateful parts and the manager that commits them;
7. the Trainer and the run's facts (``train.facts.RunFacts``), then resume: every rank
   agrees on the checkpoint to start from and loads it;
8. initialize: a run that resumed nothing reads ``model.init_from``'s weights, each rank
   its own shards and stages (``train.start``).

What the layout implies is asked of ``Layout``; nothing here branches on the strategy.
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Callable

import torch
from torch.distributed.device_mesh import DeviceMesh

from meshyard.checkpoint.checkpointer import Checkpointer, TrainingState
from meshyard.checkpoint.manager import CheckpointManager, NullCheckpointManager
from meshyard.checkpoint.resume import ResumeError, checkpoint_root, restart_count
from meshyard.checkpoint.storage import CheckpointStore
from meshyard.config.dump import config_hash, config_to_toml
from meshyard.config.checks import profile_window
from meshyard.config.sections import Config
from meshyard.data.loader import DataBundle, build_data
from meshyard.fault.guard import SpikeGuard
from meshyard.fault.preemption import NullWatcher, PreemptionWatcher
from meshyard.fault.watchdog import HangWatchdog, NullWatchdog
from meshyard.metrics.console import NullDisplay, ProgressDisplay
from meshyard.metrics.profiling import NullProfiler, StepProfiler
from meshyard.metrics.records import JsonlWriter, NullWriter, Sinks, rank_logger
from meshyard.metrics.setup import build_cost, build_exporters, build_meter, build_timer
from meshyard.metrics.waste import WasteWatch
from meshyard.models.registry import build_model
from meshyard.parallel.data_parallel import unwrap
from meshyard.parallel.compile import Compilation, inductor_options, resolve_compile
from meshyard.parallel.layout import Layout
from meshyard.parallel.materialize import build_model_deferred, materialize
from meshyard.parallel.parallelize import Parallelized, parallelize
from meshyard.parallel.pipeline import example_micro_batch, tied_groups, tied_weight_group
from meshyard.run_dir import RunDir, run_id_of
from meshyard.runtime.batch_plan import BatchPlan
from meshyard.runtime.distributed import Runtime, rank0_decides
from meshyard.runtime.hosts import gather_host_labels
from meshyard.train.facts import Resumed, RunFacts, Throughput
from meshyard.train.optim import build_optimizer, build_scheduler, built_step, scaled_peak_lr
from meshyard.train.pipeline_step import PipelineStep
from meshyard.train.start import StartFrom, initialize, start_from
from meshyard.train.precision import build_precision, resolve_dtype
from meshyard.train.state import DataPosition, ScalerState, SchedulerState, TrainProgress
from meshyard.train.step import MicroBatchStep, StepRunner
from meshyard.train.trainer import Feed, Optimization, Services, Trainer
from meshyard.validate import derive_layout


@dataclass(frozen=True)
class Observers:
    """Where a rank reports: the console display (rank 0), its log, the watchdog, the timer;
    and every rank's host label (indexed by rank), to name a rank's host in reports."""

    display: ProgressDisplay | NullDisplay
    logger: Any
    watchdog: HangWatchdog | NullWatchdog
    timer: Any
    hosts: tuple[str, ...] = ()

    def report(self, message: str) -> None:
        """A warning for the log and the console."""
        self.logger.warning(message)
        self.display.note(f"meshyard: {message}")


@dataclass(frozen=True)
class Placement:
    """The layout on this job: degrees, batch arithmetic, the mesh, this rank's dp index."""

    layout: Layout
    batch: BatchPlan
    mesh: DeviceMesh
    dp_rank: int


@dataclass(frozen=True)
class Assembled:
    """A rank's Trainer before it resumes, the run's facts, and where its weights start
    from when it resumes nothing (with the full model's tied parameter names)."""

    trainer: Trainer
    facts: RunFacts
    start: StartFrom | None = None
    ties: list[set[str]] = field(default_factory=list)


@dataclass(frozen=True)
class BuiltRun:
    """A rank's Trainer ready to fit, what the run is, and where the rank reports."""

    trainer: Trainer
    facts: RunFacts
    observers: Observers


def build_trainer(cfg: Config, runtime: Runtime, run_dir: Path, resume: str = "auto",
                  preemption: PreemptionWatcher | NullWatcher | None = None) -> BuiltRun:
    """A Trainer for this rank of the job ``runtime`` describes, resumed as ``resume``
    says (``auto``, ``none``, or a location ``checkpoint.locate`` understands), with the
    run's facts (where it resumed from among them) and its observers.

    The config must have been validated for this world size (``meshyard.validate``);
    here only the layout is derived. Every rank calls this together: it runs collectives.
    """
    if resume == "latest":
        raise ResumeError("resume = 'latest' names a run by run.name, which meshyard.run resolves to that run's "
                          "directory; pass that directory as run_dir (with resume = 'auto') or as resume")
    observers = observe(cfg, runtime, run_dir)
    try:
        assembled = assemble(cfg, runtime, run_dir, observers, preemption)
    except BaseException:
        observers.watchdog.stop()  # no trainer to close it: the watchdog would report a hang later
        raise
    trainer = assembled.trainer
    try:
        resumed = resume_trainer(trainer, cfg, runtime, run_dir, resume, observers.report)
        initialize(trainer.model, assembled.start, assembled.ties, resumed, observers.report,
                   _noter(observers, runtime))
    except BaseException:
        trainer.close()
        raise
    return BuiltRun(trainer, replace(assembled.facts, resumed_from=resumed), observers)


def _noter(observers: Observers, runtime: Runtime) -> Callable[[str], None]:
    """A line for this rank's log, and for the console from rank 0."""
    def note(message: str) -> None:
        observers.logger.info(message)
        if runtime.is_main:
            observers.display.note(f"meshyard: {message}")
    return note


def assemble(cfg: Config, runtime: Runtime, run_dir: Path, observers: Observers,
             preemption: PreemptionWatcher | NullWatcher | None) -> Assembled:
    """Steps 2 to 7 above, up to a Trainer that has not resumed yet, and the run's facts."""
    placement = place(cfg, runtime)
    torch.manual_seed(cfg.train.seed)  # identical initial weights on every rank
    if cfg.train.deterministic:
        torch.use_deterministic_algorithms(True)
    batch = placement.batch
    data = build_data(cfg.data, batch.global_batch, batch.micro_batch, placement.dp_rank, batch.dp_size,
                      cfg.train.seed, runtime.device)
    for warning in data.warnings:
        if runtime.is_main:  # every rank's would say the same
            observers.report(warning)
    start = start_from(cfg.model, cfg.data, data.vocab_size, data.description)
    dtype = resolve_dtype(cfg.precision.dtype, runtime.device)
    parallelized, parameters, model_init, ties = build_parallel_model(cfg, runtime, placement, data, dtype,
                                                                      observers)
    meter, throughput = build_meter(cfg.metrics, observers.timer, parallelized.model, cfg.data.seq_len,
                                    runtime.device, dtype, runtime.world_size, observers.hosts)
    cost = build_cost(cfg.run.gpu_hour_price, cfg.run.spot_hour_price, runtime.device, runtime.world_size,
                      cfg.train.steps)
    optimization = build_optimization(cfg, parallelized, placement, dtype, runtime.device)
    compile_whole = resolve_compile(cfg.train.compile, runtime.device) and placement.layout.compiles_whole
    graphs = cfg.train.cuda_graphs and runtime.device.type == "cuda"
    if cfg.train.cuda_graphs and not graphs and runtime.is_main:  # validate refused an explicit CPU device
        compiled = "the compiled steps run" if compile_whole else "training runs"
        observers.report(f"train.cuda_graphs: no CUDA device (training on {runtime.device.type}); {compiled} "
                         "without graphs")
    runner = build_step_runner(parallelized, placement.mesh, optimization, runtime.device, observers,
                               _compilation(cfg, graphs) if compile_whole else None, cfg.train.fused_linear_loss)
    facts = RunFacts(
        parameters=parameters, model_init=model_init, compiled=runner.compilation.describe() or "nothing",
        world_size=runtime.world_size, local_world_size=_local_world_size(runtime), backend=runtime.backend,
        device=str(runtime.device), **placement.layout.facts(), hosts=observers.hosts,
        global_batch=batch.global_batch, micro_batch=batch.micro_batch, grad_accum=batch.grad_accum,
        dtype=str(dtype).removeprefix("torch."), peak_lr=scaled_peak_lr(cfg.optim, batch.global_batch),
        optimizer_step=built_step(optimization.optimizer),
        data=data.description, train_samples=data.train_samples, memory_capacity_bytes=meter.memory.capacity,
        tokenizer_file=str(data.tokenizer_file or ""),
        throughput=Throughput(**throughput) if throughput else None, price=cost.price,
    )
    progress = TrainProgress()
    guard = SpikeGuard(cfg.guard) if cfg.guard.enabled else None
    checkpointer = build_checkpointer(cfg, runtime, run_dir, parallelized, optimization, data, placement.batch,
                                      progress, facts, observers.report, guard)
    guard_log = JsonlWriter(RunDir(run_dir).guard) if guard is not None and runtime.is_main else NullWriter()
    services = Services(Sinks(observers.display, _writer(cfg, runtime, run_dir), observers.logger,
                              build_exporters(cfg.metrics, run_dir) if runtime.is_main else []),
                        meter, checkpointer, preemption or NullWatcher(), observers.watchdog, guard_log, cost,
                        _profiler(cfg, runtime, run_dir, observers))
    trainer = Trainer(parallelized, runner,
                      optimization, Feed(data, batch, cfg.data.seq_len, placement.dp_rank), cfg.train, services,
                      progress, on_nonfinite=cfg.fault.on_nonfinite, guard=guard,
                      snapshot_every=cfg.guard.snapshot_every)
    return Assembled(trainer, facts, start, ties)


def observe(cfg: Config, runtime: Runtime, run_dir: Path) -> Observers:
    """Every rank's host label (one collective, first: the watchdog names hosts), the
    display (rank 0), this rank's log file, the hang watchdog (watching start-up with its
    own, longer timeout, then each step) and the step timer."""
    hosts = tuple(gather_host_labels())
    display = (ProgressDisplay(cfg.train.steps, cfg.metrics.log_every, cfg.metrics.progress_bar,
                               WasteWatch(cfg.metrics)) if runtime.is_main else NullDisplay())
    logger = rank_logger(run_dir, runtime.rank)
    report = Observers(display, logger, NullWatchdog(), None).report
    fault = cfg.fault
    watched = (fault.hang_timeout_s > 0 or fault.startup_timeout_s > 0) and runtime.store is not None
    watchdog = (HangWatchdog(run_dir, runtime.rank, runtime.world_size, runtime.store, fault.hang_timeout_s,
                             fault.hang_abort, report, startup_timeout_s=fault.startup_timeout_s, hosts=hosts)
                if watched else NullWatchdog())
    return Observers(display, logger, watchdog, build_timer(cfg.metrics, runtime.device, watchdog.at), hosts)


def place(cfg: Config, runtime: Runtime) -> Placement:
    """The layout for this world size (checked against it: an external launcher may start
    another world size than the config was validated for), the batch plan, the mesh and
    this rank's data-parallel index."""
    derived = derive_layout(cfg, runtime.world_size)
    mesh, dp_mesh = derived.dims.build_mesh(runtime.device.type)
    return Placement(derived.layout, derived.batch, mesh, dp_mesh.get_local_rank())


def build_parallel_model(cfg: Config, runtime: Runtime, placement: Placement, data: DataBundle,
                         dtype: torch.dtype, observers: Observers) -> tuple[Parallelized, int, str, list[set[str]]]:
    """The model, parallelized by the layout. Under FSDP and pipelining it is built on the
    meta device and materialized after sharding: no rank ever holds the whole model.
    Returns it, its number of parameters, how it was initialised ("meta" or "device") and
    the names sharing a weight in the whole model (a pipeline stage holds one of them)."""
    layout = placement.layout
    model, init_record = build_model_deferred(lambda: build_model(cfg.model, data.vocab_size, cfg.data.seq_len),
                                              runtime.device, layout.meta_init, observers.logger.info,
                                              observers.report)
    n_params = sum(p.numel() for p in model.parameters())  # meta parameters count too
    ties = tied_groups(model)
    timer = observers.timer
    compile_blocks = resolve_compile(cfg.train.compile, runtime.device) and not layout.compiles_whole
    parallelized = parallelize(model, layout, placement.mesh, dtype, cfg.precision.reduce_fp32, cfg.comm,
                               hook_wrapper=timer.comm.wrap if timer.comm else None, log=observers.logger.info,
                               example_tokens=example_micro_batch(placement.batch.micro_batch, layout.microbatches,
                                                                  cfg.data.seq_len),
                               compilation=_compilation(cfg) if compile_blocks else None)
    model_init = "meta" if init_record is not None else "device"
    if init_record is not None:
        # This rank's shards and stages, valued as in a full build.
        materialize(parallelized.model, init_record, offloaded=layout.effective_cfg.cpu_offload)
    del init_record  # it holds the values of tensors built with them, in full
    if timer.enabled and layout.times_fsdp_waits(runtime.device.type):
        timer.fsdp.attach(parallelized.model)  # FSDP's forward all-gather waits count as communication
    return parallelized, n_params, model_init, ties


def build_optimization(cfg: Config, parallelized: Parallelized, placement: Placement, dtype: torch.dtype,
                       device: torch.device) -> Optimization:
    """Optimizer (its state partitioned over the replicas under ZeRO-1), LR schedule with
    the peak scaled to the global batch, and the step's numerics."""
    layout = placement.layout
    peak_lr = scaled_peak_lr(cfg.optim, placement.batch.global_batch)
    zero_group = placement.mesh["dp_replicate"].get_group() if layout.zero1 else None
    precision = build_precision(dtype, device, sharded_grads=layout.sharded_grads, model_casts=layout.model_casts,
                                growth_interval=cfg.precision.loss_scale_growth_interval)
    optimizer = build_optimizer(unwrap(parallelized.model), cfg.optim, peak_lr, zero_group,
                                precision.sharded_loss_scaling)
    scheduler = build_scheduler(optimizer, cfg.optim, cfg.train.steps)
    return Optimization(optimizer, scheduler, precision)


def _profiler(cfg: Config, runtime: Runtime, run_dir: Path, observers: Observers) -> StepProfiler | NullProfiler:
    """torch.profiler over metrics.profile_steps, on every rank."""
    window = profile_window(cfg.metrics)
    if window is None:
        return NullProfiler()
    return StepProfiler(*window, RunDir(run_dir).profile, runtime.rank, runtime.device, observers.report)


def _compilation(cfg: Config, cuda_graphs: bool = False) -> Compilation:
    """What ``train.compile`` and ``train.compile_tuning`` ask of each compiled region, and
    ``cuda_graphs`` of the model-and-loss region (``train.cuda_graphs`` on a CUDA device)."""
    return Compilation(cfg.train.compile, inductor_options(cfg.train.compile_tuning, cuda_graphs))


def build_step_runner(parallelized: Parallelized, mesh: DeviceMesh, optimization: Optimization,
                      device: torch.device, observers: Observers,
                      whole_model_compile: Compilation | None = None, fused_loss: bool = False) -> StepRunner:
    """A pipeline schedule for a pipelined layout, micro-batches one after another through
    the whole (possibly sharded) model otherwise. ``whole_model_compile``: where the model
    and its loss compile as one region (``Layout.compiles_whole``), the runner compiles
    them into it; otherwise it runs the blocks ``parallelize`` compiled, if any. ``fused_loss``
    (``train.fused_linear_loss``, never pipelined): the model computes its loss itself."""
    layout, model, precision = parallelized.layout, parallelized.model, optimization.precision
    if not layout.pipelined:
        return MicroBatchStep(model, precision, device, observers.timer, loss_parallel=layout.loss_parallel,
                              compilation=whole_model_compile or parallelized.compilation,
                              compile_whole=whole_model_compile is not None, report=observers.report,
                              sequence=parallelized.sequence, fused_loss=fused_loss)
    tied_group = tied_weight_group(mesh) if model.tied else None
    return PipelineStep(model, mesh["pp"].get_group(), layout.cfg.pp_schedule, layout.microbatches, precision,
                        device, tied_group, parallelized.compilation)


def _local_world_size(runtime: Runtime) -> int:
    """Ranks sharing this host (they share its memory on CPU)."""
    return int(os.environ.get("LOCAL_WORLD_SIZE", runtime.world_size if runtime.store is None else 1))


def build_checkpointer(cfg: Config, runtime: Runtime, run_dir: Path, parallelized: Parallelized,
                       optimization: Optimization, data: DataBundle, batch: BatchPlan, progress: TrainProgress,
                       facts: RunFacts, report: Callable[[str], None], guard: SpikeGuard | None = None) -> Checkpointer:
    """The checkpointer over this run's Stateful parts (the guard's counters and window
    among them when it is on). Its manifests carry the layout and the config, and this
    run's id (the same on every rank and every restart)."""
    optimizer = optimization.optimizer
    compression = parallelized.compression
    state = TrainingState(
        parallelized.model, optimizer,
        shared={"progress": progress, "scheduler": SchedulerState(optimization.scheduler, optimizer),
                "scaler": ScalerState(optimization.precision.scaler), "data": DataPosition(data, batch, progress),
                **({"guard": guard} if guard is not None else {})},
        per_rank={"comm": compression},
        zero1=parallelized.layout.zero1,
    )
    run_id = rank0_decides(lambda: run_id_of(run_dir))  # marks this run's checkpoints
    if not cfg.checkpoint.enabled:
        return Checkpointer(NullCheckpointManager(), state, runtime.rank, cfg.checkpoint)
    manifest_facts = {**facts.manifest(), "config_hash": config_hash(cfg), "config": config_to_toml(cfg)}
    store = CheckpointStore(checkpoint_root(cfg.checkpoint, run_dir), cfg.checkpoint.storage_options)
    manager = CheckpointManager(cfg.checkpoint, store, runtime.rank, report, manifest_facts, run_id,
                                device=runtime.device)
    return Checkpointer(manager, state, runtime.rank, cfg.checkpoint)


def resume_trainer(trainer: Trainer, cfg: Config, runtime: Runtime, run_dir: Path, resume: str,
                   report: Callable[[str], None]) -> Resumed | None:
    """Load the checkpoint every rank agrees on (if any) and seed what it did not restore;
    returns where the run resumed from (None for a fresh start)."""
    verify_start = time.perf_counter()
    point = trainer.checkpoints.choose(resume, checkpoint_root(cfg.checkpoint, run_dir), restart_count() > 0, report,
                                       runtime.world_size)
    verify_s = time.perf_counter() - verify_start
    restored_rng, resumed = False, None
    if point is not None:
        load_start = time.perf_counter()
        restored_rng = trainer.checkpoints.load(point)
        resumed = Resumed(point.location, trainer.progress.step, time.perf_counter() - load_start, verify_s)
    if not restored_rng:
        # Different dropout masks per data-parallel rank; after a resume on another
        # layout, also different from the masks of the steps already taken.
        torch.manual_seed(cfg.train.seed + 1 + trainer.dp_rank + 1_000_003 * trainer.progress.step)
    return resumed


def _writer(cfg: Config, runtime: Runtime, run_dir: Path) -> JsonlWriter | NullWriter:
    """metrics.jsonl, written by rank 0."""
    return JsonlWriter(RunDir(run_dir).metrics) if runtime.is_main and cfg.metrics.jsonl else NullWriter()
