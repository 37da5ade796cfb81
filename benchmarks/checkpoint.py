"""Training-loop stall of an async checkpoint vs a synchronous save of the same state, the
cost of committing it, and the time a resumed run needs to verify and load it.

Three runs of the same job on the same ranks, one after the other in this process:
synchronous saves, asynchronous saves, then a resume from the async run's checkpoint.
An async save holds the loop up twice: inside the save call (metrics.jsonl's
``checkpoint_stall_s``) and in the next step, which waits for the copy of the state to host
memory before its optimizer step changes the state (``checkpoint_staging_wait_s``). The
stall reported is their sum, against a synchronous save's ``checkpoint_stall_s``; the
target is 0.05 of it on a GPU and 0.10 on the CPU (where the copy competes with the step
for the same cores), and the script says which applies to the device it ran on. An async
save's commit runs in its background thread, after the write, so it is not in the loop;
``checkpoint_commit_s`` gives rank 0's commit time.

The async run saves every --interval steps; by default as often as the background write
allows (1.5 x a synchronous save's time, in steps, and at least every 4 steps), as in a
real job that saves every few minutes: a save that finds the previous one still writing
waits for it (one save in flight). That wait is part of the save call and is reported on
its own line (``checkpoint_previous_wait_s``). Steps taken while a save is staged or
written in the background are compared with the steps of the same run without one
(target: no more than 10% slower): their median, the slowest of them, and the step right
after each save (the one that waits for the copy).

Checksums are taken by every rank of the files it wrote, at save time, and verified by
every rank for its own files at resume. The previous way, rank 0 reading back and hashing
every shard (at commit in the training thread, and at resume while the other ranks wait),
is measured side by side on the same checkpoint: for the commit, "before" is that
read-back hash on one process plus the rest of the commit; for the resume check, both ways
run in turn on the same freshly spawned ranks (after a barrier, so start-up skew is left
out), and rank 0's wall time is reported.

    python benchmarks/checkpoint.py [--model gpt-small] [--nproc 2] [--saves 3] [--interval STEPS]
        [--records DIR]
"""

from __future__ import annotations

import argparse
import json
import math
import shutil
import statistics
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

import meshyard
from meshyard.checkpoint.digests import file_digest
from meshyard.checkpoint.manager import find_latest_valid
from meshyard.checkpoint.resume import agree_resume_point
from meshyard.checkpoint.storage import CheckpointStore
from meshyard.config.sections import CheckpointConfig

INTERVAL = 4
# The loop's stall of an async save against a synchronous save's, by device type.
STALL_TARGET = {"cuda": 0.05, "cpu": 0.10}
STEP_SLOWDOWN_TARGET = 1.10


def job(args: argparse.Namespace, run_dir: Path, steps: int, *extra: str, interval: int = INTERVAL) -> meshyard.Config:
    return meshyard.load_config(None, [
        f"--model.name={args.model}", "--data.source=random", "--data.seq_len=128", "--train.global_batch=8",
        f"--train.steps={steps}", "--train.eval_every=0", "--metrics.progress_bar=false",
        f"--metrics.log_every={10**6}", "--checkpoint.enabled=true", f"--checkpoint.interval={interval}",
        "--checkpoint.save_final=false", "--checkpoint.keep_last=2", f"--run.run_dir={run_dir}", *extra,
    ])


def timed_run(config: meshyard.Config, nproc: int, resume: str = "auto") -> tuple[list[dict], float]:
    start = time.time()
    result = meshyard.run(config, nproc=nproc, resume=resume)
    return result.metrics(), start


def read_back_hash_s(checkpoint: Path, repeats: int = 3) -> float:
    """The previous commit's extra work: one process reads back and hashes every file."""
    store = CheckpointStore(str(checkpoint))
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        for path in sorted(checkpoint.iterdir()):
            if path.name != "manifest.json":
                file_digest(store, str(path))
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def _resume_check_rank(rank: int, world_size: int, folder: str, root: str, repeats: int) -> None:
    """Both resume checks in turn on one rank; rank 0 writes its median times."""
    torch.set_num_threads(1)
    dist.init_process_group("gloo", store=dist.FileStore(f"{folder}/store", world_size), rank=rank,
                            world_size=world_size)
    times: dict[str, list[float]] = {"before": [], "after": []}
    for _ in range(repeats):
        for way in times:
            dist.barrier()
            start = time.perf_counter()
            if way == "before":  # rank 0 verifies every file while the others wait for its answer
                box = [find_latest_valid(CheckpointStore(root), True, print)[0] if rank == 0 else None]
                dist.broadcast_object_list(box, src=0)
            else:
                agree_resume_point("auto", root, CheckpointConfig(), False, print, rank, world_size)
            times[way].append(time.perf_counter() - start)
    if rank == 0:
        Path(folder, "times.json").write_text(json.dumps({k: statistics.median(v) for k, v in times.items()}))
    dist.barrier()
    dist.destroy_process_group()


