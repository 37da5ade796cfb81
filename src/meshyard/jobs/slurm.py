"""The sbatch script of a meshyard job: one ``meshyard run`` agent per node through
``srun``, meeting at the allocation's first host, saving on ``USR1`` and requeueing itself.

Pure text building: nothing here runs Slurm (``meshyard.jobs.slurm_cli`` does).
"""

from __future__ import annotations

import dataclasses
import shlex
import sys
from dataclasses import dataclass
from pathlib import Path

from meshyard.config.dump import config_to_toml
from meshyard.config.load import ConfigError
from meshyard.config.sections import Config, FaultConfig, RunConfig
from meshyard.fault.preemption import EXIT_PREEMPTED

RDZV_PORT_BASE = 20000
"""The rendezvous port is RDZV_PORT_BASE + job id % 10000: jobs whose first host is the same
node (shared nodes) meet on different ports."""
_CONFIG_END = "MESHYARD_CONFIG_END"


@dataclass(frozen=True)
class SlurmOptions:
    """What ``meshyard slurm script`` asks of the allocation; empty strings and zeros leave
    the cluster's defaults."""

    nodes: int = 1
    gpus_per_node: int = 0
    time: str = ""
    partition: str = ""
    account: str = ""
    cpus_per_task: int = 0
    mem: str = ""
    signal_grace_s: int = 90
    requeue: bool = True
    extra: tuple[str, ...] = ()


def slurm_problems(run: RunConfig, fault: FaultConfig, options: SlurmOptions) -> list[str]:
    """What makes ``options`` unusable for a config's ``[run]`` and ``[fault]``, each with
    its fix; empty when fine."""
    checks = [
        (options.nodes >= 1, f"--nodes {options.nodes}: a job needs at least one node"),
        (options.gpus_per_node >= 0, f"--gpus-per-node {options.gpus_per_node} must not be negative"),
        (options.cpus_per_task >= 0, f"--cpus-per-task {options.cpus_per_task} must not be negative"),
        (not (options.gpus_per_node > 0 and run.device == "cpu"),
         f"--gpus-per-node {options.gpus_per_node} asks for GPUs but the config runs on the CPU "
         "(run.device = 'cpu'): drop --gpus-per-node, or set --run.device=auto or cuda"),
        (not (options.gpus_per_node == 0 and run.device == "cuda"),
         "the config runs on CUDA (run.device = 'cuda') but no GPUs are asked for: add --gpus-per-node G"),
        (options.signal_grace_s > 0, f"--signal-grace {options.signal_grace_s} must be a positive number of seconds"),
        ("SIGUSR1" in fault.signals,
         "fault.signals lacks SIGUSR1, the signal Slurm sends before the time limit: the job could not save "
         "and requeue; add it (--fault.signals='[\"SIGTERM\", \"SIGUSR1\"]')"),
    ]
    problems = [message for ok, message in checks if not ok]
    problems += [f"--sbatch {line!r}: one sbatch option per --sbatch, e.g. --sbatch '--qos=high'"
                 for line in options.extra if "\n" in line or not line.strip()]
    return problems


def slurm_dir(run: RunConfig) -> Path:
    """Where the job's scripts, config copies and Slurm output go: ``<run.dir>/slurm``."""
    return Path(run.dir).expanduser().resolve() / "slurm"


def sbatch_script(config: Config, options: SlurmOptions, workdir: Path | None = None,
                  python: str = sys.executable) -> str:
    """The sbatch script that runs ``config`` as asked by ``options``.

    The resolved config is embedded (with ``run.dir`` made absolute), so the job runs what
    was checked here even if the file changes later; ``workdir`` (default: the current
    folder) is where the job runs, so relative paths in the config mean the same there.
    Raises ``ConfigError`` naming every problem (``slurm_problems``).
    """
    problems = slurm_problems(config.run, config.fault, options)
    if problems:
        raise ConfigError(problems, "slurm options")
    workdir = (workdir or Path.cwd()).resolve()
    folder = slurm_dir(config.run)
    run = dataclasses.replace(config.run, dir=str(folder.parent))
    embedded = dataclasses.replace(config, run=run)
    parts = [
        "#!/bin/bash",
        "# Written by 'meshyard slurm script': one meshyard agent per node, saving on USR1 and",
        "# requeueing itself (the run directory is named by the job id, so the rerun resumes there).",
        *_sbatch_lines(config.run, options, folder, workdir),
        "set -u",
        _config_block(folder, config_to_toml(embedded)),
        _step_block(config.run, options, python),
        _requeue_block(config.fault, options),
    ]
    return "\n".join(parts) + "\n"


