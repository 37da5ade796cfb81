"""Functions run on gloo ranks by tests/train/test_pipeline_step.py (importable by spawned ranks).

A 2-block GPT without tied embeddings, one fixed batch of 4 samples, fp16 autocast with
the gradient scaler the worker builds: the pipeline runner's gradients after the
Trainer's ``unscale_`` against those of the plain micro-batch runner on one process.
"""

from __future__ import annotations

import torch
from torch.distributed.device_mesh import init_device_mesh

from meshyard.models.gpt import GPT, GPTShape
from meshyard.parallel.pipeline import split_model
from meshyard.train.pipeline_step import PipelineStep
from meshyard.train.precision import build_precision
from meshyard.train.step import Batch, MicroBatchStep
from meshyard.train.trainer import clip_grad_norm

SHAPE = GPTShape(vocab_size=64, context_length=16, n_layer=2, n_head=4, d_model=32, tie_embeddings=False)
CPU = torch.device("cpu")


def batch() -> Batch:
    tokens = torch.randint(0, SHAPE.vocab_size, (4, 17), generator=torch.Generator().manual_seed(1))
    return tokens[:, :-1], tokens[:, 1:]


def _grads(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {name: p.grad.detach().clone() for name, p in model.named_parameters() if p.grad is not None}


def single_fp16_grads() -> dict:
    """Loss, unscaled gradients and their norm of one fp16 step on one process."""
    torch.manual_seed(0)
    model = GPT(SHAPE)
    precision = build_precision(torch.float16, CPU, sharded_grads=False, model_casts=False)
    loss = MicroBatchStep(model, precision, CPU).forward_backward([batch()])
    precision.scaler.unscale_(torch.optim.SGD(model.parameters(), lr=0.0))
    norm = clip_grad_norm(list(model.parameters()), 0.0)
    return {"loss": loss.item(), "grads": _grads(model), "norm": norm.item()}


def _pipelined(rank: int, world_size: int, schedule: str) -> tuple[PipelineStep, torch.nn.Module]:
    torch.manual_seed(0)
    mesh = init_device_mesh("cpu", (world_size,), mesh_dim_names=("pp",))
    model = split_model(GPT(SHAPE), world_size, rank)
    precision = build_precision(torch.float16, CPU, sharded_grads=True, model_casts=False)
    return PipelineStep(model, mesh["pp"].get_group(), schedule, 2, precision, CPU), model


def pipelined_fp16_grads(rank: int, world_size: int, schedule: str) -> dict:
    """The same step through a ``world_size``-stage pipeline: this rank's loss (0 off the
    last stage), its stage's unscaled gradients, the global norm and the loss scale."""
    runner, model = _pipelined(rank, world_size, schedule)
    loss = runner.forward_backward([batch()])
    scaler = runner.precision.scaler
    scaler.unscale_(torch.optim.SGD(model.parameters(), lr=0.0))
    norm = clip_grad_norm(list(model.parameters()), 0.0, runner.grad_norm_group, runner.grad_norm_skip)
    return {"loss": loss.item(), "grads": _grads(model), "norm": norm.item(), "scale": scaler.get_scale()}


def pipelined_fp16_overflow(rank: int, world_size: int, bad_rank: int) -> dict:
    """An inf gradient on ``bad_rank``'s stage only, then the Trainer's optimizer step:
    whether this rank's parameters moved, and its loss scale afterwards."""
    runner, model = _pipelined(rank, world_size, "1f1b")
    runner.forward_backward([batch()])
    if rank == bad_rank:
        next(p for p in model.parameters() if p.grad is not None).grad.view(-1)[0] = float("inf")
    before = [p.detach().clone() for p in model.parameters()]
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    scaler = runner.precision.scaler
    scaler.unscale_(optimizer)
    scaler.step(optimizer)
    scaler.update()
    moved = any(not torch.equal(b, p.detach()) for b, p in zip(before, model.parameters()))
    return {"moved": moved, "scale": scaler.get_scale()}
