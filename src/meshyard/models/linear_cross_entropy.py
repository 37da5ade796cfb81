"""The output projection and the next-token cross-entropy in one pass, block by block of
tokens, so that the (tokens x vocabulary) logits never exist whole.

A language model's logits are the largest tensor of its step (GPT-2 124M at 16 x 1024
tokens: 1.6 GB in bf16, plus a gradient of the same size in the backward), and with a
larger vocabulary (128k for Llama 3) they outgrow everything else. ``LinearCrossEntropy``
computes, for a block of rows at a time, the block's logits, its log-sum-exp and loss,
and at once the loss's gradients with respect to the hidden states and the output weight
(the softmax less the one-hot target, through the two matmuls the backward would run);
the block's logits are then dropped. What the forward keeps for the backward is those two
gradients in fp32, (tokens x width) and (vocabulary x width); the backward only scales
them by the incoming gradient (a GradScaler's scale included). The arithmetic is the
unfused loss's: the matmuls in the compute dtype (autocast's, or the inputs'), the
softmax in fp32, the weight's gradient summed over blocks in fp32.

The same three matmuls run as without fusion, in blocks; the loss's reads and writes of
the whole logits and their gradient do not. At its peak the forward holds those two fp32
gradients and 8 bytes per logit of one block (its fp32 logits, which become the softmax's
gradient in place, and log-sum-exp's temporary of the same size), plus the head's cast to
the compute dtype where the weight is wider (``BLOCK_LOGIT_BYTES``, measured on CPU).
"""

from __future__ import annotations

import torch
from torch.autograd.function import once_differentiable

IGNORE_INDEX = -100
"""Targets with this value count for nothing, as in ``F.cross_entropy``."""

BLOCK_ELEMENTS = 1 << 25
"""Logit values per block: 64 MB in bf16, 128 MB in fp32, whatever the vocabulary (the
unfused loss's blocks too, ``meshyard.train.loss``)..."""

GPU_MIN_BLOCK_ROWS = 4096
"""...but on a GPU the fused loss takes no fewer rows than this per block. The weight's gradient is summed over
the blocks, each adding a (vocabulary x width) product into the fp32 total: about 10 bytes
moved per weight element against 6 x rows FLOPs of the block's three matmuls, so with too
few rows the sums cost a large share of the matmuls' time (an H100 does ~300 bf16 FLOPs per
byte of memory traffic; 4096 rows keep the sums near a tenth). On a CPU the memory is the
scarcer resource, and an fp32 sum happens inside the matmul."""

BLOCK_LOGIT_BYTES = 8
"""Bytes a block's logit holds at the forward's peak, in fp32, bf16 and fp16 alike (see above)."""


def fused_loss_refusal(model: torch.nn.Module) -> str | None:
    """Why ``model`` cannot train with ``train.fused_linear_loss`` (None: it can): its forward
    must take ``targets`` and return the loss (a ``fuses_head_loss`` model, meshyard's GPT)."""
    if getattr(model, "fuses_head_loss", False):
        return None
    return (f"train.fused_linear_loss = true needs a model whose forward computes the loss from its hidden states "
            f"(meshyard's GPT); {type(model).__name__} returns logits only: set train.fused_linear_loss = false")


def linear_cross_entropy(hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor,
                         rows_per_block: int | None = None) -> torch.Tensor:
    """Mean cross-entropy of the logits ``hidden @ weight.T`` (hidden: (rows, width), weight:
    (vocabulary, width)) against ``targets`` (rows,), over the rows whose target is not
    ``IGNORE_INDEX`` (NaN when there is none, as PyTorch's), without the logits ever existing
    whole. The result is fp32; gradients reach ``hidden`` and ``weight`` in their dtypes."""
    rows = rows_per_block or block_rows(weight.shape[0], hidden.device.type)
    compute = _compute_dtype(hidden)
    if torch.is_grad_enabled() and (hidden.requires_grad or weight.requires_grad):
        return LinearCrossEntropy.apply(hidden, weight, targets, rows, compute)
    with torch.autocast(hidden.device.type, enabled=False):
        counted, safe_targets, count = counted_targets(targets)
        weight_c = weight.to(compute)
        losses = [_block(hidden[rows_of].to(compute), weight_c, safe_targets[rows_of], counted[rows_of])[0]
                  for rows_of in _blocks(hidden.shape[0], rows)]
        return _mean(losses, count)


