"""Measured pipeline bubble against theory, for GPipe and 1F1B at several micro-batch counts.

Each rank runs one stage of a GPT through ``PipelineStep`` (the runner training uses)
and reports the share of the step its stage spent outside forward/backward compute
(waiting for the neighbour stage, plus send/recv), beside the schedule's theoretical
bubble (p - 1) / (m + p - 1). Figures are the mean over steps after a warm-up, and the
mean over ranks. On a shared CPU, p2p sends are copies and the ranks share cores, so the
measured idle share sits above theory; the trend with m is what to read.

    python benchmarks/pipeline.py [--pp 2] [--microbatches 2,4,8] [--steps 6]
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch.distributed.device_mesh import init_device_mesh

from meshyard.models.gpt import GPT, GPTShape
from meshyard.parallel.pipeline import split_model
from meshyard.train.pipeline_step import PipelineStep, theoretical_bubble
from meshyard.train.precision import build_precision

SHAPE = GPTShape(vocab_size=256, context_length=128, n_layer=8, n_head=4, d_model=256, tie_embeddings=False)
BATCH = 16


def _rank(rank: int, pp: int, folder: str, schedule: str, microbatches: int, steps: int) -> None:
    torch.set_num_threads(1)
    store = dist.FileStore(str(Path(folder) / "store"), pp)
    dist.init_process_group("gloo", store=store, rank=rank, world_size=pp)
    try:
        torch.manual_seed(0)
        mesh = init_device_mesh("cpu", (pp,), mesh_dim_names=("pp",))
        model = split_model(GPT(SHAPE), pp, rank)
        runner = PipelineStep(model, mesh["pp"].get_group(), schedule, microbatches,
                              build_precision(torch.float32, torch.device("cpu"), sharded_grads=True, model_casts=False), torch.device("cpu"))
        tokens = torch.randint(0, SHAPE.vocab_size, (BATCH, SHAPE.context_length))
        idle = []
        for step in range(steps):
            runner.forward_backward([(tokens, tokens)])
            figures = runner.take_step_stats()
            if step > 0:  # the first step also infers shapes and allocates buffers
                idle.append(figures["pp_idle_fraction"])
        torch.save(statistics.mean(idle), Path(folder) / f"rank{rank}.pt")
    finally:
        dist.destroy_process_group()


def measure(pp: int, schedule: str, microbatches: int, steps: int) -> float:
    with tempfile.TemporaryDirectory() as folder:
        mp.spawn(_rank, args=(pp, folder, schedule, microbatches, steps), nprocs=pp, join=True)
        return statistics.mean(torch.load(Path(folder) / f"rank{r}.pt") for r in range(pp))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--pp", type=int, default=2)
    parser.add_argument("--microbatches", default="2,4,8")
    parser.add_argument("--steps", type=int, default=6)
    args = parser.parse_args()
    print(f"GPT {SHAPE.n_layer} blocks x d_model {SHAPE.d_model}, batch {BATCH} x {SHAPE.context_length} tokens, "
          f"pp = {args.pp} gloo ranks, 1 thread each")
    print(f"{'schedule':>9} {'m':>3} {'measured idle':>14} {'theory':>8}")
    for schedule in ("gpipe", "1f1b"):
        for m in (int(x) for x in args.microbatches.split(",")):
            idle = measure(args.pp, schedule, m, args.steps)
            print(f"{schedule:>9} {m:>3} {idle:>14.3f} {theoretical_bubble(args.pp, m):>8.3f}", flush=True)


if __name__ == "__main__":
    main()
