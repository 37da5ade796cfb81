"""Bytes per rank of parameters, gradients and optimizer state: no parallelism vs tp = 2
vs fsdp = 2 (and pp = 2), for a GPT, measured on the tensors each rank actually holds.

Each layout is built with ``meshyard.parallel.parallelize.parallelize`` on gloo ranks,
takes one AdamW step (so gradients and both Adam moments exist), and every rank sums
the local storage of its parameters, gradients and optimizer state (the local shard of
a DTensor). Activations are not counted (they depend on batch and checkpointing).

    python benchmarks/parallel_memory.py [--model gpt-small]
"""

from __future__ import annotations

import argparse
import tempfile
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch.distributed.tensor import DTensor

from meshyard.config.sections import ModelConfig, OptimConfig, ParallelConfig
from meshyard.models.registry import build_model
from meshyard.parallel.data_parallel import unwrap
from meshyard.parallel.parallelize import parallelize
from meshyard.parallel.layout import Layout
from meshyard.train.optim import build_optimizer

LAYOUTS = {  # name: (ranks, parallel config)
    "none": (1, ParallelConfig(strategy="none")),
    "tp=2": (2, ParallelConfig(strategy="none", tp=2)),
    "fsdp=2": (2, ParallelConfig(strategy="fsdp")),
    "pp=2": (2, ParallelConfig(strategy="none", pp=2, microbatches=2)),
}


def _bytes(tensor: torch.Tensor) -> int:
    local = tensor.to_local() if isinstance(tensor, DTensor) else tensor
    return local.numel() * local.element_size()


def _rank(rank: int, world: int, folder: str, model_name: str, layout: str) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", store=dist.FileStore(str(Path(folder) / "store"), world), rank=rank,
                            world_size=world)
    try:
        cfg = LAYOUTS[layout][1]
        layout = Layout.resolve(cfg, world)
        mesh, _ = layout.dims.build_mesh("cpu")
        torch.manual_seed(0)
        model = parallelize(build_model(ModelConfig(name=model_name), 256, 128), layout, mesh).model
        plain = unwrap(model)
        optimizer = build_optimizer(plain, OptimConfig(), 1e-3)
        for param in plain.parameters():  # one step's worth of gradients, laid out like the parameters
            param.grad = torch.zeros_like(param)
        optimizer.step()
        params = list({id(p): p for p in plain.parameters()}.values())
        figures = {
            "parameters": sum(_bytes(p) for p in params),
            "gradients": sum(_bytes(p.grad) for p in params if p.grad is not None),
            "optimizer": sum(_bytes(v) for state in optimizer.state.values() for v in state.values()
                             if isinstance(v, torch.Tensor) and v.dim() > 0),
        }
        torch.save(figures, Path(folder) / f"rank{rank}.pt")
    finally:
        dist.destroy_process_group()


def measure(model_name: str, layout: str) -> list[dict[str, int]]:
    world = LAYOUTS[layout][0]
    with tempfile.TemporaryDirectory() as folder:
        mp.spawn(_rank, args=(world, folder, model_name, layout), nprocs=world, join=True)
        return [torch.load(Path(folder) / f"rank{r}.pt") for r in range(world)]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="gpt-small")
    args = parser.parse_args()
    print(f"{args.model}, fp32, AdamW; MiB per rank (largest rank), ratio to no parallelism")
    print(f"{'layout':>7} {'params':>8} {'grads':>8} {'optim':>8} {'total':>8} {'ratio':>6}")
    reference = None
    for layout in LAYOUTS:
        ranks = measure(args.model, layout)
        worst = max(ranks, key=lambda r: sum(r.values()))
        total = sum(worst.values())
        reference = reference or total
        mib = [worst[k] / 2**20 for k in ("parameters", "gradients", "optimizer")]
        print(f"{layout:>7} {mib[0]:>8.2f} {mib[1]:>8.2f} {mib[2]:>8.2f} {total / 2**20:>8.2f} "
              f"{total / reference:>6.2f}", flush=True)


if __name__ == "__main__":
    main()
