"""Activation checkpointing changes memory, never names or gradients: checkpointed blocks
run their forward a second time in backward, and autograd keeps fewer activations. Blocks
are found by class, also where a user's model keeps them (nanoGPT: a ModuleList inside a
ModuleDict)."""

from __future__ import annotations

from functools import cache

import pytest
import torch

from meshyard.models.gpt import GPT, GPTShape
from meshyard.parallel.activation_checkpoint import apply_ac, checkpointed_blocks
from tests.models.user_models import nanogpt

SHAPE = GPTShape(vocab_size=32, context_length=8, n_layer=4, n_head=2, d_model=16)
BUILDERS = {"gpt": lambda: GPT(SHAPE), "nanogpt": lambda: nanogpt(SHAPE.vocab_size, SHAPE.context_length)}
# Forwards this small wait on each other's threads on a busy machine: one thread each.
pytestmark = pytest.mark.usefixtures("one_torch_thread")


def grads(mode: str, model_name: str = "gpt") -> tuple[dict[str, torch.Tensor], int]:
    torch.manual_seed(0)
    model = apply_ac(BUILDERS[model_name](), mode, every=2)
    tokens = torch.randint(0, SHAPE.vocab_size, (2, 8))
    model(tokens).logsumexp(-1).mean().backward()
    return {n: p.grad for n, p in model.named_parameters()}, checkpointed_blocks(model)


@cache
def uncheckpointed_grads(model_name: str) -> tuple[dict[str, torch.Tensor], int]:
    """The reference of each mode's comparison, computed once per model (read, never changed)."""
    return grads("none", model_name)


@pytest.mark.parametrize("model_name", list(BUILDERS))
@pytest.mark.parametrize("mode, wrapped", [("full", 4), ("selective", 2)])
def test_checkpointing_keeps_gradients_and_names(mode, wrapped, model_name):
    reference, none_wrapped = uncheckpointed_grads(model_name)
    actual, count = grads(mode, model_name)
    assert none_wrapped == 0 and count == wrapped
    assert actual.keys() == reference.keys()
    for name, grad in reference.items():
        torch.testing.assert_close(actual[name], grad, msg=name)


def forwards_and_saved_bytes(mode: str) -> tuple[list[int], int]:
    """Per block, how often its first layer ran in one forward + backward, and the bytes of
    the distinct activations autograd kept between them (parameters left out)."""
    torch.manual_seed(0)
    model = apply_ac(GPT(SHAPE), mode, every=2)
    # A hook on the block itself fires once per step whatever happens (the checkpoint
    # calls the block's forward function, not the module); its first layer is called
    # as a module both in forward and in the recomputation.
    runs = [0] * SHAPE.n_layer
    for index, block in enumerate(model.blocks):
        block.ln_1.register_forward_hook(lambda *_, i=index: runs.__setitem__(i, runs[i] + 1))
    parameters = {p.untyped_storage().data_ptr() for p in model.parameters()}
    saved: dict[int, int] = {}

    def pack(tensor: torch.Tensor) -> torch.Tensor:
        storage = tensor.untyped_storage()
        if storage.data_ptr() not in parameters:
            saved[storage.data_ptr()] = storage.nbytes()
        return tensor

    tokens = torch.randint(0, SHAPE.vocab_size, (2, 8))
    # Checkpointed regions pack their tensors with the checkpoint's own (inner) hooks, so
    # this outer hook sees only what autograd really keeps until backward.
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
        loss = model(tokens).logsumexp(-1).mean()
    forward_only = list(runs)
    loss.backward()
    assert forward_only == [1] * SHAPE.n_layer  # forward itself runs every block once
    return runs, sum(saved.values())


def test_checkpointed_blocks_recompute_and_keep_less():
    none_runs, none_bytes = forwards_and_saved_bytes("none")
    full_runs, full_bytes = forwards_and_saved_bytes("full")
    selective_runs, selective_bytes = forwards_and_saved_bytes("selective")
    assert none_runs == [1, 1, 1, 1]
    assert full_runs == [2, 2, 2, 2]  # each block's forward again in backward
    assert selective_runs == [2, 1, 2, 1]  # every 2nd block, starting with the first
    # Blocks hold most activations of this model (embeddings, final norm and logits the
    # rest), and selective keeps the activations of half of them.
    assert full_bytes < selective_bytes < none_bytes
    assert full_bytes < 0.5 * none_bytes, (full_bytes, none_bytes)
