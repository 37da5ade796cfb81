"""Tensor parallelism on 2 gloo ranks gives the single-device loss and gradients."""

from __future__ import annotations

import pytest
import torch

from tests.ranks import run_on_ranks
from tests.parallel.scenarios import single_forward_backward, tp_forward_backward

CASES = {  # name: (sequence_parallel, tied, vocab_split_loss)
    "sp-tied": (True, True, False),
    "plain-untied": (False, False, False),
    "sp-tied-loss-parallel": (True, True, True),
    "sp-untied-loss-parallel": (True, False, True),
}


def _all_cases(rank: int, world_size: int) -> dict[str, dict]:
    """Every case in one spawn of the ranks (starting them is most of the cost)."""
    return {name: tp_forward_backward(rank, world_size, *case) for name, case in CASES.items()}


def test_tp_gradients_equal_single_device():
    references = {tied: single_forward_backward(tied) for tied in (True, False)}
    for results in run_on_ranks(_all_cases, world_size=2):
        for name, (_, tied, _) in CASES.items():
            out, reference = results[name], references[tied]
            assert out["loss"] == pytest.approx(reference["loss"], rel=1e-6), name
            assert set(out["grads"]) == set(reference["grads"]), "TP must keep parameter names"
            for param, grad in reference["grads"].items():
                # The fused qkv projection is the part a naive column split gets wrong.
                torch.testing.assert_close(out["grads"][param], grad, rtol=1e-5, atol=1e-6, msg=f"{name}: {param}")
                assert out["params"][param].shape == reference["params"][param].shape


def test_indivisible_heads_are_refused():
    from meshyard.models.gpt import GPT, GPTShape
    from meshyard.parallel.tensor_parallel import _check_divisible

    model = GPT(GPTShape(vocab_size=64, context_length=8, n_layer=1, n_head=3, d_model=48))
    with pytest.raises(ValueError, match="n_head = 3 is not divisible by parallel.tp = 2"):
        _check_divisible(model, 2)
