"""``meshyard ckpt list|inspect|verify|export``: argument parsing and printing only."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from rich.console import Console
from rich.table import Table

from meshyard.checkpoint.hf_export import MAX_SHARD_BYTES, export_hugging_face
from meshyard.checkpoint.locate import LATEST_RUN, LocationError, Runs
from meshyard.checkpoint.manifest import verify
from meshyard.checkpoint.tools import CheckpointToolError, export, list_checkpoints, model_state, resolve
from meshyard.config.sections import RunConfig
from meshyard.storage_options import options_from_pairs

EXIT_INVALID = 1


def _storage_options(pairs: list[str]) -> dict[str, object]:
    try:
        return options_from_pairs(pairs)
    except ValueError as exc:
        raise CheckpointToolError(str(exc)) from None


def register(subparsers: argparse._SubParsersAction) -> None:
    """Register ``meshyard ckpt``; a location that holds nothing usable, a bad option or an
    unreadable file is told as ``meshyard ckpt: ...``. It takes no config overrides."""
    p = subparsers.add_parser("ckpt", help="list, inspect, verify and export checkpoints",
                              description="Work with checkpoints of a run, offline. PATH is one checkpoint, a "
                              "folder of step-* checkpoints, or a run directory (tried in that order), local or an "
                              "fsspec URL (s3://...); or 'latest', the newest run of --run-name under --runs-dir. "
                              "It is found as 'meshyard run --resume PATH' finds it.")
    sub = p.add_subparsers(dest="ckpt_command", required=True, metavar="{list,inspect,verify,export}")
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument("path", metavar="PATH")
    common.add_argument("--storage-option", action="append", default=[], metavar="KEY=VALUE",
                        help="fsspec option for remote storage (repeatable), e.g. endpoint_url=http://127.0.0.1:9000")
    defaults = RunConfig()
    common.add_argument("--runs-dir", default=defaults.dir, metavar="DIR",
                        help=f"for PATH '{LATEST_RUN}': the parent folder of run directories (run.dir; default "
                        f"{defaults.dir})")
    common.add_argument("--run-name", default=defaults.name, metavar="NAME",
                        help=f"for PATH '{LATEST_RUN}': the run name (run.name; default {defaults.name})")
    sub.add_parser("list", parents=[common], help="every checkpoint with its step, size and validity")
    sub.add_parser("inspect", parents=[common],
                   help="manifest and tensor shapes of one checkpoint (of a folder or run: its newest valid one)")
    sub.add_parser("verify", parents=[common], help="check sizes and SHA-256 of every file; exit 1 if any is invalid")
    exp = sub.add_parser("export", parents=[common],
                         help="write the model as one .safetensors or .pt file, or a folder transformers loads")
    exp.add_argument("--out", required=True, type=Path,
                     help="output file (*.safetensors, or *.pt for torch.save), or with --format hf a folder")
    exp.add_argument("--format", choices=("file", "hf"), default="file",
                     help="file (default: one file, its kind by --out's suffix) or hf: a Hugging Face model folder "
                     "(config.json, safetensors sharded above --max-shard-gb, generation_config.json; meshyard's GPT "
                     "is written as GPT2LMHeadModel), which AutoModelForCausalLM.from_pretrained loads")
    exp.add_argument("--max-shard-gb", type=float, default=MAX_SHARD_BYTES / 1e9, metavar="GB",
                     help="with --format hf: the largest safetensors file; more weights are sharded with an index")
    # A location's message says what to give instead; an OSError names the file.
    p.set_defaults(handler=main, takes_overrides=False, own_errors=(LocationError, CheckpointToolError, OSError),
                   error_prefix="meshyard ckpt")


def main(args: argparse.Namespace, overrides: list[str]) -> int:
    """Run ``meshyard ckpt list|inspect|verify|export``: 0, or 1 when ``verify`` (or ``list``)
    finds an invalid checkpoint."""
    console = Console()
    options, runs = _storage_options(args.storage_option), Runs(args.runs_dir, args.run_name)
    if args.ckpt_command in ("list", "verify"):
        return _list(console, args.path, options, runs, checksums=args.ckpt_command == "verify")
    ref = resolve(args.path, options, runs, report=lambda message: print(f"meshyard ckpt: {message}",
                                                                         file=sys.stderr))
    if args.ckpt_command == "inspect":
        store = ref.store()
        manifest, problem = verify(store, store.path(ref.name), checksums=False)
        shown = {k: v for k, v in (manifest or {}).items() if k not in ("files", "config")}
        console.print_json(json.dumps({"checkpoint": store.url_of(ref.name), "problem": problem, **shown}))
        table = Table("tensor", "shape", "dtype", title="model")
        for key, tensor in model_state(ref).items():
            table.add_row(key, str(tuple(tensor.shape)), str(tensor.dtype).removeprefix("torch."))
        console.print(table)
        return 0
    report = lambda message: console.print(message, highlight=False)  # noqa: E731
    if args.format == "hf":
        if args.max_shard_gb <= 0:
            raise CheckpointToolError(f"--max-shard-gb {args.max_shard_gb:g} must be positive (e.g. 5)")
        export_hugging_face(ref, args.out, report=report, max_shard_bytes=int(args.max_shard_gb * 1e9))
    else:
        export(ref, args.out, report=report)
    return 0


def _list(console: Console, path: str, options: dict[str, object], runs: Runs, checksums: bool) -> int:
    rows = list_checkpoints(path, options, checksums=checksums, runs=runs)
    table = Table(title="checksums verified" if checksums else "sizes checked (verify checks SHA-256)")
    table.add_column("checkpoint", no_wrap=True, min_width=13)
    for column in ("step", "valid", "size", "world", "strategy", "eval loss", "latest"):
        table.add_column(column)
    for row in rows:
        table.add_row(row["name"], str(row["step"]), "yes" if row["valid"] else f"NO: {row['problem']}",
                      f"{row['bytes'] / 1e6:.2f} MB" if row["bytes"] else "-", str(row["world_size"]),
                      str(row["strategy"]), "-" if row["eval_loss"] is None else f"{row['eval_loss']:.4f}",
                      "*" if row["latest"] else "")
    console.print(table)
    return EXIT_INVALID if any(not row["valid"] for row in rows) else 0
