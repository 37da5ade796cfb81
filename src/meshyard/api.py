"""The Python entry point: ``meshyard.run(config)`` does what ``meshyard run`` does.

Example (a notebook or a launch script of your own)::

    import meshyard
    cfg = meshyard.load_config("examples/default.toml", ["--train.steps=50"])
    result = meshyard.run(cfg, nproc=2)
    print(result.run_dir, result.summary["final_loss"])
"""

from __future__ import annotations

import dataclasses
import os
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Sequence

import torch

from meshyard.checkpoint.locate import LocationError, Runs, latest_run_dir
from meshyard.checkpoint.resume import RESUME_MODES, ResumeError, find_explicit
from meshyard.config.checks import node_range
from meshyard.config.dump import config_to_dict
from meshyard.config.load import ConfigError
from meshyard.config.sections import Config
from meshyard.data.corpus import DataSourceError
from meshyard.data.loader import split_corpus
from meshyard.fault.preemption import EXIT_PREEMPTED, Preempted
from meshyard.launch.local import LauncherStopped, WorkerFailure, launch_local
from meshyard.launch.nodes import Nodes
from meshyard.metrics.records import read_metrics
from meshyard.plugins import PluginError, is_custom_reference, load_callable, unaccepted_keywords
from meshyard.run_dir import RunDir
from meshyard.runtime.devices import require_deterministic_cublas
from meshyard.runtime.job import Job
from meshyard.runtime.network import NetworkError
from meshyard.validate import validate, validate_local_launch
from meshyard.worker import run_worker, spawned_worker


WorkerArgs = tuple[dict[str, Any], str, str]
"""What every worker is started with: the config as plain values, the run directory, the resume mode."""


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
    problems = _plugin_problems(config)
    if not is_custom_reference(config.data.source):
        problems.extend(_corpus_problems(config))
    if problems:
        raise ConfigError(problems)


def _plugin_problems(config: Config) -> list[str]:
    """Model and dataset builders named as ``module:function`` that do not import, or a
    model builder that takes none of the ``model.options`` given."""
    problems = []
    for key, reference in (("model.name", config.model.name), ("data.source", config.data.source)):
        if not is_custom_reference(reference):
            continue
        try:
            builder = load_callable(reference)
        except PluginError as exc:
            problems.append(f"{key}: {exc}")
            continue
        unknown = unaccepted_keywords(builder, config.model.options) if key == "model.name" else []
        if unknown:
            problems.append(f"model.options: '{reference}' takes no keyword argument "
                            f"{', '.join(repr(name) for name in unknown)}")
    return problems


def _corpus_problems(config: Config) -> list[str]:
    """A built-in corpus that cannot be read, or that every worker would fail on: a model
    with fewer ids than the data (an index out of range on the first batch), a split
    without one global batch for its sampler."""
    try:
        train, _, vocab_size, description, _ = split_corpus(config.data)
    except DataSourceError as exc:
        return [str(exc)]
    problems = []
    if 0 < config.model.vocab_size < vocab_size:
        problems.append(f"model.vocab_size = {config.model.vocab_size} is smaller than the "
                        f"{vocab_size} token ids of {description}; raise it, or "
                        "leave it at 0 to take the data's")
    if len(train) < config.train.global_batch:
        problems.append(f"the training split of {description} has {len(train)} samples of "
                        f"{config.data.seq_len} tokens, fewer than one train.global_batch of "
                        f"{config.train.global_batch}; use more data (data.max_tokens, data.random_tokens, "
                        "data.paths) or a smaller train.global_batch / data.seq_len")
    return problems


def _resume_target(config: Config, resume: str) -> tuple[Config, str]:
    """Resolve ``latest`` to the run directory it continues (in place, as ``auto``), and
    check that it or an explicit location holds a valid checkpoint before any worker
    starts (a typo fails here, with exit code 2). Both are found by ``locate``, as
    ``meshyard ckpt`` finds them."""
    location = resume
    if resume == "latest":
        try:
            location = str(latest_run_dir(Runs(config.run.dir, config.run.name), config.checkpoint.storage_options))
        except LocationError as exc:
            raise ConfigError([f"--resume {exc}; or use --resume none to start fresh"]) from None
        config, resume = dataclasses.replace(config, run=dataclasses.replace(config.run, run_dir=location)), "auto"
    elif resume in RESUME_MODES:
        return config, resume
    try:
        find_explicit(location, config.checkpoint, lambda message: print(f"meshyard: {message}"))
    except (ResumeError, OSError) as exc:
        raise ConfigError([str(exc)]) from None
    return config, resume


