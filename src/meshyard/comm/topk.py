"""Top-k sparsification with error feedback, as a DDP communication hook.

Each step, every rank keeps only the ``ratio`` largest-magnitude entries of each
gradient tensor and sends them as (value, index) pairs; what it did not send (the
residual) is added to its next gradient, so no update is lost, only delayed
(error feedback, as in Stich et al. 2018 and Deep Gradient Compression). Without
error feedback the small entries never reach the model and training degrades.

Selection is per tensor, not per bucket: every layer gets its share of the updates
(a bucket-wide top-k starves layers with small gradients), and the result does not
depend on how DDP groups tensors into buckets, which it changes after the first step
and again in every fresh process. That is what makes a saved residual resume exactly.

Wire format: one all-gather per bucket of a fixed-size byte buffer holding this rank's
values (gradient dtype) then their indices within the bucket (int32). Every rank sums
the n contributions in rank order, so all ranks apply bit-identical gradients.
"""

from __future__ import annotations

import math
from typing import Any

import torch
import torch.distributed as dist

from meshyard.comm.hooks import GradientCompression


def topk_count(numel: int, ratio: float) -> int:
    """Entries kept from a tensor of ``numel`` entries: at least one."""
    return min(numel, max(1, math.ceil(ratio * numel)))


class TopKCompression(GradientCompression):
    """Send the top ``ratio`` of each gradient tensor; keep the rest as a residual."""

    method = "topk"

    def __init__(self, ratio: float, error_feedback: bool = True, process_group: dist.ProcessGroup | None = None,
                 warmup_steps: int = 0) -> None:
        if not 0.0 < ratio <= 1.0:
            raise ValueError(f"top-k ratio must be in (0, 1], not {ratio}")
        super().__init__(process_group, warmup_steps)
        self.ratio = ratio
        self.error_feedback = error_feedback
        # Parameter name -> flat residual. Keyed by name (not bucket) so it survives
        # DDP's bucket rebuild and a restart into a fresh DDP module.
        self.residuals: dict[str, torch.Tensor] = {}

    def compress(self, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
        buffer = bucket.buffer()
        group = self.group()
        values, indices = self._select(buffer, self.bucket_names(bucket))
        index_dtype = torch.int32 if buffer.numel() < 2**31 else torch.int64
        payload = torch.cat([values.view(torch.uint8), indices.to(index_dtype).view(torch.uint8)])
        self.counter.add("all_gather", payload.numel(), buffer.numel() * buffer.element_size())
        gathered = [torch.empty_like(payload) for _ in range(group.size())]
        work = dist.all_gather(gathered, payload, group=group, async_op=True)
        value_bytes = values.numel() * values.element_size()

        def decompress(future: torch.futures.Future) -> torch.Tensor:
            total = torch.zeros_like(buffer)
            for part in gathered:  # rank order: the same sum on every rank
                part_values = part[:value_bytes].view(buffer.dtype)
                part_indices = part[value_bytes:].view(index_dtype).long()
                total.index_add_(0, part_indices, part_values)
            buffer.copy_(total.div_(group.size()))
            return buffer

        return work.get_future().then(decompress)

    def _select(self, buffer: torch.Tensor, names: list[str]) -> tuple[torch.Tensor, torch.Tensor]:
        """Top entries of each tensor of the bucket (plus its residual); indices are
        positions in the bucket's flat buffer. Updates the residuals."""
        all_values, all_indices = [], []
        offset = 0
        for name in names:
            numel = self._shapes[name].numel()
            grad = buffer[offset:offset + numel]
            if self.error_feedback:
                residual = self.residuals.get(name)
                grad = grad + residual if residual is not None else grad.clone()
            k = topk_count(numel, self.ratio)
            chosen = grad.abs().topk(k, sorted=False).indices
            all_values.append(grad[chosen])
            all_indices.append(chosen + offset)
            if self.error_feedback:
                grad[chosen] = 0  # ``grad`` is a fresh tensor here: what was not sent
                self.residuals[name] = grad
            offset += numel
        return torch.cat(all_values), torch.cat(all_indices)

    def state_dict(self) -> dict[str, Any]:
        state = super().state_dict()
        if self.error_feedback:
            # Every parameter, zeros before its first compressed step: a fixed layout.
            state["residuals"] = {
                name: self._kept_copy(f"residuals.{name}", self.residuals[name]) if name in self.residuals
                else self._kept_buffer(f"residuals.{name}", param.numel(), param).zero_()
                for name, param in self._params.items()
            }
        return state

    def load_state_dict(self, state: dict[str, Any]) -> None:
        super().load_state_dict(state)
        self.residuals = {n: r.detach().clone().reshape(-1) for n, r in state.get("residuals", {}).items()}
