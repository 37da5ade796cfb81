"""The ``meshyard`` command. Subcommands only parse arguments and call library functions."""

from __future__ import annotations

import argparse
import sys

from meshyard.bench import cli as bench_cli
from meshyard.checkpoint import cli as checkpoint_cli
from meshyard.config.dump import config_to_toml
from meshyard.config.load import ConfigError, collect_config, group_override_tokens, load_config
from meshyard.doctor import cli as doctor_cli
from meshyard.export import cli as export_cli
from meshyard.extras import MissingExtra
from meshyard.fault.failure import EXIT_BAD_INPUT
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


def _add_run(subparsers: argparse._SubParsersAction) -> None:
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


def _add_config(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser("config", help="inspect configurations",
                              description="Inspect configurations.", epilog=OVERRIDES_HELP)
    sub = p.add_subparsers(dest="config_command", required=True, metavar="{show}")
    show = sub.add_parser("show", help="print the resolved config with every field documented",
                          description="Print the resolved config (defaults < file < overrides) as TOML, "
                          "each field preceded by its documentation.", epilog=OVERRIDES_HELP)
    show.add_argument("config", nargs="?", help="TOML config file (optional)")
    show.add_argument("--plain", action="store_true", help="omit the documentation comments")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="meshyard",
        description="Distributed training for PyTorch from one TOML config.",
    )
    subparsers = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    _add_run(subparsers)
    _add_config(subparsers)
    checkpoint_cli.add_parser(subparsers)
    plan_cli.add_parser(subparsers)
    verify_cli.add_parser(subparsers)
    doctor_cli.add_parsers(subparsers)
    bench_cli.add_bench_parser(subparsers)
    place_cli.add_parser(subparsers)
    k8s_cli.add_parser(subparsers)
    slurm_cli.add_parser(subparsers)
    serve_cli.add_parser(subparsers)
    export_cli.add_parser(subparsers)
    return parser


def _cmd_run(args: argparse.Namespace, overrides: list[str]) -> int:
    from meshyard.api import run

    given = {"nproc": args.nproc, "nnodes": args.nnodes, "rdzv_endpoint": args.rdzv_endpoint,
             "rdzv_id": args.rdzv_id, "node_rank": args.node_rank}
    overrides = [*overrides, *(f"--run.{key}={value}" for key, value in given.items() if value is not None)]
    # run() validates once, for the world size it will run at; problems met on load are
    # reported with its own, in one message.
    config, problems = collect_config(args.config, overrides)
    result = run(config, resume=args.resume, earlier_problems=problems)
    if result.summary is not None:
        print(f"meshyard: finished; records in {result.run_dir}", flush=True)
    else:
        print(f"meshyard: this node's workers finished; rank 0 keeps the records in {result.run_dir}", flush=True)
    return 0


def _cmd_config(args: argparse.Namespace, overrides: list[str]) -> int:
    config = load_config(args.config, overrides)
    print(config_to_toml(config, with_docs=not args.plain), end="")
    return 0


def _without_overrides(command):
    """Commands that take no config overrides refuse them instead of ignoring them."""
    def call(args: argparse.Namespace, overrides: list[str]) -> int:
        if overrides:
            raise ConfigError([f"'meshyard {args.command}' takes no --section.field overrides (got "
                               f"{' '.join(overrides)})"], "arguments")
        return command(args)
    return call


COMMANDS = {
    "run": _cmd_run,
    "config": _cmd_config,
    "ckpt": _without_overrides(checkpoint_cli.main),
    "plan": _without_overrides(plan_cli.main),
    "verify": verify_cli.main,
    "doctor": _without_overrides(doctor_cli.doctor_main),
    "report": _without_overrides(doctor_cli.report_main),
    "bench": bench_cli.run_bench,
    "place": place_cli.main,
    "k8s": k8s_cli.main,
    "slurm": slurm_cli.main,
    "serve": serve_cli.main,
    "export": _without_overrides(export_cli.main),
}


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    # Overrides are taken out first so that '--model.name gpt-mini' never lends its
    # value to a positional argument.
    overrides, rest = group_override_tokens(sys.argv[1:] if argv is None else argv)
    args = parser.parse_args(rest)
    try:
        return COMMANDS[args.command](args, overrides)
    except (ConfigError, MissingExtra) as exc:
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
