"""The Python entry point: ``meshyard.run(config)`` does what ``meshyard run`` does.

Example (a notebook or a launch script of your own)::

    import meshyard
    cfg = meshyard.load_config("examples/default.toml", ["--train.steps=50"])
    result = meshyard.run(cfg, nproc=2)
    print(result.run_dir, result.summary["final_loss"])
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from meshyard.config.dump import config_to_dict
from meshyard.config.sections import Config
from meshyard.config.validate import validate
from meshyard.data.corpus import load_corpus
from meshyard.launch.local import WorkerFailure, launch_local
from meshyard.metrics.records import read_metrics
from meshyard.plugins import PluginError, is_custom_reference, load_callable
from meshyard.config.load import ConfigError
from meshyard.data.corpus import DataSourceError
from meshyard.run_dir import resolve_run_dir
from meshyard.runtime.environment import detect_environment
from meshyard.worker import run_worker


@dataclass(frozen=True)
class RunResult:
    """Where the run wrote its records, and rank 0's summary (None on other ranks)."""

    run_dir: Path
    summary: dict[str, Any] | None

    def metrics(self) -> list[dict[str, Any]]:
        """Every step's record from ``metrics.jsonl``."""
        return read_metrics(self.run_dir)


def prepare_inputs(config: Config) -> None:
    """Fail fast, before any worker starts, on data or plugins that cannot be loaded.

    The corpus is tokenized into its cache here, once, rather than by every worker.
    """
    problems = []
    for key, reference in (("model.name", config.model.name), ("data.source", config.data.source)):
        if is_custom_reference(reference):
            try:
                load_callable(reference)
            except PluginError as exc:
                problems.append(f"{key}: {exc}")
    if not is_custom_reference(config.data.source):
        try:
            load_corpus(config.data)
        except DataSourceError as exc:
            problems.append(str(exc))
    if problems:
        raise ConfigError(problems)


def run(config: Config, nproc: int | None = None) -> RunResult:
    """Train according to ``config``.

    Inside torchrun, Slurm or a Kubeflow pod this process becomes one rank of that job.
    Otherwise ``nproc`` (default ``config.run.nproc``) local workers are started through
    the elastic agent; with one process the run happens in this process.
    Raises ``ConfigError`` before starting anything if the configuration is invalid.
    """
    env = detect_environment()
    if env is not None:
        validate(config, env.world_size)
        summary = run_worker(config_to_dict(config))
        run_dir = Path(summary["run_dir"]) if summary else resolve_run_dir(config.run)
        return RunResult(run_dir, summary)

    nproc = nproc or config.run.nproc
    config = dataclasses.replace(config, run=dataclasses.replace(config.run, nproc=nproc))
    validate(config, nproc)
    run_dir = resolve_run_dir(config.run)
    run_dir.mkdir(parents=True, exist_ok=True)
    print(f"meshyard: run directory {run_dir}", flush=True)
    prepare_inputs(config)
    args = (config_to_dict(config), str(run_dir))
    if nproc == 1:
        threads = torch.get_num_threads()
        try:
            summary = run_worker(*args)
        finally:
            torch.set_num_threads(threads)
    else:
        summary = launch_local(run_worker, args, nproc, config.run.max_restarts)[0]
    return RunResult(run_dir, summary)