def _sbatch_lines(run: RunConfig, options: SlurmOptions, folder: Path, workdir: Path) -> list[str]:
    wanted = [
        f"--job-name={run.name}",
        f"--nodes={options.nodes}",
        "--ntasks-per-node=1",  # one agent per node; it starts the node's workers
        f"--gpus-per-node={options.gpus_per_node}" if options.gpus_per_node else "",
        f"--cpus-per-task={options.cpus_per_task}" if options.cpus_per_task else "",
        f"--mem={options.mem}" if options.mem else "",
        f"--time={options.time}" if options.time else "",
        f"--partition={options.partition}" if options.partition else "",
        f"--account={options.account}" if options.account else "",
        # B: the batch shell alone gets it; its trap hands it to every node's agent.
        f"--signal=B:USR1@{options.signal_grace_s}",
        "--requeue" if options.requeue else "--no-requeue",
        "--open-mode=append",  # a requeued run would otherwise truncate the log
        f"--output={folder}/{run.name}-%j.out",
        f"--chdir={workdir}",
        *(line.strip() for line in options.extra),
    ]
    return [line if line.startswith("#SBATCH") else f"#SBATCH {line}" for line in wanted if line]


def _config_block(folder: Path, toml_text: str) -> str:
    return "\n".join([
        f"config={shlex.quote(str(folder))}/config-$SLURM_JOB_ID.toml",
        'mkdir -p "$(dirname "$config")"',
        f"cat > \"$config\" <<'{_CONFIG_END}'",
        toml_text.rstrip("\n"),
        _CONFIG_END,
    ])


def _step_block(run: RunConfig, options: SlurmOptions, python: str) -> str:
    nproc = options.gpus_per_node or run.nproc
    command = [
        shlex.quote(python), "-m", "meshyard.cli", "run", '"$config"', "--nnodes", str(options.nodes),
        *(["--nproc-per-node", str(nproc)] if nproc else []),
        "--rdzv-endpoint", '"$head:$port"', "--rdzv-id", '"slurm$SLURM_JOB_ID"',
    ]
    return "\n".join([
        'head=$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n1)',
        f"port=$(({RDZV_PORT_BASE} + SLURM_JOB_ID % 10000))",
        # Each task is a node's agent, not a rank: told --nnodes and --rdzv-endpoint, meshyard
        # starts the node's workers itself instead of joining the srun step as one rank. srun
        # does not pass sbatch's CPUs per task on (Slurm 22.05+): without them the agent and
        # all its workers would share one CPU where Slurm binds tasks to their CPUs.
        "srun --kill-on-bad-exit=0 --ntasks-per-node=1 "
        '--cpus-per-task="${SLURM_CPUS_PER_TASK:-$SLURM_CPUS_ON_NODE}" ' + " ".join(command) + " &",
        "step=$!",
        # srun passes USR1 on to every node's agent, whose ranks save and exit 75.
        "trap 'echo \"meshyard: USR1: every rank saves and stops\"; kill -USR1 \"$step\" 2>/dev/null' USR1",
        # The shell acts on a trap only between commands or inside 'wait', never during a
        # foreground command: hence '&' and wait; a trapped signal ends 'wait' early, so wait
        # until the step is gone, then once more for its exit code.
        'while kill -0 "$step" 2>/dev/null; do wait "$step"; done',
        'wait "$step"; rc=$?',
    ])


def _requeue_block(fault: FaultConfig, options: SlurmOptions) -> str:
    if not options.requeue:
        return "exit $rc"
    limit = fault.max_requeues
    return "\n".join([
        # Bounded: a job that requeues itself on every signal would otherwise loop forever.
        f'if [ "$rc" -eq {EXIT_PREEMPTED} ] && [ "${{SLURM_RESTART_COUNT:-0}}" -lt {limit} ]; then',
        f'  echo "meshyard: saved; requeueing (restart ${{SLURM_RESTART_COUNT:-0}} of at most {limit})"',
        '  scontrol requeue "$SLURM_JOB_ID"',
        "fi",
        "exit $rc",
    ])
