from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

from meshyard.train.loss import IGNORE_INDEX, chunked_cross_entropy, next_token_loss, split_sequence_loss


def _logits_and_targets(rows: int = 37, vocab: int = 50, dtype: torch.dtype = torch.float32, seed: int = 0):
    generator = torch.Generator().manual_seed(seed)
    logits = (torch.randn(rows, vocab, generator=generator) * 3).to(dtype)
    targets = torch.randint(0, vocab, (rows,), generator=generator)
    return logits, targets


@pytest.mark.parametrize("rows_per_chunk", [1, 5, 37, 100])
def test_chunked_loss_and_gradient_equal_pytorchs_in_double_precision(rows_per_chunk):
    logits, targets = _logits_and_targets(dtype=torch.float64)
    targets[[3, 20]] = IGNORE_INDEX
    mine = logits.clone().requires_grad_()
    reference = logits.clone().requires_grad_()
    loss = chunked_cross_entropy(mine, targets, rows_per_chunk)
    expected = F.cross_entropy(reference, targets)
    (2.5 * loss).backward()
    (2.5 * expected).backward()
    # The loss is accumulated in fp32 (its log-sum-exp buffer), whatever the input.
    torch.testing.assert_close(loss.double(), expected, rtol=1e-6, atol=0)
    torch.testing.assert_close(mine.grad, reference.grad, rtol=1e-5, atol=1e-7)
    assert mine.grad[[3, 20]].abs().max() == 0  # ignored positions get no gradient


def test_bf16_logits_get_an_fp32_loss_and_a_bf16_gradient_without_an_fp32_copy():
    logits, targets = _logits_and_targets(rows=64, vocab=96, dtype=torch.bfloat16)
    logits.requires_grad_()
    loss = next_token_loss(logits.reshape(4, 16, 96), targets.reshape(4, 16))
    reference_logits = logits.detach().float().requires_grad_()
    expected = F.cross_entropy(reference_logits, targets)
    saved = [t for t in loss.grad_fn.saved_tensors if t.is_floating_point() and t.numel() == logits.numel()]
    assert saved and all(t.dtype == torch.bfloat16 for t in saved)  # the logits themselves, not a copy
    loss.backward()
    expected.backward()
    assert loss.dtype == torch.float32 and logits.grad.dtype == torch.bfloat16
    torch.testing.assert_close(loss, expected, rtol=1e-6, atol=0)  # the same bf16 values, read in fp32
    torch.testing.assert_close(logits.grad.float(), reference_logits.grad, rtol=1e-2, atol=1e-5)  # bf16 rounding


def test_an_all_ignored_batch_is_nan_as_in_pytorch():
    logits, targets = _logits_and_targets(rows=4, dtype=torch.bfloat16)
    targets[:] = IGNORE_INDEX
    assert next_token_loss(logits, targets).isnan() and F.cross_entropy(logits.float(), targets).isnan()


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_a_sequence_part_whose_tokens_are_all_ignored_gets_a_zero_loss_and_gradient(dtype, monkeypatch):
    """Under context parallelism one rank's part of the sequences may hold no counted token
    while the other ranks' parts hold some (here 5, the all-reduce's answer)."""
    monkeypatch.setattr(dist, "all_reduce", lambda count, group: count.add_(5))
    logits, _ = _logits_and_targets(rows=8, dtype=dtype)
    logits = logits.reshape(2, 4, -1).requires_grad_()
    loss = split_sequence_loss(logits, torch.full((2, 4), IGNORE_INDEX), None, 2)
    loss.backward()
    assert loss.item() == 0 and logits.grad.dtype == dtype and torch.equal(logits.grad, torch.zeros_like(logits))


def test_fp32_logits_take_pytorchs_cross_entropy_unchanged():
    logits, targets = _logits_and_targets()
    assert torch.equal(next_token_loss(logits, targets), F.cross_entropy(logits, targets))



def test_a_compiled_loss_is_pytorchs_cross_entropy_of_the_upcast_logits(monkeypatch):
    """Traced by torch.compile, bf16 logits take F.cross_entropy of their fp32 upcast (which
    inductor fuses into one kernel) instead of the chunk loop, with the same loss and gradient."""
    logits, targets = _logits_and_targets(rows=64, vocab=96, dtype=torch.bfloat16)
    targets[[5, 9]] = IGNORE_INDEX
    eager = logits.clone().requires_grad_()
    eager_loss = next_token_loss(eager, targets)
    eager_loss.backward()

    def no_chunks(*args):
        raise AssertionError("the chunk loop ran inside a compiled region")

    monkeypatch.setattr("meshyard.train.loss.chunked_cross_entropy", no_chunks)
    torch._dynamo.reset()
    compiled = logits.clone().requires_grad_()
    compiled_loss = torch.compile(next_token_loss, backend="aot_eager", fullgraph=True)(compiled, targets)
    compiled_loss.backward()
    assert compiled_loss.dtype == torch.float32 and compiled.grad.dtype == torch.bfloat16
    torch.testing.assert_close(compiled_loss, eager_loss, rtol=1e-6, atol=0)
    torch.testing.assert_close(compiled.grad.float(), eager.grad.float(), rtol=1e-2, atol=1e-5)  # bf16 rounding
    assert compiled.grad[[5, 9]].abs().max() == 0
