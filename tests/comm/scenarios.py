"""What the multi-rank tests run on each rank: a tiny GPT on a learnable token stream.

The data is a noisy permutation chain (each token mostly determines the next), so the
loss falls from ln(64) to about 0.9 within 100 steps, and each rank draws its own
batches, so ranks' local gradients differ and synchronisation matters.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.device_mesh import init_device_mesh

from meshyard.comm import build_compression
from meshyard.config.sections import CommConfig
from meshyard.models.gpt import GPT, GPTShape
from meshyard.parallel.data_parallel import apply_ddp, apply_fsdp

VOCAB, SEQ, BATCH = 64, 32, 8


def tiny_gpt(n_layer: int = 2) -> GPT:
    torch.manual_seed(0)
    return GPT(GPTShape(vocab_size=VOCAB, context_length=SEQ, n_layer=n_layer, n_head=2, d_model=64))


def batch(step: int, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Rank- and step-specific samples of the chain x[t+1] = perm[x[t]] (10% noise)."""
    perm = torch.randperm(VOCAB, generator=torch.Generator().manual_seed(7))
    gen = torch.Generator().manual_seed(1000 * step + rank)
    tokens = [torch.randint(0, VOCAB, (BATCH, 1), generator=gen)]
    for _ in range(SEQ):
        noise = torch.rand(BATCH, 1, generator=gen) < 0.1
        tokens.append(torch.where(noise, torch.randint(0, VOCAB, (BATCH, 1), generator=gen), perm[tokens[-1]]))
    seq = torch.cat(tokens, dim=1)
    return seq[:, :-1], seq[:, 1:]


def loss_of(model: nn.Module, step: int, rank: int) -> torch.Tensor:
    x, y = batch(step, rank)
    return F.cross_entropy(model(x).reshape(-1, VOCAB), y.reshape(-1))


def mean_over_ranks(value: torch.Tensor) -> float:
    value = value.detach().clone()
    dist.all_reduce(value)
    return value.item() / dist.get_world_size()


def flat_params(model: nn.Module) -> torch.Tensor:
    return torch.cat([p.detach().reshape(-1) for p in model.parameters()])


def flat_grads(model: nn.Module) -> torch.Tensor:
    return torch.cat([p.grad.detach().reshape(-1).clone() for p in model.parameters()])


def ddp_with(comm: dict[str, Any], model: nn.Module | None = None, **ddp_options: Any) -> tuple[nn.Module, Any]:
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    ddp = apply_ddp(model or tiny_gpt(), mesh, **ddp_options)
    compression = build_compression(CommConfig(**comm), ddp.process_group)
    compression.register(ddp)
    return ddp, compression


def train_methods(rank: int, world: int, methods: dict[str, dict[str, Any]], steps: int,
                  lr: float) -> dict[str, dict[str, Any]]:
    """Train a fresh tiny GPT with plain SGD under each compression setting."""
    results = {}
    for label, comm in methods.items():
        model, compression = ddp_with(comm)
        optimizer = torch.optim.SGD(model.parameters(), lr=lr)
        losses, stats = [], []
        for step in range(steps):
            loss = loss_of(model, step, rank)
            loss.backward()
            optimizer.step()
            optimizer.zero_grad()
            losses.append(mean_over_ranks(loss))
            stats.append(compression.take_step_stats())
        results[label] = {"losses": losses, "params": flat_params(model), "stats": stats}
    return results


def resume_exactness(rank: int, world: int, methods: dict[str, dict[str, Any]], before: int,
                     after: int) -> dict[str, dict[str, list[torch.Tensor]]]:
    """Per method: synced gradients of ``after`` steps following a mid-run save, from
    the original run, from a fresh DDP + hook loaded with the saved state, and from a
    fresh DDP + hook without it (to show the state matters)."""
    results = {}
    for label, comm in methods.items():
        # Small buckets: several of them, regrouped by DDP after its first step.
        model, compression = ddp_with(comm, bucket_mb=0.05)
        optimizer = torch.optim.SGD(model.parameters(), lr=0.3)
        for step in range(before):
            loss_of(model, step, rank).backward()
            optimizer.step()
            optimizer.zero_grad()
        saved_model = {k: v.clone() for k, v in model.module.state_dict().items()}
        saved_comm = compression.state_dict()
        results[label] = {"original": _grads_after(model, rank, before, after)}
        for variant in ("loaded", "fresh"):
            plain = tiny_gpt()
            plain.load_state_dict(saved_model)
            model, compression = ddp_with(comm, plain, bucket_mb=0.05)
            if variant == "loaded":
                compression.load_state_dict(saved_comm)
            else:
                compression.load_state_dict({"method": saved_comm["method"], "iteration": saved_comm["iteration"],
                                             **({"rng": saved_comm["rng"]} if "rng" in saved_comm else {})})
            results[label][variant] = _grads_after(model, rank, before, after)
        results[label]["state"] = saved_comm
    return results


def _grads_after(model: nn.Module, rank: int, first: int, count: int) -> list[torch.Tensor]:
    optimizer = torch.optim.SGD(model.parameters(), lr=0.3)
    grads = []
    for step in range(first, first + count):
        loss_of(model, step, rank).backward()
        grads.append(flat_grads(model))
        optimizer.step()
        optimizer.zero_grad()
    return grads


def layout_options(rank: int, world: int, steps: int) -> dict[str, Any]:
    """Losses under FSDP with and without explicit prefetch, and DDP with its options
    plus top-k; the parameters at the end, to compare across ranks."""
    results: dict[str, Any] = {}
    mesh = init_device_mesh("cpu", (world,))
    for label, prefetch in (("fsdp", 0), ("fsdp_prefetch", 2)):
        model = apply_fsdp(tiny_gpt(n_layer=3), mesh, forward_prefetch=prefetch, backward_prefetch=prefetch)
        results[label] = _sgd_losses(model, rank, steps)
    model, _ = ddp_with({"compression": "topk", "warmup_steps": 1}, gradient_as_bucket_view=False,
                        static_graph=True)
    results["ddp_options"] = _sgd_losses(model, rank, steps)
    results["ddp_options_params"] = flat_params(model)
    results["blocks_prefetch"] = _prefetch_counts(tiny_gpt(n_layer=3), mesh)
    return results


def _sgd_losses(model: nn.Module, rank: int, steps: int) -> list[float]:
    optimizer = torch.optim.SGD(model.parameters(), lr=0.3)
    losses = []
    for step in range(steps):
        loss = loss_of(model, step, rank)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(mean_over_ranks(loss))
    return losses


def _prefetch_counts(model: GPT, mesh) -> list[tuple[int, int]]:
    """(forward, backward) modules each block prefetches, read from FSDP2's state."""
    apply_fsdp(model, mesh, forward_prefetch=2, backward_prefetch=1)
    counts = []
    for block in model.blocks:
        state = block._get_fsdp_state()
        counts.append((len(state._states_to_forward_prefetch), len(state._states_to_backward_prefetch)))
    return counts


