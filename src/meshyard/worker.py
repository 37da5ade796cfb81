"""What every rank runs: join the job, build everything from the config, train, record.

``run_worker`` is the entry point of local workers started by the elastic agent, of
processes started by torchrun/Slurm/Kubeflow, and of single-process runs.
"""

from __future__ import annotations

import json
import os
import platform
import shutil
import sys
import threading
import time
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator

import torch
import torch.distributed as dist

from meshyard.checkpoint.resume import checkpoint_root, restart_count
from meshyard.config.dump import config_hash, config_to_toml
from meshyard.config.load import ConfigError, config_from_dict
from meshyard.config.sections import Config
from meshyard.errors import EXIT_BAD_INPUT
from meshyard.fault.failure import first_failure, record_bad_input, record_failure, this_attempt
from meshyard.fault.preemption import EXIT_PREEMPTED, NullWatcher, Preempted, PreemptionWatcher
from meshyard.launch.local import quiet_agent_logs
from meshyard.metrics.records import read_metrics, truncate_metrics
from meshyard.run_dir import RunDir, run_id_of
from meshyard.runtime.devices import require_deterministic_cublas
from meshyard.runtime.distributed import Runtime, init_distributed, rank0_decides, shutdown_distributed
from meshyard.runtime.job import Job
from meshyard.metrics.console import NullDisplay, ProgressDisplay
from meshyard.metrics.cost import cost_summary
from meshyard.train.build import BuiltRun, build_trainer
from meshyard.train.trainer import Trainer


