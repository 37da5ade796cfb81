"""The ``meshyard`` command. Subcommands only parse arguments and call library functions.

Every command has one shape: its module's ``register(subparsers)`` adds its parser and
binds, with ``set_defaults``, a handler ``(args, overrides) -> exit code`` (``handler``),
whether it takes ``--section.field`` overrides (``takes_overrides``, default yes) and
which of its errors it tells under its own name (``own_errors``, ``error_prefix``). Bad
input is ``meshyard.errors.BadInput``: one paragraph on stderr, exit code 2.
"""

from __future__ import annotations

import argparse
import dataclasses
import sys

from meshyard.bench import cli as bench_cli
from meshyard.checkpoint import cli as checkpoint_cli
from meshyard.config.dump import config_to_toml
from meshyard.config.load import ConfigError, collect_config, group_override_tokens, load_config
from meshyard.config.sections import Config
from meshyard.data import cli as data_cli
from meshyard.doctor import cli as doctor_cli
from meshyard.doctor.dashboard import cli as dashboard_cli
from meshyard.errors import EXIT_BAD_INPUT, BadInput, call_command
from meshyard.export import cli as export_cli
from meshyard.fault.preemption import EXIT_PREEMPTED, Preempted
from meshyard.jobs import k8s_cli
from meshyard.jobs import slurm_cli
from meshyard.launch.local import WorkerFailure
from meshyard.plan import cli as plan_cli
from meshyard.plan import place_cli
from meshyard.serve import cli as serve_cli
from meshyard.verify import cli as verify_cli


OVERRIDES_HELP = (
    "Any field can be set with --section.field=value (or --section.field value), "
    "e.g. --train.steps=500 --parallel.strategy=fsdp --model.name=gpt-mini. "
    "Precedence: command line > config file > defaults. 'meshyard config show' lists every field."
)


# ``meshyard run``'s flags that set the [run] keys of the same names, typed by argparse;
# they win over the file and the --run.* overrides.
RUN_FLAGS = ("nproc", "nnodes", "rdzv_endpoint", "rdzv_id", "node_rank")


