"""Training-loop stall of an async checkpoint vs a synchronous save of the same state,
and the time a resumed run needs to reach its first step.

Three runs of the same job on the same ranks, one after the other in this process:
synchronous saves, asynchronous saves, then a resume from the async run's checkpoint.
The stall is the time the training loop spends inside the save call (metrics.jsonl's
``checkpoint_stall_s``); for async saves the background write time is reported too.

    python benchmarks/checkpoint.py [--model gpt-small] [--nproc 2] [--saves 3]
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path

import meshyard

INTERVAL = 4


def job(args: argparse.Namespace, run_dir: Path, steps: int, *extra: str) -> meshyard.Config:
    return meshyard.load_config(None, [
        f"--model.name={args.model}", "--data.source=random", "--data.seq_len=128", "--train.global_batch=8",
        f"--train.steps={steps}", "--train.eval_every=0", "--metrics.progress_bar=false",
        f"--metrics.log_every={10**6}", "--checkpoint.enabled=true", f"--checkpoint.interval={INTERVAL}",
        "--checkpoint.save_final=false", "--checkpoint.keep_last=2", f"--run.run_dir={run_dir}", *extra,
    ])


def timed_run(config: meshyard.Config, nproc: int, resume: str = "auto") -> tuple[list[dict], float]:
    start = time.time()
    result = meshyard.run(config, nproc=nproc, resume=resume)
    return result.metrics(), start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="gpt-small")
    parser.add_argument("--nproc", type=int, default=2)
    parser.add_argument("--saves", type=int, default=3)
    args = parser.parse_args()
    steps = INTERVAL * args.saves + 1
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        sync_records, sync_start = timed_run(job(args, root / "sync", steps, "--checkpoint.async_save=false"),
                                             args.nproc)
        async_records, _ = timed_run(job(args, root / "async", steps, "--checkpoint.async_save=true"), args.nproc)
        resumed_records, resume_start = timed_run(job(args, root / "resumed", steps + 1), args.nproc,
                                                  resume=str(root / "async"))
        facts = json.loads((root / "resumed" / "run.json").read_text())
        size = sum(p.stat().st_size for p in (root / "sync" / "checkpoints").glob("step-*/*"))
        checkpoints = len(list((root / "sync" / "checkpoints").glob("step-*")))

    sync_save = statistics.mean(r["checkpoint_stall_s"] for r in sync_records if "checkpoint_stall_s" in r)
    async_stall = statistics.mean(r["checkpoint_stall_s"] for r in async_records if "checkpoint_stall_s" in r)
    background = [r["checkpoint_s"] for r in async_records if "checkpoint_s" in r]
    step_time = statistics.median(r["step_time_s"] for r in sync_records[1:])
    fresh_first = sync_records[0]["time"] - sync_start
    resumed_first = resumed_records[0]["time"] - resume_start
    print(f"{args.model}, {args.nproc} ranks, checkpoint of {size / checkpoints / 1e6:.1f} MB, "
          f"{args.saves} saves per run, median step {step_time * 1e3:.0f} ms")
    print(f"synchronous save (loop blocked):     {sync_save * 1e3:8.1f} ms")
    print(f"async save, loop stall:              {async_stall * 1e3:8.1f} ms")
    print(f"async save, background write+commit: {statistics.mean(background) * 1e3:8.1f} ms")
    print(f"ratio async stall / sync save: {async_stall / sync_save:.3f}  (target <= 0.10)")
    print(f"time to first step: fresh start {fresh_first:.2f} s, resumed {resumed_first:.2f} s "
          f"(checkpoint load {facts['resumed_from']['load_s']:.2f} s)")


if __name__ == "__main__":
    main()
