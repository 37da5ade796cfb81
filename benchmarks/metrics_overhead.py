"""Cost of full measurement: the same job with the step-time breakdown, per-rank
gathering, MFU and memory figures on, and with them off, side by side.

Runs alternate (off, on, off, on, ...) on the same ranks so drift on a shared machine
hits both; the figure is the ratio of median step times (target: under 1.02).

    python benchmarks/metrics_overhead.py [--nproc 2] [--steps 60] [--rounds 3] [--model gpt-mini]
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
from pathlib import Path

import meshyard

WARMUP = 5


def job(args: argparse.Namespace, run_dir: Path, measured: bool) -> meshyard.Config:
    switch = "true" if measured else "false"
    return meshyard.load_config(None, [
        f"--model.name={args.model}", "--data.source=random", "--data.seq_len=128", "--train.global_batch=16",
        f"--train.steps={args.steps}", "--train.eval_every=0", "--checkpoint.enabled=false",
        "--metrics.progress_bar=false", f"--metrics.log_every={10**6}", f"--metrics.breakdown={switch}",
        f"--metrics.mfu={switch}", f"--metrics.gather_every={10 if measured else 0}", f"--run.run_dir={run_dir}",
    ])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--nproc", type=int, default=2)
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--model", default="gpt-mini")
    args = parser.parse_args()
    times: dict[bool, list[float]] = {False: [], True: []}
    with tempfile.TemporaryDirectory() as tmp:
        for index in range(args.rounds):
            for measured in (False, True):
                run_dir = Path(tmp) / f"{'on' if measured else 'off'}-{index}"
                records = meshyard.run(job(args, run_dir, measured), nproc=args.nproc).metrics()
                times[measured] += [r["step_time_s"] for r in records[WARMUP:]]
    off, on = statistics.median(times[False]), statistics.median(times[True])
    print(f"{args.model}, {args.nproc} ranks, {args.rounds} rounds x {args.steps - WARMUP} measured steps")
    print(f"measurement off: {off * 1e3:.2f} ms/step (median)")
    print(f"measurement on:  {on * 1e3:.2f} ms/step (median)")
    print(f"ratio on / off: {on / off:.4f}  (target < 1.02)")


if __name__ == "__main__":
    main()
