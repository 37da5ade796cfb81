"""The fused head and loss (``train.fused_linear_loss``) on a GPU: its blocks in bf16 give
the gradients of the logits path."""

from __future__ import annotations

import pytest
import torch

from meshyard.models.linear_cross_entropy import block_rows, linear_cross_entropy
from tests.models.test_linear_cross_entropy import _inputs, _reference

pytestmark = pytest.mark.gpu


def test_on_a_gpu_in_bf16_several_blocks_match_the_logits_path():
    """Blocks of at least 4096 rows on a GPU (2^25 logits would be 3728 rows of 9000): 3 of
    them here; bf16 matmuls, fp32 sums."""
    assert block_rows(9000, "cuda") == 4096
    hidden, weight, targets = (t.cuda() for t in _inputs(rows=3 * 4096, width=64, vocab=9000))
    hidden, weight = hidden.detach().requires_grad_(), weight.detach().requires_grad_()
    _, expected_hidden, expected_weight = _reference(hidden.cpu(), weight.cpu(), targets.cpu())
    with torch.autocast("cuda", dtype=torch.bfloat16):
        loss = linear_cross_entropy(hidden, weight, targets)
    loss.backward()
    torch.testing.assert_close(hidden.grad.double().cpu(), expected_hidden, rtol=2e-2, atol=1e-6)
    torch.testing.assert_close(weight.grad.double().cpu(), expected_weight, rtol=2e-2, atol=1e-5)
