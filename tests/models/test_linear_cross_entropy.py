"""The output head and the cross-entropy in one pass: the same loss and gradients as the
head's logits through PyTorch's cross-entropy, without the logits kept whole."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from meshyard.models.gpt import GPT, GPTShape
from meshyard.models.linear_cross_entropy import (BLOCK_ELEMENTS, GPU_MIN_BLOCK_ROWS, IGNORE_INDEX, block_rows,
                                                  linear_cross_entropy)
from meshyard.train.loss import next_token_loss


def _inputs(rows: int = 50, width: int = 16, vocab: int = 97, seed: int = 0):
    generator = torch.Generator().manual_seed(seed)
    hidden = torch.randn(rows, width, generator=generator)
    weight = torch.randn(vocab, width, generator=generator) * 0.3
    targets = torch.randint(0, vocab, (rows,), generator=generator)
    targets[[3, 17]] = IGNORE_INDEX
    return hidden.requires_grad_(), weight.requires_grad_(), targets


def _reference(hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor):
    """Loss and gradients of the unfused head in fp64: the standard both paths are held to."""
    hidden64, weight64 = (t.detach().double().requires_grad_() for t in (hidden, weight))
    loss = F.cross_entropy(hidden64 @ weight64.t(), targets, ignore_index=IGNORE_INDEX)
    loss.backward()
    return loss.detach(), hidden64.grad, weight64.grad


@pytest.mark.parametrize("rows_per_block", [1, 7, 50, 64])
def test_fp32_matches_pytorchs_cross_entropy_of_the_logits(rows_per_block):
    hidden, weight, targets = _inputs()
    expected_loss, expected_hidden, expected_weight = _reference(hidden, weight, targets)
    loss = linear_cross_entropy(hidden, weight, targets, rows_per_block)
    (3 * loss).backward()  # the incoming gradient scales what the forward computed
    assert loss.dtype == torch.float32
    torch.testing.assert_close(loss.double(), expected_loss, rtol=1e-6, atol=0)
    torch.testing.assert_close(hidden.grad.double(), 3 * expected_hidden, rtol=1e-5, atol=1e-7)
    torch.testing.assert_close(weight.grad.double(), 3 * expected_weight, rtol=1e-5, atol=1e-7)
    assert hidden.grad[[3, 17]].abs().max() == 0  # ignored rows get nothing


def test_no_logit_sized_tensor_is_kept_for_the_backward():
    hidden, weight, targets = _inputs(rows=64, vocab=128)
    loss = linear_cross_entropy(hidden, weight, targets, rows_per_block=8)
    saved = loss.grad_fn.saved_tensors
    assert sorted(t.shape for t in saved) == [torch.Size([64, 16]), torch.Size([128, 16])]
    assert all(t.dtype == torch.float32 for t in saved)


def test_under_bf16_autocast_the_matmuls_run_in_bf16_and_the_gradients_keep_the_inputs_dtypes():
    hidden, weight, targets = _inputs(rows=64)
    expected_loss, expected_hidden, expected_weight = _reference(hidden, weight, targets)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        loss = linear_cross_entropy(hidden, weight, targets, rows_per_block=16)
        unfused = next_token_loss(F.linear(hidden, weight), targets)  # the head as autocast runs it
    loss.backward()
    assert loss.dtype == torch.float32 and hidden.grad.dtype == weight.grad.dtype == torch.float32
    torch.testing.assert_close(loss, unfused, rtol=1e-5, atol=0)  # the same bf16 logits, read in fp32
    assert not torch.allclose(loss.double(), expected_loss, rtol=1e-6, atol=0)  # bf16 did round them
    torch.testing.assert_close(hidden.grad.double(), expected_hidden, rtol=2e-2, atol=2e-4)
    torch.testing.assert_close(weight.grad.double(), expected_weight, rtol=2e-2, atol=2e-4)


def test_fp16_gradients_of_a_large_batch_do_not_underflow():
    """1 / count is applied in fp32 after the matmuls: folded into the fp16 softmax gradient of
    4096 rows it would be below fp16's smallest value for most of the vocabulary."""
    hidden, weight, targets = _inputs(rows=4096, width=8, vocab=512)
    _, expected_hidden, expected_weight = _reference(hidden, weight, targets)
    with torch.autocast("cpu", dtype=torch.float16):
        loss = linear_cross_entropy(hidden, weight, targets, rows_per_block=1024)
    loss.backward()
    torch.testing.assert_close(hidden.grad.double(), expected_hidden, rtol=2e-2, atol=1e-7)
    torch.testing.assert_close(weight.grad.double(), expected_weight, rtol=2e-2, atol=1e-6)


def test_without_gradients_the_loss_is_the_same():
    hidden, weight, targets = _inputs()
    with torch.no_grad():
        loss = linear_cross_entropy(hidden, weight, targets, rows_per_block=9)
    assert loss.grad_fn is None
    torch.testing.assert_close(loss.double(), _reference(hidden, weight, targets)[0], rtol=1e-6, atol=0)


def test_a_batch_with_no_counted_row_is_nan_as_in_pytorch_and_its_gradients_are_zero():
    hidden, weight, targets = _inputs(rows=20)
    targets[:] = IGNORE_INDEX
    loss = linear_cross_entropy(hidden, weight, targets)
    assert loss.isnan() and F.cross_entropy(hidden @ weight.t(), targets).isnan()
    loss.backward()
    assert torch.equal(hidden.grad, torch.zeros_like(hidden)) and torch.equal(weight.grad, torch.zeros_like(weight))


