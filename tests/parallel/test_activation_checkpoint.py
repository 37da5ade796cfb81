"""Activation checkpointing changes memory, never names or gradients."""

from __future__ import annotations

import pytest
import torch

from meshyard.models.gpt import GPT, GPTShape
from meshyard.parallel.activation_checkpoint import apply_ac, checkpointed_blocks

SHAPE = GPTShape(vocab_size=32, context_length=8, n_layer=4, n_head=2, d_model=16)


def grads(mode: str) -> tuple[dict[str, torch.Tensor], int]:
    torch.manual_seed(0)
    model = apply_ac(GPT(SHAPE), mode, every=2)
    tokens = torch.randint(0, SHAPE.vocab_size, (2, 8))
    model(tokens).logsumexp(-1).mean().backward()
    return {n: p.grad for n, p in model.named_parameters()}, checkpointed_blocks(model)


@pytest.mark.parametrize("mode, wrapped", [("full", 4), ("selective", 2)])
def test_checkpointing_keeps_gradients_and_names(mode, wrapped):
    reference, none_wrapped = grads("none")
    actual, count = grads(mode)
    assert none_wrapped == 0 and count == wrapped
    assert actual.keys() == reference.keys()
    for name, grad in reference.items():
        torch.testing.assert_close(actual[name], grad, msg=name)
