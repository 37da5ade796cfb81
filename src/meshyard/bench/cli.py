"""The ``meshyard bench`` subcommands: argument parsing only; the work is in this package."""

from __future__ import annotations

import argparse
from pathlib import Path

from meshyard.bench.report import BenchInputError, default_out_dir
from meshyard.extras import require

_OVERRIDES = ("Any config field can be set with --section.field=value (as for 'meshyard run'); it applies to "
              "every run of the benchmark.")


def register(subparsers: argparse._SubParsersAction) -> None:
    """Register ``bench comm``, ``bench scaling`` and ``bench compression``; a bad argument of
    one is told as ``meshyard bench <kind>: ...``."""
    bench = subparsers.add_parser(
        "bench", help="measure collectives, scaling over workers, and gradient compression",
        description="Benchmarks that print a table and write JSON (with versions and hardware) and a plot to "
                    "--out (default runs/bench-<kind>-<time>).")
    sub = bench.add_subparsers(dest="bench_command", required=True, metavar="{comm,scaling,compression}")

    comm = sub.add_parser("comm", help="bandwidth and latency of all-reduce, all-gather, reduce-scatter, broadcast",
                          description="Time collectives over message sizes on N local workers (NCCL on GPUs, gloo "
                          "on CPU). Bus bandwidth follows nccl-tests: algbw x 2(n-1)/n for all-reduce, x (n-1)/n "
                          "for all-gather and reduce-scatter, x 1 for broadcast.")
    comm.add_argument("--nproc", type=int, default=2, help="local workers (default 2)")
    comm.add_argument("--ops", default="all_reduce,all_gather,reduce_scatter,broadcast", help="comma-separated")
    comm.add_argument("--min-bytes", default="1K", help="smallest message, e.g. 4096, 64K (default 1K)")
    comm.add_argument("--max-bytes", default="16M", help="largest message, sizes grow 4x (default 16M)")
    comm.add_argument("--iters", type=int, default=20, help="timed calls per size (default 20)")
    comm.add_argument("--warmup", type=int, default=5, help="untimed calls first (default 5)")
    comm.add_argument("--out", help="output directory")

    scaling = sub.add_parser("scaling", help="throughput, speedup and efficiency of a job over worker counts",
                             description="Run the job at each worker count. weak: each worker keeps the batch "
                             "train.global_batch / run.nproc of the config; strong: the global batch stays.",
                             epilog=_OVERRIDES)
    scaling.add_argument("config", nargs="?", help="TOML config (default: the built-in job)")
    scaling.add_argument("--workers", default="1,2", help="comma-separated worker counts (default 1,2)")
    scaling.add_argument("--mode", choices=("weak", "strong"), default="weak", help="default weak")
    scaling.add_argument("--steps", type=int, help="train.steps of each run (default: the config's)")
    scaling.add_argument("--out", help="output directory")

    compression = sub.add_parser("compression", help="bytes, step time and loss of each gradient compression",
                                 description="Train the job once per compression method and compare bytes per "
                                 "step, compression ratio, step time and loss with uncompressed training.",
                                 epilog=_OVERRIDES)
    compression.add_argument("config", nargs="?", help="TOML config (default: the built-in job)")
    compression.add_argument("--methods", default="none,fp16,bf16,powersgd,topk", help="comma-separated")
    compression.add_argument("--steps", type=int, help="train.steps of each run (default: the config's)")
    compression.add_argument("--nproc", type=int, help="workers (default: the config's run.nproc)")
    compression.add_argument("--out", help="output directory")
    for kind, parser in (("comm", comm), ("scaling", scaling), ("compression", compression)):
        parser.set_defaults(handler=main, own_errors=(BenchInputError,), error_prefix=f"meshyard bench {kind}")


def main(args: argparse.Namespace, overrides: list[str]) -> int:
    """Run a parsed ``bench`` command. A bad argument raises ``BenchInputError``, a config
    problem ``ConfigError``: both ``BadInput``, told in one paragraph with exit code 2."""
    # Checked first: the plots come after minutes of measuring.
    require("matplotlib", f"the plots of 'meshyard bench {args.bench_command}'")
    steps = getattr(args, "steps", None)
    if steps is not None and steps < 1:
        raise BenchInputError(f"--steps {steps} must be at least 1")
    out = Path(args.out) if args.out else default_out_dir(args.bench_command)
    if args.bench_command == "comm":
        _comm(args, overrides, out)
    elif args.bench_command == "scaling":
        from meshyard.bench.scaling import parse_workers, run_scaling_bench

        run_scaling_bench(args.config, overrides, parse_workers(args.workers), args.mode, args.steps, out)
    else:
        from meshyard.bench.compression import parse_methods, run_compression_bench

        run_compression_bench(args.config, overrides, parse_methods(args.methods), args.steps, args.nproc, out)
    print(f"meshyard: results in {out}", flush=True)
    return 0


def _comm(args: argparse.Namespace, overrides: list[str], out: Path) -> None:
    from meshyard.bench.comm import message_sizes, parse_ops, parse_size, run_comm_bench

    if overrides:
        raise BenchInputError(f"'bench comm' runs no training job and takes no config overrides ({overrides[0]})")
    sizes = message_sizes(parse_size(args.min_bytes), parse_size(args.max_bytes))
    run_comm_bench(args.nproc, parse_ops(args.ops), sizes, args.iters, args.warmup, out)
