"""``meshyard slurm script|submit``: parsing and the call to ``sbatch``; the script's text
comes from ``meshyard.jobs.slurm``."""

from __future__ import annotations

import argparse
import shutil
import subprocess
import sys
import time

from meshyard.config.load import ConfigError, collect_config
from meshyard.config.sections import RunConfig
from meshyard.jobs.slurm import SlurmOptions, sbatch_script, slurm_dir, slurm_problems
from meshyard.validate import validate

DESCRIPTION = """\
Write the sbatch script of a meshyard job: one 'meshyard run' agent per node through srun,
meeting at the allocation's first host (c10d rendezvous on a port derived from the job id), with the run
directory named by the Slurm job id. Before the time limit (or on preemption) Slurm sends
USR1: every rank saves and stops, and the job requeues itself (at most fault.max_requeues
times) and resumes in the same run directory."""


def register(subparsers: argparse._SubParsersAction) -> None:
    """Register ``meshyard slurm`` with its ``script`` and ``submit`` subcommands."""
    p = subparsers.add_parser("slurm", help="write or submit an sbatch script for a config",
                              description=DESCRIPTION,
                              epilog="Config fields can be set with --section.field=value, as for 'meshyard run'.")
    p.set_defaults(handler=main)
    sub = p.add_subparsers(dest="slurm_command", required=True, metavar="{script,submit}")
    script = sub.add_parser("script", help="print the sbatch script", description="Print the sbatch script.")
    submit = sub.add_parser("submit", help="write the script into <run.dir>/slurm and sbatch it",
                            description="Write the script to <run.dir>/slurm/<run.name>-<timestamp>.sbatch, "
                            "submit it with sbatch and print the job id.")
    for q in (script, submit):
        _add_options(q)


def _add_options(p: argparse.ArgumentParser) -> None:
    p.add_argument("config", nargs="?", help="TOML config file (optional)")
    p.add_argument("--nodes", type=int, default=1, help="nodes of the job (default 1)")
    p.add_argument("--gpus-per-node", type=int, default=0, metavar="G",
                   help="GPUs per node, one worker each (default 0: a CPU job with run.nproc workers per node)")
    p.add_argument("--time", default="", help="time limit, as sbatch takes it (e.g. 2:00:00)")
    p.add_argument("--partition", default="", help="Slurm partition")
    p.add_argument("--account", default="", help="Slurm account")
    p.add_argument("--cpus-per-task", type=int, default=0, metavar="N", help="CPUs for each node's meshyard agent and its workers")
    p.add_argument("--mem", default="", help="memory per node, as sbatch takes it (e.g. 64G)")
    p.add_argument("--signal-grace", type=int, default=90, metavar="S",
                   help="seconds before the time limit that Slurm sends USR1 to save (default 90)")
    p.add_argument("--no-requeue", action="store_true", help="after saving on USR1, end instead of requeueing")
    p.add_argument("--sbatch", action="append", default=[], metavar="LINE",
                   help="one more sbatch option, e.g. --sbatch='--qos=high' (repeatable)")


def _options(args: argparse.Namespace) -> SlurmOptions:
    return SlurmOptions(
        nodes=args.nodes, gpus_per_node=args.gpus_per_node, time=args.time, partition=args.partition,
        account=args.account, cpus_per_task=args.cpus_per_task, mem=args.mem,
        signal_grace_s=args.signal_grace, requeue=not args.no_requeue, extra=tuple(args.sbatch),
    )


def main(args: argparse.Namespace, overrides: list[str]) -> int:
    """Run ``meshyard slurm script`` or ``submit``; bad input raises ``ConfigError``."""
    config, problems = collect_config(args.config, overrides)
    options = _options(args)
    # The whole config is checked here, for the job's world size, so that a mistake is
    # refused at once instead of after the job waited in the queue.
    per_node = options.gpus_per_node or config.run.nproc or 2  # 2: meshyard's default on the CPU
    validate(config, max(options.nodes, 1) * per_node, [*problems, *slurm_problems(config.run, config.fault, options)])
    text = sbatch_script(config, options)
    if args.slurm_command == "script":
        print(text, end="")
        return 0
    return submit(config.run, text)


SBATCH_TIMEOUT_S = 60


def submit(run: RunConfig, text: str) -> int:
    """Write ``text`` into ``<run.dir>/slurm`` and submit it; prints the job id."""
    if shutil.which("sbatch") is None:
        raise ConfigError(["sbatch is not on PATH: run 'meshyard slurm submit' on a Slurm login node, or print "
                           "the script with 'meshyard slurm script' and submit it there"], "slurm")
    folder = slurm_dir(run)
    # The job id is unknown until sbatch answers, so the script is named by the time.
    path = folder / f"{run.name}-{time.strftime('%Y%m%d-%H%M%S')}.sbatch"
    try:
        folder.mkdir(parents=True, exist_ok=True)  # Slurm opens the job's output file there
        path.write_text(text)
    except OSError as exc:
        raise ConfigError([f"run.dir: cannot write the job script into {folder} ({exc.strerror}); choose a "
                           "run.dir you can write to, on storage the nodes share"], "slurm") from None
    try:
        done = subprocess.run(["sbatch", "--parsable", str(path)], capture_output=True, text=True,
                              timeout=SBATCH_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        print(f"meshyard: sbatch did not answer within {SBATCH_TIMEOUT_S} s (is slurmctld up? 'scontrol ping' "
              f"says); the script is {path}", file=sys.stderr)
        return 1
    if done.returncode != 0:
        print(f"meshyard: sbatch refused {path}: {done.stderr.strip()}", file=sys.stderr)
        return 1
    job_id = done.stdout.strip().split(";")[0]
    print(f"meshyard: wrote {path}", file=sys.stderr)
    print(f"meshyard: submitted job {job_id}; output in {folder}/{run.name}-{job_id}.out, run directory "
          f"{folder.parent}/{run.name}-slurm{job_id}", file=sys.stderr)
    print(job_id, flush=True)
    return 0