def _write_run_record(run_dir: Path, cfg: Config, facts: dict[str, Any]) -> None:
    RunDir(run_dir).config.write_text(config_to_toml(cfg))
    if facts.get("tokenizer_file"):  # what 'meshyard serve' encodes and decodes this run's text with
        shutil.copyfile(facts["tokenizer_file"], RunDir(run_dir).tokenizer)
    record = {
        "config_hash": config_hash(cfg),
        "started": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "host": platform.node(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        **facts,
    }
    RunDir(run_dir).write_run_facts(record)


def run_worker(config_values: dict[str, Any], run_dir: str = "", resume: str = "auto", *,
               job: Job | None = None) -> dict[str, Any] | None:
    """Train as one rank of the job; rank 0 returns the run summary, others None.

    ``job``: this process's job as the caller already read it (``Job.detect``); read here
    when not given.

    Raises ``Preempted`` after the preemption checkpoint when a stop signal arrived, and
    ``RankFailed`` (its cause: the exception) for any other failure but a ``ConfigError``,
    after writing the traceback to this rank's log (``meshyard.fault.failure``).
    """
    cfg = config_from_dict(config_values)
    # Before the device is chosen: cuBLAS reads its workspace setting when CUDA starts.
    require_deterministic_cublas(cfg.train.deterministic, cfg.run.device, os.environ)
    job = job or Job.detect()
    where = _Whereabouts(int(os.environ.get("RANK", "0")), Path(run_dir) if run_dir else None)
    with _failures_recorded(where):
        runtime = init_distributed(job.environment, cfg.run.device, cfg.run.threads_per_rank,
                                   cfg.fault.collective_timeout_s, share_gpus=cfg.run.share_gpus)
    where.rank = runtime.rank
    watcher = _watch_signals(cfg.fault.signals)
    try:
        with _failures_recorded(where):
            return _train(cfg, runtime, job, where, resume, watcher)
    finally:
        watcher.restore()
        shutdown_distributed()


def spawned_worker(config_values: dict[str, Any], run_dir: str, resume: str) -> dict[str, Any] | None:
    """Entry point of workers started by the local elastic agent: a preempted worker
    exits with ``EXIT_PREEMPTED`` so the launcher can tell preemption from a crash, and
    one that found the input wrong with ``EXIT_BAD_INPUT`` (its problems recorded). The
    agent's own log records stay off the console: the launcher tells a failure."""
    with quiet_agent_logs():
        try:
            return run_worker(config_values, run_dir, resume)
        except Preempted:
            sys.exit(EXIT_PREEMPTED)
        except ConfigError as bad:  # the launcher says it in full, with exit code 2
            record_bad_input(bad.problems, bad.source, int(os.environ.get("RANK", "0")),
                             Path(run_dir) if run_dir else None)
            sys.exit(EXIT_BAD_INPUT)


@dataclass
class _Whereabouts:
    """This rank's number and run directory, as far as they are known yet: where a
    failure is recorded."""

    rank: int
    run_dir: Path | None


@contextmanager
def _failures_recorded(where: _Whereabouts) -> Iterator[None]:
    """An exception out of the block becomes a ``RankFailed`` (one paragraph), its
    traceback written to the rank's log. A ``ConfigError`` already is one clear message,
    and ``Preempted`` is no failure."""
    try:
        yield
    except (Preempted, ConfigError):
        raise
    except Exception as exc:
        raise record_failure(exc, where.rank, where.run_dir) from exc


def _watch_signals(names: list[str]) -> PreemptionWatcher | NullWatcher:
    if threading.current_thread() is not threading.main_thread():
        return NullWatcher()
    return PreemptionWatcher(names)


def _train(cfg: Config, runtime: Runtime, job: Job, where: _Whereabouts, resume: str,
           watcher: PreemptionWatcher | NullWatcher) -> dict[str, Any] | None:
    run_dir = Path(rank0_decides(lambda: str(_open_run_dir(cfg, job, where.run_dir))))
    run_dir.mkdir(parents=True, exist_ok=True)  # where ranks do not share rank 0's folder
    where.run_dir = run_dir
    built = build_trainer(cfg, runtime, run_dir, resume, watcher)
    trainer, facts, observers = built.trainer, built.facts, built.observers
    try:
        _note_restart(observers.display, cfg, run_dir)
        _announce(built, cfg, runtime, job, run_dir)
        summary = trainer.fit()
    except Preempted as stop:
        # Rank 0 keeps the run's record; every rank leaves a copy in its node's logs, so
        # the launcher of a node without rank 0 (and no shared run folder) knows too.
        _record_preemption(run_dir, stop, cfg.fault.grace_period_s, None if runtime.is_main else runtime.rank)
        raise
    finally:
        trainer.close()
    observers.logger.info("finished: %s", json.dumps(summary))
    dist.barrier()
    if not runtime.is_main:
        return None
    summary = {**summary, "run_dir": str(run_dir), "world_size": runtime.world_size,
               "strategy": cfg.parallel.strategy, "parameters": facts.parameters,
               **_cost_of(trainer, runtime.world_size, summary["mean_step_time_s"], run_dir)}
    RunDir(run_dir).write_summary(summary)
    observers.display.summary(summary)
    return summary


def _cost_of(trainer: Trainer, world_size: int, step_time_s: float, run_dir: Path) -> dict[str, Any]:
    """What the run's recorded steps cost, and what spot capacity would have with the
    restarts it recorded (nothing without a price)."""
    price = trainer.cost.price
    if price is None or not trainer.progress.step:
        return {}
    return cost_summary(price, world_size, trainer.progress.cost_so_far, step_time_s,
                        RunDir(run_dir).read_restarts())


def _open_run_dir(cfg: Config, job: Job, given: Path | None) -> Path:
    """Rank 0 names the run directory (``given`` by meshyard's launcher, else after the
    job: ``runtime.job``), creates it and fixes the run's id in it, once for the whole
    job. A name a restart would not find again is said on the console."""
    run_dir = job.run_dir(cfg.run, given).path
    run_dir.mkdir(parents=True, exist_ok=True)
    run_id_of(run_dir, job.id)
    advice = "" if given else job.restart_advice(cfg.run)
    if advice:
        print(advice, flush=True)
    return run_dir


def _identity(cfg: Config, job: Job, run_dir: Path) -> dict[str, Any]:
    """For run.json: the run's id, the job it belongs to, and where its checkpoints are
    (``--resume latest`` and ``meshyard ckpt`` find them there, ``checkpoint.dir`` too)."""
    root = checkpoint_root(cfg.checkpoint, run_dir)
    return {"run_id": run_id_of(run_dir), "job_id": job.id,
            RunDir.CHECKPOINTS_FACT: root if "://" in root else str(Path(root).expanduser().resolve())}


def _announce(built: BuiltRun, cfg: Config, runtime: Runtime, job: Job, run_dir: Path) -> None:
    """The run's facts to the rank log, run.json and restarts.jsonl (rank 0), and one
    line on the console."""
    facts, observers = built.facts, built.observers
    record = facts.record()
    observers.logger.info("started: pid %d restart %d %s", os.getpid(), restart_count(), json.dumps(record))
    resumed = facts.resumed_from
    if runtime.is_main:
        _write_run_record(run_dir, cfg, {**record, **_identity(cfg, job, run_dir)})
        _record_restart(run_dir, resumed.checkpoint if resumed else None, resumed.step if resumed else 0)
    observers.display.note(
        f"meshyard: {facts.parameters:,} parameters, {runtime.world_size} rank(s) on {runtime.device.type}/"
        f"{runtime.backend}, strategy {cfg.parallel.strategy}, global batch {facts.global_batch} = "
        f"{facts.micro_batch} x {facts.grad_accum} accum x {facts.dp_size} dp; data {facts.data}"
        + (f"; resumed from {resumed.checkpoint} at step {resumed.step}" if resumed else "")
    )


def _note_restart(display: ProgressDisplay | NullDisplay, cfg: Config, run_dir: Path) -> None:
    """After the elastic agent restarted the workers, one line on the console saying why:
    the agent's own report of the failure is kept off it (``launch.local``)."""
    job, restart = this_attempt()
    if restart > 0:
        cause = first_failure(run_dir, job, restart - 1) or f"a worker ended (see {RunDir(run_dir).agent_log})"
        display.note(f"meshyard: restart {restart} of fault.max_restarts = "
                                   f"{cfg.fault.max_restarts}, after {cause}")


def _record_restart(run_dir: Path, resumed_from: str | None, resumed_step: int) -> None:
    """After a restart or resume, drop metrics of steps that will be redone and note the cost."""
    if restart_count() == 0 and resumed_from is None:
        return
    records = read_metrics(run_dir) if RunDir(run_dir).metrics.exists() else []
    last_step = records[-1]["step"] if records else 0
    truncate_metrics(run_dir, resumed_step)
    entry = {"time": time.strftime("%Y-%m-%dT%H:%M:%S%z"), "restart": restart_count(),
             "resumed_from": resumed_from, "resumed_step": resumed_step,
             "last_recorded_step": last_step, "steps_lost": max(0, last_step - resumed_step)}
    if records:
        # The time to resume: from the last step recorded, through the failure or the
        # preemption, the restart and start-up, to the checkpoint loaded again.
        entry["resume_s"] = max(0.0, time.time() - records[-1]["time"])
    if os.environ.get("SLURM_RESTART_COUNT"):  # a requeued Slurm job: which requeue this is
        entry["requeue"] = int(os.environ["SLURM_RESTART_COUNT"])
    RunDir(run_dir).append_restart(entry)


def _record_preemption(run_dir: Path, stop: Preempted, grace_s: float, rank: int | None = None) -> None:
    """``preemption.json`` (rank 0, ``rank`` None) or this rank's copy under logs/."""
    elapsed = time.time() - stop.signal_time if stop.signal_time else None
    entry = {"time": time.strftime("%Y-%m-%dT%H:%M:%S%z"), "signal": stop.signal_name, "step": stop.step,
             "checkpoint": stop.checkpoint, "seconds_from_signal_to_commit": elapsed,
             "grace_period_s": grace_s, "within_grace": elapsed is None or elapsed <= grace_s}
    RunDir(run_dir).write_preemption(entry, rank)