class LinearCrossEntropy(torch.autograd.Function):
    """The loss of ``linear_cross_entropy`` with its gradients computed in the forward (those
    of the inputs that need one)."""

    @staticmethod
    def forward(ctx, hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor, rows: int,
                compute: torch.dtype) -> torch.Tensor:
        want_hidden, want_weight = ctx.needs_input_grad[:2]
        with torch.autocast(hidden.device.type, enabled=False):  # the dtypes are chosen here
            counted, safe_targets, count = counted_targets(targets)
            weight_c = weight.to(compute)
            losses = []
            grad_hidden = torch.empty(hidden.shape if want_hidden else (0,), dtype=torch.float32,
                                      device=hidden.device)
            grad_weight = torch.zeros(weight.shape if want_weight else (0,), dtype=torch.float32,
                                      device=weight.device)
            for rows_of in _blocks(hidden.shape[0], rows):
                hidden_block = hidden[rows_of].to(compute)
                loss, grad_logits = _block(hidden_block, weight_c, safe_targets[rows_of], counted[rows_of],
                                           with_grad=True)
                losses.append(loss)
                if want_hidden:
                    grad_hidden[rows_of] = grad_logits @ weight_c
                if want_weight:
                    _accumulate(grad_weight, grad_logits.t(), hidden_block)
                del grad_logits, hidden_block  # before the next block's logits exist
            # The mean's 1 / count is applied in fp32, after the matmuls: folded into their
            # fp16 inputs it would flush most softmax gradients to zero (a GradScaler scales
            # only what reaches the backward). No 0 / 0 when no row counts.
            per_row = 1.0 / count.clamp(min=1)
            ctx.save_for_backward(grad_hidden.mul_(per_row), grad_weight.mul_(per_row))
            ctx.dtypes = hidden.dtype, weight.dtype
            return _mean(losses, count)

    @staticmethod
    @once_differentiable
    def backward(ctx, grad_loss: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        # Scaled in place: a second copy of the (vocabulary x width) gradient would raise the
        # step's peak (a second backward of the same graph is refused by autograd's check of
        # the saved tensors, never given twice-scaled gradients).
        grad_hidden, grad_weight = ctx.saved_tensors
        hidden_dtype, weight_dtype = ctx.dtypes
        want_hidden, want_weight = ctx.needs_input_grad[:2]
        scale = grad_loss.float()
        return (grad_hidden.mul_(scale).to(hidden_dtype) if want_hidden else None,
                grad_weight.mul_(scale).to(weight_dtype) if want_weight else None, None, None, None)


def _block(hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor, counted: torch.Tensor,
           with_grad: bool = False) -> tuple[torch.Tensor, torch.Tensor | None]:
    """One block's per-row losses (fp32, 0 on ignored rows whatever their logits) and,
    ``with_grad``, the gradient of their sum with respect to the block's logits (softmax less
    one-hot, 0 on ignored rows), in the compute dtype."""
    logits = (hidden @ weight.t()).float()
    lse = torch.logsumexp(logits, dim=-1)
    losses = torch.where(counted, lse - logits.gather(1, targets.unsqueeze(1)).squeeze(1), 0.0)
    if not with_grad:
        return losses, None
    # The softmax in place of the logits, less the one-hot target, zero on ignored rows: no
    # second block-sized fp32 tensor.
    grad = logits.sub_(lse.unsqueeze(1)).exp_()
    grad.scatter_add_(1, targets.unsqueeze(1), torch.full_like(grad[:, :1], -1.0))
    return losses, grad.masked_fill_(~counted.unsqueeze(1), 0.0).to(hidden.dtype)


def _accumulate(total: torch.Tensor, left: torch.Tensor, right: torch.Tensor) -> None:
    """``total += left @ right`` into fp32 ``total``: in the matmul itself when it runs in
    fp32; else by one mixed-dtype add of a bf16 product (no fp32 copy of it first); in fp32
    for fp16, whose product of up to thousands of rows (a frequent target, a large feature)
    can pass fp16's largest value before any scaling, which a GradScaler cannot undo."""
    if left.dtype == torch.float16:
        total.addmm_(left.float(), right.float())
    elif left.dtype == total.dtype:
        total.addmm_(left, right)
    else:
        total.add_(left @ right)


def _mean(losses: list[torch.Tensor], count: torch.Tensor) -> torch.Tensor:
    """The mean of the blocks' per-row losses over the counted rows (NaN when none counts,
    as PyTorch's, also for no rows at all)."""
    total = torch.cat(losses).sum() if losses else count.new_zeros(())
    return total / count


def counted_targets(targets: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(rows that count, targets with ignored rows pointing at 0, how many count as fp32): a
    tensor count, so that nothing waits for the device."""
    counted = targets != IGNORE_INDEX
    return counted, torch.where(counted, targets, torch.zeros_like(targets)), counted.sum().float()


def block_rows(vocabulary: int, device_type: str) -> int:
    """Rows of one block: ``BLOCK_ELEMENTS`` logits, but at least ``GPU_MIN_BLOCK_ROWS`` on a
    GPU (``device_type`` 'cuda'). ``meshyard plan`` counts the blocks the same way."""
    return max(BLOCK_ELEMENTS // vocabulary, GPU_MIN_BLOCK_ROWS if device_type == "cuda" else 1)


def _blocks(rows: int, per_block: int) -> list[slice]:
    return [slice(start, start + per_block) for start in range(0, rows, per_block)]


def _compute_dtype(hidden: torch.Tensor) -> torch.dtype:
    """The matmuls' dtype: autocast's where it is on (as the unfused head's would be), else
    the hidden states'."""
    device = hidden.device.type
    return torch.get_autocast_dtype(device) if torch.is_autocast_enabled(device) else hidden.dtype
