"""Functions run on several gloo ranks by the tests of this folder (importable by spawned ranks)."""

from __future__ import annotations

import torch
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor

from meshyard.models.gpt import GPT, GPTShape
from meshyard.parallel.tensor_parallel import apply_tp

SHAPE = GPTShape(vocab_size=64, context_length=16, n_layer=2, n_head=4, d_model=32)


def _full(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.full_tensor() if isinstance(tensor, DTensor) else tensor


def tp_forward_backward(rank: int, world_size: int, sequence_parallel: bool, tied: bool,
                        vocab_split_loss: bool = False) -> dict:
    """Loss and full gradients of the GPT under TP, on every rank (with ``vocab_split_loss``
    the loss runs on vocabulary-sharded logits under loss_parallel())."""
    import contextlib

    from torch.distributed.tensor.parallel import loss_parallel

    torch.manual_seed(0)
    shape = GPTShape(**{**SHAPE.__dict__, "tie_embeddings": tied})
    model = GPT(shape)
    mesh = init_device_mesh("cpu", (world_size,), mesh_dim_names=("tp",))
    apply_tp(model, mesh["tp"], sequence_parallel, loss_parallel=vocab_split_loss)
    torch.manual_seed(1)
    tokens = torch.randint(0, shape.vocab_size, (3, 16))
    context = loss_parallel if vocab_split_loss else contextlib.nullcontext
    with context():
        logits = model(tokens)
        assert isinstance(logits, DTensor) == vocab_split_loss
        loss = torch.nn.functional.cross_entropy(logits.reshape(-1, shape.vocab_size), tokens.reshape(-1))
        loss.backward()
    loss = _full(loss)
    return {"loss": loss.item(), "grads": {n: _full(p.grad) for n, p in model.named_parameters()},
            "params": {n: _full(p.detach()) for n, p in model.named_parameters()}}


def single_forward_backward(tied: bool) -> dict:
    torch.manual_seed(0)
    shape = GPTShape(**{**SHAPE.__dict__, "tie_embeddings": tied})
    model = GPT(shape)
    torch.manual_seed(1)
    tokens = torch.randint(0, shape.vocab_size, (3, 16))
    logits = model(tokens)
    loss = torch.nn.functional.cross_entropy(logits.reshape(-1, shape.vocab_size), tokens.reshape(-1))
    loss.backward()
    return {"loss": loss.item(), "grads": {n: p.grad for n, p in model.named_parameters()},
            "params": {n: p.detach() for n, p in model.named_parameters()}}


def pipeline_stats(rank: int, world_size: int) -> dict:
    """Two GPipe steps of a 2-stage pipeline with 4 micro-batches; this rank's figures."""
    from meshyard.parallel.pipeline import split_model
    from meshyard.train.pipeline_step import PipelineStep
    from meshyard.train.precision import build_precision

    torch.manual_seed(0)
    mesh = init_device_mesh("cpu", (world_size,), mesh_dim_names=("pp",))
    shape = GPTShape(**{**SHAPE.__dict__, "tie_embeddings": False})
    model = split_model(GPT(shape), world_size, rank)
    precision = build_precision(torch.float32, torch.device("cpu"), sharded_grads=True, model_casts=False)
    runner = PipelineStep(model, mesh["pp"].get_group(), "gpipe", 4, precision, torch.device("cpu"))
    tokens = torch.randint(0, shape.vocab_size, (8, 16))
    for _ in range(2):
        runner.forward_backward([(tokens, tokens)])
    return runner.step_figures().read()[0]
