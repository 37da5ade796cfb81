"""Tensor parallelism on 2 gloo ranks gives the single-device loss and gradients."""

from __future__ import annotations

import pytest
import torch

from tests.ranks import run_on_ranks
from tests.parallel.scenarios import single_forward_backward, tp_forward_backward


@pytest.mark.parametrize(
    "sequence_parallel, tied, vocab_split_loss",
    [(True, True, False), (False, False, False), (True, True, True), (True, False, True)],
    ids=["sp-tied", "plain-untied", "sp-tied-loss-parallel", "sp-untied-loss-parallel"],
)
def test_tp_gradients_equal_single_device(sequence_parallel, tied, vocab_split_loss):
    reference = single_forward_backward(tied)
    for out in run_on_ranks(tp_forward_backward, sequence_parallel, tied, vocab_split_loss, world_size=2):
        assert out["loss"] == pytest.approx(reference["loss"], rel=1e-6)
        assert set(out["grads"]) == set(reference["grads"]), "TP must keep parameter names"
        for name, grad in reference["grads"].items():
            # The fused qkv projection is the part a naive column split gets wrong.
            torch.testing.assert_close(out["grads"][name], grad, rtol=1e-5, atol=1e-6, msg=name)
            assert out["params"][name].shape == reference["params"][name].shape


def test_indivisible_heads_are_refused():
    from meshyard.models.gpt import GPT, GPTShape
    from meshyard.parallel.tensor_parallel import _check_divisible

    model = GPT(GPTShape(vocab_size=64, context_length=8, n_layer=1, n_head=3, d_model=48))
    with pytest.raises(ValueError, match="n_head = 3 is not divisible by parallel.tp = 2"):
        _check_divisible(model, 2)