def _register_run(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser(
        "run",
        help="train according to a TOML config (default: a tiny GPT on one local worker per GPU, 2 on CPU)",
        description="Train a model. Without CONFIG, runs the built-in default: a small GPT on this "
        "Python's standard-library sources, one local worker per GPU (2 on CPU) with DDP. Inside torchrun, Slurm "
        "or a Kubeflow pod the process joins that job instead of starting workers.",
        epilog=OVERRIDES_HELP,
    )
    p.add_argument("config", nargs="?", help="TOML config file (optional)")
    p.add_argument("--nproc", "--nproc-per-node", dest="nproc", type=int,
                   help="worker processes on this node (same as --run.nproc; default: one per visible GPU, else 2)")
    nodes = p.add_argument_group(
        "several nodes", "Run the same command on every node; each finds its own address and interface on the "
        "route to the endpoint. Same as the [run] keys nnodes, rdzv_endpoint, rdzv_id and node_rank.")
    nodes.add_argument("--nnodes", metavar="N|MIN:MAX", help="nodes of the job, or a range for an elastic job")
    nodes.add_argument("--rdzv-endpoint", metavar="HOST[:PORT]",
                       help="where the nodes meet (port 29400 by default): an address of one node, reachable by all")
    nodes.add_argument("--rdzv-id", metavar="ID",
                       help="the job's id, the same on every node and every restart; names the run directory")
    nodes.add_argument("--node-rank", type=int, metavar="R",
                       help="this node's rank for a fixed node count (0 serves the rendezvous); default: by arrival")
    p.add_argument("--resume", default="auto", metavar="auto|latest|none|PATH",
                   help="auto (default): continue from this run directory's newest valid checkpoint; "
                   "latest: continue the newest run of the same name; none: start fresh; PATH or URL: "
                   "a checkpoint, checkpoint folder or run directory to start from")
    p.set_defaults(handler=run_main)


def _register_config(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser("config", help="inspect configurations",
                              description="Inspect configurations.", epilog=OVERRIDES_HELP)
    sub = p.add_subparsers(dest="config_command", required=True, metavar="{show}")
    show = sub.add_parser("show", help="print the resolved config with every field documented",
                          description="Print the resolved config (defaults < file < overrides) as TOML, "
                          "each field preceded by its documentation.", epilog=OVERRIDES_HELP)
    show.add_argument("config", nargs="?", help="TOML config file (optional)")
    show.add_argument("--plain", action="store_true", help="omit the documentation comments")
    show.set_defaults(handler=config_main)


def register(subparsers: argparse._SubParsersAction) -> None:
    """Register meshyard's own commands, ``run`` and ``config``; both take config overrides."""
    _register_run(subparsers)
    _register_config(subparsers)


# Each adds its parsers and binds their handlers; the order is that of 'meshyard --help'.
REGISTRARS = (register, checkpoint_cli.register, plan_cli.register, verify_cli.register,
              doctor_cli.register, dashboard_cli.register, bench_cli.register, place_cli.register, k8s_cli.register, slurm_cli.register,
              serve_cli.register, export_cli.register, data_cli.register)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="meshyard",
        description="Distributed training for PyTorch from one TOML config.",
    )
    # What a command that binds only its handler gets.
    parser.set_defaults(takes_overrides=True, own_errors=(), error_prefix="meshyard")
    subparsers = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for add in REGISTRARS:
        add(subparsers)
    return parser


def with_run_flags(config: Config, args: argparse.Namespace) -> Config:
    """``config`` with the [run] keys that ``meshyard run``'s flags (``RUN_FLAGS``) give."""
    given = {key: value for key in RUN_FLAGS if (value := getattr(args, key)) is not None}
    return dataclasses.replace(config, run=dataclasses.replace(config.run, **given))


def run_main(args: argparse.Namespace, overrides: list[str]) -> int:
    """``meshyard run``: train, here or as this node's part of a job."""
    from meshyard.api import run

    # run() validates once, for the world size it will run at; problems met on load are
    # reported with its own, in one message.
    config, problems = collect_config(args.config, overrides)
    result = run(with_run_flags(config, args), resume=args.resume, earlier_problems=problems)
    if result.summary is not None:
        print(f"meshyard: finished; records in {result.run_dir}", flush=True)
    else:
        print(f"meshyard: this node's workers finished; rank 0 keeps the records in {result.run_dir}", flush=True)
    return 0


def config_main(args: argparse.Namespace, overrides: list[str]) -> int:
    """``meshyard config show``: the resolved config as TOML."""
    config = load_config(args.config, overrides)
    print(config_to_toml(config, with_docs=not args.plain), end="")
    return 0


def refuse_overrides(args: argparse.Namespace, overrides: list[str]) -> None:
    """A command that takes no config overrides refuses them instead of ignoring them."""
    if overrides and not args.takes_overrides:
        raise ConfigError([f"'meshyard {args.command}' takes no --section.field overrides (got "
                           f"{' '.join(overrides)})"], "arguments")


def main(argv: list[str] | None = None) -> int:
    """Run one ``meshyard`` command line (default: the process's) and return its exit code."""
    parser = build_parser()
    # Overrides are taken out first so that '--model.name gpt-mini' never lends its
    # value to a positional argument.
    overrides, rest = group_override_tokens(sys.argv[1:] if argv is None else argv)
    args = parser.parse_args(rest)
    try:
        refuse_overrides(args, overrides)
        return call_command(args, overrides)
    except BadInput as exc:
        print(f"meshyard: {exc}", file=sys.stderr)
        return EXIT_BAD_INPUT
    except WorkerFailure as exc:
        print(f"meshyard: {exc}", file=sys.stderr)
        return 1
    except Preempted as exc:
        print(f"meshyard: {exc}; continue it with the same command (a job with --rdzv-id or a scheduler's job "
              "id finds its run directory again; otherwise add --resume latest or --resume <run dir>)", file=sys.stderr)
        return EXIT_PREEMPTED
    except KeyboardInterrupt:
        print("meshyard: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
