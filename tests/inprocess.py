"""Train configs in-process through ``build_trainer``, without launching ``meshyard run``.

For tests of what a layout computes (parity, records), not of how processes start:
``fit_here`` trains on one rank in the test process; ``fit_on_ranks`` trains several
configs one after another inside one spawn of ``world_size`` gloo ranks, which saves a
launch (agent, rendezvous, interpreter and torch start-up) per config. Each returns, per
config, the step records rank 0 wrote to its run directory's metrics.jsonl.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from meshyard.config.sections import Config
from meshyard.metrics.records import read_metrics
from meshyard.runtime.distributed import Runtime
from meshyard.train.build import build_trainer
from meshyard.train.trainer import Trainer
from meshyard.validate import validate
from tests.ranks import run_on_ranks

Records = list[dict[str, Any]]


def cpu_runtime(rank: int = 0, world_size: int = 1) -> Runtime:
    """This process as rank ``rank`` of a gloo job on CPU (the process group must be up)."""
    return Runtime(rank=rank, world_size=world_size, local_rank=rank, device=torch.device("cpu"), backend="gloo")


def fitted(cfg: Config, run_dir: Path, rank: int = 0, world_size: int = 1, resume: str = "auto") -> Trainer:
    """A trainer built for ``cfg`` on this rank, fitted and closed (its progress, facts and
    model stay readable)."""
    trainer = build_trainer(cfg, cpu_runtime(rank, world_size), run_dir, resume)
    try:
        trainer.fit()
    finally:
        trainer.close()
    return trainer


def _fit(cfg: Config, rank: int, world_size: int) -> None:
    run_dir = Path(cfg.run.run_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    fitted(cfg, run_dir, rank, world_size, resume="none")


def _records(cfg: Config) -> Records:
    return read_metrics(cfg.run.run_dir)


def _fit_each(rank: int, world_size: int, configs: list[Config]) -> None:
    for cfg in configs:
        _fit(cfg, rank, world_size)
        dist.barrier()  # rank 0's records are complete before the next config starts


def fit_on_ranks(configs: list[Config], world_size: int) -> list[Records]:
    """Train each config on ``world_size`` ranks (one spawn for all); their records.

    Every config needs its own ``run.run_dir``; each is validated for ``world_size`` first.
    """
    assert len({cfg.run.run_dir for cfg in configs}) == len(configs), "one run directory per config"
    for cfg in configs:
        validate(cfg, world_size)
    run_on_ranks(_fit_each, configs, world_size=world_size)
    return [_records(cfg) for cfg in configs]


def fit_here(cfg: Config) -> Records:
    """Train ``cfg`` on one rank in this process (a gloo group on a hash store)."""
    validate(cfg, 1)
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    threads = torch.get_num_threads()
    try:
        _fit(cfg, 0, 1)
    finally:
        dist.destroy_process_group()
        torch.set_num_threads(threads)
    return _records(cfg)