def resume_check_s(root: Path, nproc: int, repeats: int = 3) -> dict[str, float]:
    with tempfile.TemporaryDirectory() as folder:
        mp.spawn(_resume_check_rank, args=(nproc, folder, str(root), repeats), nprocs=nproc, join=True)
        return json.loads(Path(folder, "times.json").read_text())


def steps_during_background_saves(records: list[dict]) -> tuple[list[float], list[float]]:
    """Step times of the steps taken while an async save was staged or written (from the
    step after the save to the one whose record reports it finished) and of the others;
    the first step (start-up, compilation) is left out."""
    during, apart, in_flight = [], [], False
    for record in records[1:]:
        if "checkpoint_stall_s" in record:  # the save was taken before this step
            in_flight = True
        (during if in_flight else apart).append(record["step_time_s"])
        if "checkpoint_step" in record:
            in_flight = False
    return during, apart


def print_step_slowdown(during: list[float], apart: list[float], after_save: list[float]) -> None:
    """Steps while a save is in the background against the median step without one."""
    if not during or not apart:
        print(f"steps while a save is in the background: {len(during)}, without: {len(apart)} (too few to compare)")
        return
    base = statistics.median(apart)
    print(f"steps while a save is in the background: median {statistics.median(during) * 1e3:.1f} ms over "
          f"{len(during)} steps, without one {base * 1e3:.1f} ms over {len(apart)}: ratio "
          f"{statistics.median(during) / base:.3f} (target <= {STEP_SLOWDOWN_TARGET:.2f})")
    print(f"  slowest step during a background write {max(during) * 1e3:.1f} ms: ratio {max(during) / base:.3f}")
    print("  step right after each save (waits for the copy) " + ", ".join(f"{t * 1e3:.1f}" for t in after_save)
          + " ms: ratios " + ", ".join(f"{t / base:.3f}" for t in after_save))


