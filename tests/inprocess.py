"""Train configs in-process through ``build_trainer``, without launching ``meshyard run``.

For tests of what a layout computes (parity, records, resumes), not of how processes
start: ``fit_here`` trains on one rank in the test process; ``fit_on_ranks`` trains several
configs one after another inside one spawn of ``world_size`` gloo ranks, which saves a
launch (agent, rendezvous, interpreter and torch start-up) per config; ``fit_in_order``
does the same for (config, resume) jobs, so a later job may continue a run an earlier one
finished; ``train_with_facts`` also hands back each trainer's facts (what a launched run
writes to run.json). Each returns, per config, the step records rank 0 wrote to its run
directory's metrics.jsonl.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from meshyard.config.sections import Config
from meshyard.metrics.records import read_metrics
from meshyard.runtime.distributed import Runtime
from meshyard.train.build import BuiltRun, build_trainer
from meshyard.validate import validate
from tests.ranks import run_on_ranks

Records = list[dict[str, Any]]


def cpu_runtime(rank: int = 0, world_size: int = 1) -> Runtime:
    """This process as rank ``rank`` of a gloo job on CPU (the process group must be up)."""
    return Runtime(rank=rank, world_size=world_size, local_rank=rank, device=torch.device("cpu"), backend="gloo")


def fitted(cfg: Config, run_dir: Path, rank: int = 0, world_size: int = 1, resume: str = "auto") -> BuiltRun:
    """A trainer built for ``cfg`` on this rank, fitted and closed (its progress and model
    stay readable), with the run's facts."""
    built = build_trainer(cfg, cpu_runtime(rank, world_size), run_dir, resume)
    try:
        built.trainer.fit()
    finally:
        built.trainer.close()
    return built


def _records(cfg: Config) -> Records:
    return read_metrics(cfg.run.run_dir)


Job = tuple[Config, str]
"""A config (with its own ``run.run_dir``) and where it resumes from: what ``meshyard.run``
takes as ``resume`` (``none``, ``auto`` or a checkpoint location, a run directory included)."""
Facts = dict[str, Any]


def fit_jobs(rank: int, world_size: int, jobs: list[Job]) -> list[Facts]:
    """On this rank (of a spawn), each job fitted in turn; each trainer's facts."""
    facts = []
    for cfg, resume in jobs:
        run_dir = Path(cfg.run.run_dir)
        run_dir.mkdir(parents=True, exist_ok=True)
        facts.append(fitted(cfg, run_dir, rank, world_size, resume).facts.record())
        dist.barrier()  # rank 0's records and checkpoints are complete before the next job starts
    return facts


def fit_each_with_facts(rank: int, world_size: int, configs: list[Config]) -> list[Facts]:
    """``fit_jobs`` of fresh runs (a rank function for ``tests.shared_spawn`` jobs)."""
    return fit_jobs(rank, world_size, [(cfg, "none") for cfg in configs])


def records_and_facts(configs: list[Config], facts: list[Facts]) -> list[tuple[Records, Facts]]:
    """Rank 0's step records of each config beside its facts."""
    return [(_records(cfg), config_facts) for cfg, config_facts in zip(configs, facts)]


def _validated(configs: list[Config], world_size: int) -> None:
    assert len({cfg.run.run_dir for cfg in configs}) == len(configs), "one run directory per config"
    for cfg in configs:
        validate(cfg, world_size)


def fit_in_order(jobs: list[Job], world_size: int) -> list[Records]:
    """Train each job on ``world_size`` ranks (one spawn for all, in the order given)."""
    _validated([cfg for cfg, _ in jobs], world_size)
    run_on_ranks(fit_jobs, jobs, world_size=world_size)
    return [_records(cfg) for cfg, _ in jobs]


def train_with_facts(configs: list[Config], world_size: int) -> list[tuple[Records, Facts]]:
    """Train each config afresh on ``world_size`` ranks (one spawn for all): rank 0's step
    records and its trainer's facts."""
    _validated(configs, world_size)
    facts = run_on_ranks(fit_each_with_facts, configs, world_size=world_size)[0]
    return records_and_facts(configs, facts)


def fit_on_ranks(configs: list[Config], world_size: int) -> list[Records]:
    """Train each config afresh on ``world_size`` ranks (one spawn for all); their records.

    Every config needs its own ``run.run_dir``; each is validated for ``world_size`` first.
    """
    return fit_in_order([(cfg, "none") for cfg in configs], world_size)


def fit_here(cfg: Config) -> Records:
    """Train ``cfg`` on one rank in this process (a gloo group on a hash store)."""
    validate(cfg, 1)
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    threads = torch.get_num_threads()
    try:
        fit_jobs(0, 1, [(cfg, "none")])
    finally:
        dist.destroy_process_group()
        torch.set_num_threads(threads)
    return _records(cfg)
