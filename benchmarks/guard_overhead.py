"""What the spike and NaN guard costs per step when nothing goes wrong.

The same job runs with ``guard.enabled`` off and on (host snapshots every
``guard.snapshot_every`` steps included), each in a fresh ``meshyard run`` process, the
two alternating for several rounds so that drift on a shared machine hits both. The
figure is the ratio of wall times over the same steps after a warm-up, taken from each
run's records (each record's ``time`` is taken when its step has been read back, so every
cost of a step counts: the guard's judgement, its host synchronisation, the snapshots).

    python benchmarks/guard_overhead.py [--rounds 5] [--steps 60] [--model gpt-mini] [--nproc 1]
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

from meshyard.metrics.records import read_metrics

WARMUP_STEPS = 5


def job(args: argparse.Namespace, run_dir: Path, guard: bool) -> list[str]:
    return [
        f"--model.name={args.model}", "--data.source=random", f"--data.seq_len={args.seq_len}",
        f"--train.steps={args.steps}", f"--train.global_batch={args.global_batch}", "--train.eval_every=0",
        "--metrics.progress_bar=false", f"--metrics.log_every={10**6}", "--checkpoint.enabled=false",
        f"--run.run_dir={run_dir}", f"--data.cache_dir={run_dir.parent / 'cache'}",
        f"--guard.enabled={str(guard).lower()}", f"--guard.snapshot_every={args.snapshot_every}",
    ]


def steady_wall(run_dir: Path) -> float:
    """Seconds from the record of the last warm-up step to that of the last step."""
    records = read_metrics(run_dir)
    return records[-1]["time"] - records[WARMUP_STEPS - 1]["time"]


def timed_run(args: argparse.Namespace, run_dir: Path, guard: bool) -> float:
    command = [sys.executable, "-m", "meshyard.cli", "run", "--nproc", str(args.nproc), *job(args, run_dir, guard)]
    threads = str(max(1, (os.cpu_count() or 1) // args.nproc))
    subprocess.run(command, check=True, stdout=subprocess.DEVNULL, env={**os.environ, "OMP_NUM_THREADS": threads})
    return steady_wall(run_dir)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--model", default="gpt-mini")
    parser.add_argument("--seq-len", type=int, default=128)
    parser.add_argument("--global-batch", type=int, default=8)
    parser.add_argument("--nproc", type=int, default=1)
    parser.add_argument("--snapshot-every", type=int, default=10)
    args = parser.parse_args()
    walls: dict[bool, list[float]] = {False: [], True: []}
    with tempfile.TemporaryDirectory() as workdir:
        for round_index in range(args.rounds):
            # Which goes first alternates too: a machine warming up or cooling down favours neither.
            for guard in ((False, True) if round_index % 2 == 0 else (True, False)):
                walls[guard].append(timed_run(args, Path(workdir) / f"round{round_index}-{guard}", guard))
    measured = args.steps - WARMUP_STEPS
    print(f"model {args.model}, {args.nproc} rank(s), global batch {args.global_batch} x {args.seq_len} tokens, "
          f"guard.snapshot_every = {args.snapshot_every}, {args.rounds} rounds x {measured} measured steps")
    print(f"{'guard':<8}{'median ms/step':>16}{'best ms/step':>14}")
    for guard in (False, True):
        print(f"{'on' if guard else 'off':<8}{statistics.median(walls[guard]) / measured * 1e3:>16.2f}"
              f"{min(walls[guard]) / measured * 1e3:>14.2f}")
    ratios = [on / off for on, off in zip(walls[True], walls[False])]
    print(f"ratio on / off per round: {', '.join(f'{r:.4f}' for r in ratios)}; "
          f"median {statistics.median(ratios):.4f}  (target <= 1.01)")


if __name__ == "__main__":
    main()
