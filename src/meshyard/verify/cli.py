"""``meshyard verify CONFIG``: the argument parser and the command (library calls only)."""

from __future__ import annotations

import argparse

from meshyard.launch.local import WorkerFailure
from meshyard.validate import load_and_validate
from meshyard.verify.compare import verify_layout

EXIT_PASS, EXIT_FAIL = 0, 1


def register(subparsers: argparse._SubParsersAction) -> None:
    """Register ``meshyard verify``; it takes config overrides for the layout it checks."""
    p = subparsers.add_parser(
        "verify", help="check that a parallel layout trains the same model as one process",
        description="Train the config for a few steps on one process and on its configured layout (same "
        "seed, data and global batch), then compare per-step losses and gradient norms and the final "
        "parameters. Prints a table and PASS/FAIL. Exit code 0 on PASS, 1 on FAIL, 2 on bad input.",
        epilog="Any field can be set with --section.field=value, e.g. --parallel.tp=2 --parallel.pp=2.",
    )
    p.add_argument("config", nargs="?", help="TOML config file (optional)")
    p.add_argument("--steps", type=int, default=5, help="optimizer steps of each run (default 5)")
    p.add_argument("--nproc", type=int, help="ranks of the layout run (default run.nproc)")
    p.add_argument("--workdir", help="keep both run directories under this folder (default: a temporary one)")
    p.set_defaults(handler=main)


def main(args: argparse.Namespace, overrides: list[str]) -> int:
    from meshyard.config.load import ConfigError

    if args.steps < 1:
        raise ConfigError([f"--steps = {args.steps} must be at least 1"], "arguments")
    if args.nproc is not None:
        overrides = [*overrides, f"--run.nproc={args.nproc}"]
    config, _ = load_and_validate(args.config, overrides)
    print(f"meshyard verify: {args.steps} steps on 1 process, then on {config.run.nproc} ranks ...", flush=True)
    try:
        report = verify_layout(config, config.run.nproc, args.steps, args.workdir)
    except WorkerFailure:
        # The verdict on stdout with the table's; the failure's own paragraph goes to stderr.
        print("FAIL: a run did not finish, so there is nothing to compare; its error follows", flush=True)
        raise
    print(report.format(), flush=True)
    return EXIT_PASS if report.passed else EXIT_FAIL
