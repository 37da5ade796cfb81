"""The training loss: next-token cross-entropy with fp32 arithmetic, without an fp32 copy
of the whole logits tensor.

Logits in bf16 or fp16 (a model under autocast) are the largest tensor of a language
model's step: 16 x 1024 x 50304 values are 1.6 GB in bf16 and would be 3.3 GB more as an
fp32 copy, plus an fp32 gradient of the same size. Eagerly, ``ChunkedCrossEntropy`` reads
the logits a block of rows at a time, in fp32, for the log-sum-exp in the forward and for
the softmax gradient in the backward; it keeps only one row's log-sum-exp (4 bytes) per
token between them. Inside a torch.compile region the loss is PyTorch's cross-entropy of
the upcast logits: inductor fuses the upcast into its reduction kernels, so no fp32 copy
exists there either, and one fused kernel beats the chunk loop (on an H100, GPT-2 124M at
16 x 1024 tokens: 1.2 ms per step against 4.1 ms for the traced chunks, whose block writes
become a copy of the whole gradient). fp32 logits (the CPU default) take PyTorch's own
cross-entropy unchanged, and vocabulary-split logits under tensor parallelism take it too,
inside loss_parallel(). With ``train.fused_linear_loss`` no logits reach this module: the
model computes its loss with the head (``meshyard.models.linear_cross_entropy``), and only
context parallelism's sum over the ranks (``split_sequence_mean``) is taken here.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.tensor import DTensor

from meshyard.models.linear_cross_entropy import BLOCK_ELEMENTS, IGNORE_INDEX, counted_targets


def next_token_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Mean cross-entropy over all positions (those whose target is not ``IGNORE_INDEX``),
    computed in fp32 whatever the dtype of ``logits``."""
    flat_logits, flat_targets = logits.reshape(-1, logits.shape[-1]), targets.reshape(-1)
    if isinstance(logits, DTensor) or logits.dtype in (torch.float32, torch.float64):
        return F.cross_entropy(flat_logits.float() if isinstance(logits, DTensor) else flat_logits, flat_targets,
                               ignore_index=IGNORE_INDEX)
    if torch.compiler.is_compiling():  # inductor fuses the upcast: no fp32 copy is made
        with torch.autocast(logits.device.type, enabled=False):
            return F.cross_entropy(flat_logits.float(), flat_targets, ignore_index=IGNORE_INDEX)
    return chunked_cross_entropy(flat_logits, flat_targets)


def split_sequence_loss(logits: torch.Tensor, targets: torch.Tensor, group: dist.ProcessGroup,
                        ranks: int) -> torch.Tensor:
    """The loss of this rank's tokens when each sequence is split over the ``ranks`` of
    ``group`` (context parallelism): the sum of their token losses over the token count of
    the whole sequences, times ``ranks``.

    Summed over the group's ranks this is the exact mean loss of the whole sequences,
    however the counted tokens (those whose target is not ``IGNORE_INDEX``) fall; times
    ``ranks`` because everything downstream averages over ranks: the loss the trainer
    logs (the mean of the ranks' losses) and the gradients DDP or FSDP reduce over the
    context-parallel ranks. The only communication is one all-reduce of the count."""
    return split_sequence_mean(next_token_loss(logits, targets), targets, group, ranks)


def split_sequence_mean(local_mean: torch.Tensor, targets: torch.Tensor, group: dist.ProcessGroup,
                        ranks: int) -> torch.Tensor:
    """``split_sequence_loss`` of a rank's mean loss over its counted ``targets`` (however it
    was computed: from logits, or fused with the head)."""
    counted = (targets != IGNORE_INDEX).sum()
    total = counted.detach().clone()
    dist.all_reduce(total, group=group)
    local_sum = torch.where(counted > 0, local_mean * counted, 0.0)
    return local_sum * ranks / total


def chunked_cross_entropy(logits: torch.Tensor, targets: torch.Tensor,
                          rows_per_chunk: int | None = None) -> torch.Tensor:
    """Mean cross-entropy of 2-D ``logits`` (rows, vocabulary) against 1-D ``targets``, in
    fp32 arithmetic, ``rows_per_chunk`` rows at a time (by default ``BLOCK_ELEMENTS`` values);
    the result is fp32 and its gradient has the logits' dtype."""
    rows = rows_per_chunk or max(1, BLOCK_ELEMENTS // logits.shape[-1])
    with torch.autocast(logits.device.type, enabled=False):  # fp32 by choice, not autocast's
        return ChunkedCrossEntropy.apply(logits, targets, rows)


class ChunkedCrossEntropy(torch.autograd.Function):
    """Cross-entropy whose forward saves the logits as they are (no fp32 copy) and one
    log-sum-exp per row; the backward recomputes the softmax block by block."""

    @staticmethod
    def forward(ctx, logits: torch.Tensor, targets: torch.Tensor, rows_per_chunk: int) -> torch.Tensor:
        counted, safe_targets, count = counted_targets(targets)  # none counted gives NaN, as PyTorch's
        lse = torch.empty(logits.shape[0], dtype=torch.float32, device=logits.device)
        for start in range(0, logits.shape[0], rows_per_chunk):
            block = slice(start, start + rows_per_chunk)
            lse[block] = torch.logsumexp(logits[block].float(), dim=-1)
        target_logits = logits.gather(1, safe_targets.unsqueeze(1)).squeeze(1).float()
        ctx.save_for_backward(logits, safe_targets, counted, lse, count)
        ctx.rows_per_chunk = rows_per_chunk
        return ((lse - target_logits) * counted).sum() / count

    @staticmethod
    def backward(ctx, grad_loss: torch.Tensor) -> tuple[torch.Tensor, None, None]:
        logits, targets, counted, lse, count = ctx.saved_tensors
        rows_per_chunk = ctx.rows_per_chunk
        grad_logits = torch.empty_like(logits)
        # d loss / d logit = (softmax - one_hot(target)) * grad / count, zero on ignored rows.
        # With no counted row (a context-parallel rank's tokens all ignored) every row's
        # scale is 0: the clamp keeps 0 x (0 / 0) = NaN out of the gradient.
        row_scale = counted.float() * (grad_loss.float() / count.clamp(min=1))
        for start in range(0, logits.shape[0], rows_per_chunk):
            block = slice(start, start + rows_per_chunk)
            grad = torch.exp(logits[block].float() - lse[block].unsqueeze(1))
            grad.scatter_add_(1, targets[block].unsqueeze(1), torch.full_like(grad[:, :1], -1.0))
            grad_logits[block] = (grad * row_scale[block].unsqueeze(1)).to(logits.dtype)
        return grad_logits, None, None