def run(config: Config, nproc: int | None = None, resume: str = "auto", *,
        earlier_problems: Sequence[str] = ()) -> RunResult:
    """Train according to ``config``.

    Inside torchrun, Slurm or a Kubeflow pod this process becomes one rank of that job.
    Otherwise ``nproc`` (default ``config.run.nproc``; when that is 0, one per visible GPU
    if the run uses CUDA, else 2) local workers are started through
    the elastic agent (restarting them up to ``fault.max_restarts`` times); with one
    process the run happens in this process.

    ``resume``: ``auto`` (this run directory's newest valid checkpoint, if any),
    ``latest`` (continue the newest run of this name), ``none``, or a checkpoint, checkpoint
    folder or run directory (path or URL).

    ``earlier_problems``: problems already found in ``config`` while loading it (those of
    ``collect_config``); they are raised together with this function's own checks, so one
    message lists everything to fix.

    Raises ``ConfigError`` before starting anything if the configuration is invalid (more
    local workers than GPUs included, unless ``run.share_gpus`` allows it), and
    ``Preempted`` when the run stopped for a preemption signal after saving.
    """
    job = Job.detect()  # read once: a worker in this process is handed it
    env = job.environment
    if env is not None and not _launches_nodes_in_slurm(config, env.source):
        validate(config, env.world_size, earlier_problems)  # the one full check of this process
        config, resume = _resume_target(config, resume)
        return _run_as_rank(config, resume, job)
    config, _ = validate_local_launch(config, nproc, earlier_problems)
    config, resume = _resume_target(config, resume)
    launched = job.named(config.run.rdzv_id)
    nodes = _nodes_of(config, launched.id)
    prepare_inputs(config)  # before the run directory exists: bad input leaves nothing behind
    run_dir = launched.run_dir(config.run).path
    run_dir.mkdir(parents=True, exist_ok=True)
    print(f"meshyard: run directory {run_dir}", flush=True)
    # Workers inherit this environment, and cuBLAS reads the setting when CUDA starts in them.
    require_deterministic_cublas(config.train.deterministic, config.run.device, os.environ)
    args: WorkerArgs = (config_to_dict(config), str(run_dir), resume)
    if config.run.nproc == 1 and nodes is None:
        return RunResult(run_dir, _run_in_process(args, job))
    return RunResult(run_dir, _run_local_workers(config, args, run_dir, nodes))


def _launches_nodes_in_slurm(config: Config, source: str) -> bool:
    """An srun task told to launch a node of a multi-node job (``meshyard slurm``'s script
    runs one per node) starts that node's workers; it is not one rank of the srun step."""
    launches_nodes = (node_range(config.run.nnodes) or (1, 1))[1] > 1 or bool(config.run.rdzv_endpoint)
    return source == "slurm" and launches_nodes


def _nodes_of(config: Config, job_id: str) -> Nodes | None:
    """The nodes of a job on more than one node (None for one node), with this node's
    route to them. Such a job needs an id that every node and every restart share:
    ``run.rdzv_id`` or the scheduler's (``job_id``)."""
    low, high = node_range(config.run.nnodes) or (1, 1)
    if high == 1:
        return None
    if not job_id:
        raise ConfigError([f"run.nnodes = '{config.run.nnodes}' needs run.rdzv_id (--rdzv-id ID): one id that "
                           "every node and every restart of the job share; it names the run directory, so a "
                           "restarted job finds its checkpoints (e.g. --rdzv-id my-job-1)"])
    try:
        return Nodes.of(config.run, job_id)
    except NetworkError as exc:
        raise ConfigError([f"run.rdzv_endpoint: {exc}"], "launch") from None


def _run_as_rank(config: Config, resume: str, job: Job) -> RunResult:
    """This process is one rank of a job another launcher started (torchrun, Slurm, Kubeflow)."""
    summary = run_worker(config_to_dict(config), "", resume, job=job)
    run_dir = Path(summary["run_dir"]) if summary else job.run_dir(config.run).path
    return RunResult(run_dir, summary)


def _run_in_process(args: WorkerArgs, job: Job) -> dict[str, Any] | None:
    """One worker, in this process; the caller's torch thread count is given back after."""
    threads = torch.get_num_threads()
    try:
        return run_worker(*args, job=job)
    finally:
        torch.set_num_threads(threads)


def _run_local_workers(config: Config, args: WorkerArgs, run_dir: Path, nodes: Nodes | None) -> dict[str, Any] | None:
    """``config.run.nproc`` workers through the elastic agent (this node's share of
    ``nodes``); rank 0's summary (None on a node without rank 0).

    Raises ``Preempted`` when they stopped for a preemption signal after saving (all
    exited with ``EXIT_PREEMPTED``, or this process got the signal too), else
    ``WorkerFailure``.
    """
    fault = config.fault
    started = time.time()
    try:
        return launch_local(spawned_worker, args, config.run.nproc, fault.max_restarts, fault.grace_period_s,
                            fault.signals, run_dir, nodes).get(0)
    except WorkerFailure as failure:
        if failure.exit_codes and all(code == EXIT_PREEMPTED for code in failure.exit_codes):
            raise _preemption_from_record(run_dir, started) from None
        raise
    except LauncherStopped as stopped:
        # The signal reached this process too; the agent passed it on to the workers,
        # which saved (or not) within the grace period.
        preempted = _preemption_from_record(run_dir, started)
        if preempted.step < 0:
            raise WorkerFailure(f"stopped by signal {stopped.signal_number} before the workers could save; "
                                f"raise fault.grace_period_s if saves take longer", []) from None
        raise preempted from None


def _preemption_from_record(run_dir: Path, since: float) -> Preempted:
    """The preemption the workers recorded after ``since``: rank 0's record, else one a
    rank of this node left in its logs (a node without rank 0); step -1 if none."""
    record = RunDir(run_dir).read_preemption(since)
    if record is None:
        return Preempted(-1, "a signal", None)
    return Preempted(record["step"], record["signal"], record["checkpoint"])