def mean_of(records: list[dict], key: str) -> float:
    return statistics.mean(r[key] for r in records if key in r)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="gpt-small")
    parser.add_argument("--nproc", type=int, default=2)
    parser.add_argument("--saves", type=int, default=3)
    parser.add_argument("--interval", type=int, help="steps between async saves (default: see above)")
    parser.add_argument("--records", type=Path, help="keep each run's metrics.jsonl here (sync, async, resumed)")
    args = parser.parse_args()
    steps = INTERVAL * args.saves + 1
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        sync_records, sync_start = timed_run(job(args, root / "sync", steps, "--checkpoint.async_save=false"),
                                             args.nproc)
        step_time = statistics.median(r["step_time_s"] for r in sync_records[1:] if "checkpoint_stall_s" not in r)
        sync_save = mean_of(sync_records, "checkpoint_stall_s")
        interval = args.interval or max(INTERVAL, math.ceil(1.5 * sync_save / step_time))
        async_steps = interval * args.saves + 1
        async_records, _ = timed_run(job(args, root / "async", async_steps, "--checkpoint.async_save=true",
                                         interval=interval), args.nproc)
        resumed_records, resume_start = timed_run(job(args, root / "resumed", async_steps + 1, interval=interval),
                                                  args.nproc, resume=str(root / "async"))
        facts = json.loads((root / "resumed" / "run.json").read_text())
        device = json.loads((root / "async" / "run.json").read_text())["device"].split(":")[0]
        newest = root / "async" / "checkpoints" / (root / "async" / "checkpoints" / "latest").read_text().strip()
        old_hash, check = read_back_hash_s(newest), resume_check_s(newest.parent, args.nproc)
        per_rank = [0] * args.nproc
        for entry in json.loads((newest / "manifest.json").read_text())["files"].values():
            per_rank[entry["rank"]] += entry["size"]
        size = sum(p.stat().st_size for p in (root / "sync" / "checkpoints").glob("step-*/*"))
        checkpoints = len(list((root / "sync" / "checkpoints").glob("step-*")))
        if args.records:
            args.records.mkdir(parents=True, exist_ok=True)
            for run in ("sync", "async", "resumed"):
                shutil.copy(root / run / "metrics.jsonl", args.records / f"{run}.jsonl")

    saves = [r for r in async_records if "checkpoint_stall_s" in r]  # the step after each save
    calls = [r["checkpoint_stall_s"] for r in saves]
    staging_waits = [r.get("checkpoint_staging_wait_s", 0.0) for r in saves]
    previous_waits = [r.get("checkpoint_previous_wait_s", 0.0) for r in saves]
    stalls = [call + wait for call, wait in zip(calls, staging_waits)]
    async_stall = statistics.median(stalls)
    during, apart = steps_during_background_saves(async_records)
    commit = mean_of(async_records, "checkpoint_commit_s")
    background = mean_of(async_records, "checkpoint_s")
    fresh_first = sync_records[0]["time"] - sync_start
    resumed_first = resumed_records[0]["time"] - resume_start
    resumed = facts["resumed_from"]
    target = STALL_TARGET.get(device, STALL_TARGET["cuda"])
    old_loop = async_stall + old_hash + commit  # the commit ran in the loop, hashing every shard
    print(f"{args.model}, {args.nproc} ranks on {device}, checkpoint of {size / checkpoints / 1e6:.1f} MB, "
          f"{args.saves} saves per run, median step {step_time * 1e3:.0f} ms")
    print(f"synchronous save (loop blocked, commit included): {sync_save * 1e3:8.1f} ms")
    print(f"async save, background write + commit:            {background * 1e3:8.1f} ms")
    print(f"commit on rank 0      before {(old_hash + commit) * 1e3:8.1f} ms (in the training loop; "
          f"{old_hash * 1e3:.1f} ms of it reading back every shard)")
    print(f"                      after  {commit * 1e3:8.1f} ms (in the save's background thread)")
    print(f"async save, loop cost before {old_loop * 1e3:8.1f} ms (stall {async_stall * 1e3:.1f} + commit)")
    print(f"                      after  {async_stall * 1e3:8.1f} ms (stall: save call + the next step's wait for "
          "the copy; the commit is not in the loop)")
    print(f"ratio async stall / sync save: before {old_loop / sync_save:.3f}, after {async_stall / sync_save:.3f}  "
          f"(target <= {target:.2f}, the one for {device}; "
          + ", ".join(f"{t:.2f} on {d}" for d, t in STALL_TARGET.items() if d != device) + ")")
    print(f"async saves every {interval} steps; stall per save " + ", ".join(f"{s * 1e3:.1f}" for s in stalls)
          + " ms = save call " + ", ".join(f"{c * 1e3:.1f}" for c in calls)
          + " + staging wait " + ", ".join(f"{w * 1e3:.1f}" for w in staging_waits) + " ms")
    print("  of the save call, waiting for the previous save still writing: "
          + ", ".join(f"{w * 1e3:.1f}" for w in previous_waits) + " ms"
          + (" (the interval is shorter than a background write)" if max(previous_waits) > 0.1 * sync_save else ""))
    print_step_slowdown(during, apart, [r["step_time_s"] for r in saves])
    print("  of which the garbage collector (gc_s) " + ", ".join(f"{r.get('gc_s', 0.0) * 1e3:.1f}" for r in saves)
          + f" ms; in all the run's steps after step 2 (which carries the freeze after step 1, a full "
          f"collection) {sum(r.get('gc_s', 0.0) for r in async_records[2:]) * 1e3:.1f} ms")
    print(f"resume check on rank 0 before {check['before'] * 1e3:8.1f} ms (rank 0 reads every file, the others wait)")
    print(f"                      after  {check['after'] * 1e3:8.1f} ms (each rank reads its own files: "
          + ", ".join(f"{b / 1e6:.1f}" for b in per_rank) + " MB)")
    print(f"time to first step: fresh start {fresh_first:.2f} s, resumed {resumed_first:.2f} s (in the resumed "
          f"run: resume check {resumed['verify_s']:.2f} s, start-up skew included; load {resumed['load_s']:.2f} s)")


if __name__ == "__main__":
    main()