def test_compiled_it_traces_whole_and_agrees_with_eager():
    hidden, weight, targets = _inputs(rows=32)
    eager = [t.detach().clone().requires_grad_() for t in (hidden, weight)]
    linear_cross_entropy(*eager, targets, 10).backward()
    torch._dynamo.reset()
    compiled_fn = torch.compile(lambda h, w, t: linear_cross_entropy(h, w, t, 10), backend="aot_eager",
                                fullgraph=True)
    loss = compiled_fn(hidden, weight, targets)
    loss.backward()
    torch.testing.assert_close(loss, linear_cross_entropy(*(t.detach() for t in eager), targets, 10))
    torch.testing.assert_close(hidden.grad, eager[0].grad)
    torch.testing.assert_close(weight.grad, eager[1].grad)


@pytest.mark.parametrize("tie", [True, False])
def test_gpt_given_targets_returns_the_loss_of_its_logits_with_the_same_gradients(tie):
    shape = GPTShape(vocab_size=61, context_length=16, n_layer=2, n_head=2, d_model=32, tie_embeddings=tie)
    torch.manual_seed(0)
    model = GPT(shape)
    tokens, targets = torch.randint(0, 61, (3, 16)), torch.randint(0, 61, (3, 16))
    targets[0, :4] = IGNORE_INDEX
    expected = next_token_loss(model(tokens), targets)
    expected.backward()
    expected_grads = {name: p.grad.clone() for name, p in model.named_parameters()}
    model.zero_grad(set_to_none=True)
    loss = model(tokens, targets=targets)
    loss.backward()
    torch.testing.assert_close(loss, expected, rtol=1e-6, atol=0)
    for name, param in model.named_parameters():
        torch.testing.assert_close(param.grad, expected_grads[name], rtol=1e-4, atol=1e-7, msg=name)


def test_blocks_hold_a_bounded_count_of_logits_but_enough_rows_on_a_gpu():
    assert block_rows(50304, "cpu") == BLOCK_ELEMENTS // 50304 == 667
    assert block_rows(1 << 30, "cpu") == 1
    assert block_rows(50304, "cuda") == GPU_MIN_BLOCK_ROWS == 4096
    assert block_rows(1000, "cuda") == BLOCK_ELEMENTS // 1000  # a small vocabulary: more rows


def test_fp16_weight_gradient_of_a_frequent_target_and_a_large_feature_stays_finite():
    """4096 rows with the same target and a feature of 20: the weight gradient's sum over
    them passes fp16's largest value (65504) before the mean divides it, so it is summed in fp32."""
    rows, width, vocab = 4096, 8, 64
    hidden = torch.randn(rows, width, generator=torch.Generator().manual_seed(0))
    hidden[:, 0] = 20.0
    hidden.requires_grad_()
    weight = (0.1 * torch.randn(vocab, width, generator=torch.Generator().manual_seed(1))).requires_grad_()
    targets = torch.full((rows,), 3)
    _, expected_hidden, expected_weight = _reference(hidden, weight, targets)
    with torch.autocast("cpu", dtype=torch.float16):
        loss = linear_cross_entropy(hidden, weight, targets, rows_per_block=rows)
    loss.backward()
    assert weight.grad.isfinite().all()
    torch.testing.assert_close(weight.grad.double(), expected_weight, rtol=2e-2, atol=1e-4)


def test_no_rows_give_nan_and_a_non_finite_logit_of_an_ignored_row_counts_for_nothing():
    hidden, weight = torch.zeros(0, 16, requires_grad=True), torch.randn(97, 16, requires_grad=True)
    empty = linear_cross_entropy(hidden, weight, torch.zeros(0, dtype=torch.long))
    assert empty.isnan() and F.cross_entropy(hidden @ weight.t(), torch.zeros(0, dtype=torch.long)).isnan()
    hidden, weight, targets = _inputs(rows=20)
    hidden = hidden.detach().clone()
    hidden[3] = float("inf")  # row 3 is ignored (IGNORE_INDEX)
    hidden.requires_grad_()
    loss = linear_cross_entropy(hidden, weight, targets, rows_per_block=7)
    loss.backward()
    expected = F.cross_entropy(hidden.detach() @ weight.detach().t(), targets, ignore_index=IGNORE_INDEX)
    assert loss.isfinite() and torch.allclose(loss, expected)  # the row is left out, as PyTorch leaves it
    assert hidden.grad.isfinite().all() and not hidden.grad[3].any()


def test_a_frozen_head_gets_no_gradient_and_none_is_computed_for_it():
    hidden, weight, targets = _inputs()
    weight.requires_grad_(False)
    loss = linear_cross_entropy(hidden, weight, targets, rows_per_block=16)
    assert [t.numel() for t in loss.grad_fn.saved_tensors] == [hidden.numel(), 0]
    loss.backward()
    assert weight.grad is None and hidden.grad is not None


def test_a_second_backward_of_the_same_graph_is_refused_not_scaled_twice():
    hidden, weight, targets = _inputs()
    loss = linear_cross_entropy(hidden, weight, targets)
    loss.backward(retain_graph=True)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        loss.backward()


def test_gpt_refuses_targets_it_cannot_pair_with_its_tokens():
    model = GPT(GPTShape(vocab_size=11, context_length=8, n_layer=1, n_head=1, d_model=8))
    tokens = torch.randint(0, 11, (2, 8))
    with pytest.raises(ValueError, match=r"targets of shape \(2, 7\) for tokens of shape \(2, 8\)"):
        model(tokens, targets=tokens[:, 1:])
    with pytest.raises(ValueError, match="with a KV cache"):
        model(tokens, cache=model.init_kv_cache(2), targets=tokens)
