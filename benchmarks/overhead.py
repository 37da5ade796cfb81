"""meshyard's per-step overhead against a hand-written torch DDP loop, side by side.

Both run in the same job, on the same ranks, with the same model, global batch and
optimizer: a raw loop (DDP, AdamW, clipping, loss.item() each step, tensors already in
memory) and `meshyard.worker.run_worker` (config, data loader, scheduler, metrics,
per-rank logs). They alternate for several rounds so drift on a shared machine hits
both. The figure is the ratio of wall times over the same steps after a warm-up: all
of each loop's work counts (records, console, logs and the next batch for meshyard),
not per-step figures that could leave bookkeeping out. For meshyard the wall time runs
from the record of the last warm-up step to that of the last step (each record's
``time`` is taken when its step has been read back).

    python benchmarks/overhead.py [--nproc 2] [--steps 40] [--rounds 3] [--model gpt-mini]
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel

from meshyard.config.dump import config_to_dict
from meshyard.config.load import load_config
from meshyard.launch.local import launch_local
from meshyard.metrics.records import read_metrics
from meshyard.models.registry import build_model
from meshyard.worker import run_worker

WARMUP_STEPS = 5


def meshyard_overrides(args: argparse.Namespace, run_dir: Path) -> list[str]:
    return [
        f"--model.name={args.model}", "--data.source=random", f"--data.seq_len={args.seq_len}",
        f"--train.steps={args.steps}", f"--train.global_batch={args.global_batch}", "--train.eval_every=0",
        "--train.grad_clip=1.0", "--metrics.progress_bar=false", f"--metrics.log_every={10**6}",
        f"--run.run_dir={run_dir}", f"--data.cache_dir={run_dir.parent}", "--parallel.strategy=ddp",
    ]


def raw_ddp_wall(args: argparse.Namespace, config, round_index: int) -> float:
    """The loop a user would write by hand with torch.distributed; returns the wall time
    of its steps after the warm-up."""
    store, rank, world = next(dist.rendezvous("env://"))
    # Each round joins a fresh group on the same store: its own key prefix keeps it from
    # reading the previous round's peer addresses.
    dist.init_process_group("gloo", store=dist.PrefixStore(f"raw{round_index}", store), rank=rank,
                            world_size=world)
    torch.set_num_threads(1)
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(config.train.seed)
    model = DistributedDataParallel(build_model(config.model, 256, args.seq_len), bucket_cap_mb=25,
                                    gradient_as_bucket_view=True)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3, betas=(0.9, 0.95), weight_decay=0.1)
    generator = torch.Generator().manual_seed(rank)
    per_rank = args.global_batch // world
    tokens = torch.randint(0, 256, (args.steps, per_rank, args.seq_len + 1), generator=generator)
    start = time.perf_counter()
    for step in range(args.steps):
        if step == WARMUP_STEPS:
            start = time.perf_counter()
        x, y = tokens[step, :, :-1], tokens[step, :, 1:]
        logits = model(x)
        loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), y.reshape(-1))
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        loss.item()
    wall = time.perf_counter() - start
    dist.destroy_process_group()
    return wall


def rank_main(args: argparse.Namespace, workdir: str) -> dict[str, list[float]] | None:
    results: dict[str, list[float]] = {"raw": []}
    for round_index in range(args.rounds):
        run_dir = Path(workdir) / f"round{round_index}"
        config = load_config(None, meshyard_overrides(args, run_dir))
        results["raw"].append(raw_ddp_wall(args, config, round_index))
        run_worker(config_to_dict(config), str(run_dir))
        if torch.distributed.is_initialized():
            dist.destroy_process_group()
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--nproc", type=int, default=2)
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--model", default="gpt-mini")
    parser.add_argument("--seq-len", type=int, default=128)
    parser.add_argument("--global-batch", type=int, default=16)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as workdir:
        per_rank = launch_local(rank_main, (args, workdir), args.nproc)
        raw = per_rank[0]["raw"]
        ours = [_steady_wall(read_metrics(Path(workdir) / f"round{i}")) for i in range(args.rounds)]
    measured = args.steps - WARMUP_STEPS
    print(f"model {args.model}, {args.nproc} ranks, global batch {args.global_batch} x {args.seq_len} tokens, "
          f"{args.rounds} rounds x {measured} measured steps each (wall time, per step)")
    print(f"{'loop':<10}{'median ms/step':>16}{'best ms/step':>14}")
    for name, walls in (("raw DDP", raw), ("meshyard", ours)):
        print(f"{name:<10}{statistics.median(walls) / measured * 1e3:>16.2f}{min(walls) / measured * 1e3:>14.2f}")
    ratios = [mine / theirs for mine, theirs in zip(ours, raw)]
    print(f"ratio meshyard / raw per round: {', '.join(f'{r:.4f}' for r in ratios)}; "
          f"median {statistics.median(ratios):.4f}  (target <= 1.02)")


def _steady_wall(records: list[dict]) -> float:
    """Seconds from the record of the last warm-up step to that of the last step."""
    return records[-1]["time"] - records[WARMUP_STEPS - 1]["time"]


if __name__ == "__main__":
    main()
