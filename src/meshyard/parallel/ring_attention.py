"""Causal attention over a sequence split between the ranks of a ring (context parallelism).

Each of the ``n`` ranks of the context-parallel group holds two of the sequence's ``2n``
equal chunks, ``r`` and ``2n - 1 - r`` (``chunk_order``): a causal mask makes late
chunks attend to more keys than early ones, and the pairing gives every rank the same
work. The keys and values go round the ring: at each of ``n`` steps a rank attends its
queries to the block it holds while it already sends that block on to the next rank and
receives the following one (``batch_isend_irecv``), so the transfer hides behind the
block's attention. Blocks are merged with the log-sum-exp rule: each keeps its softmax
normaliser, and ``out = sum_b exp(lse_b - lse) out_b`` with ``lse = logaddexp_b lse_b``.
Chunk pairs wholly above the causal diagonal are skipped, diagonal ones masked.

The backward goes round the ring again: the saved queries, keys, values, output and the
merged log-sum-exp recompute each block's probabilities; the gradients of a block's keys
and values travel with it (one hop behind) and are back home after the last step.

``torch.distributed.tensor.experimental.context_parallel`` carries out the same ring by
replacing the CUDA attention kernels (flash, efficient, cuDNN); on CPU, attention runs
another kernel it does not cover, so this ring is written with plain tensor operations,
which run on every device, in fp32 whatever the inputs' dtype.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

import torch
import torch.distributed as dist

KV_TAG, GRAD_TAG = 7_001, 7_002
"""Message tags of the two streams in flight together in the backward (gloo matches by tag)."""


def chunk_order(rank: int, size: int) -> tuple[int, int]:
    """The two sequence chunks (of ``2 x size``) that ``rank`` holds: ``rank`` and its mirror."""
    return rank, 2 * size - 1 - rank


@dataclass(frozen=True)
class Ring:
    """A context-parallel group seen from one rank: its place and its neighbours."""

    group: dist.ProcessGroup
    rank: int
    size: int

    @property
    def chunks(self) -> tuple[int, int]:
        return chunk_order(self.rank, self.size)

    def source_of(self, step: int) -> int:
        """The rank whose keys and values this rank holds at ``step`` of the ring."""
        return (self.rank - step) % self.size

    def pass_on(self, outgoing: torch.Tensor, tag: int) -> tuple[torch.Tensor, list[dist.Work]]:
        """Send ``outgoing`` to the next rank and receive the previous rank's tensor of the
        same shape; returns the receive buffer and the requests to wait on."""
        incoming = torch.empty_like(outgoing)
        ops = [dist.P2POp(dist.isend, outgoing, group=self.group, group_peer=(self.rank + 1) % self.size, tag=tag),
               dist.P2POp(dist.irecv, incoming, group=self.group, group_peer=(self.rank - 1) % self.size, tag=tag)]
        return incoming, dist.batch_isend_irecv(ops)

    def circulate(self, block: torch.Tensor, tag: int) -> Iterator[tuple[int, torch.Tensor]]:
        """(step, block held at that step) for each of the ring's ``size`` steps, starting
        with this rank's own ``block``; each held block is already on its way to the next
        rank while the caller computes on it, and the following one arriving."""
        held, requests = block, []
        for step in range(self.size):
            if step:
                _wait(requests)
                held = incoming
            if step + 1 < self.size:
                incoming, requests = self.pass_on(held, tag)
            yield step, held


def _wait(requests: list[dist.Work]) -> None:
    for request in requests:
        request.wait()


def _pairs(ring: Ring, step: int) -> list[tuple[int, int, bool]]:
    """(local query half, key half of the held block, causal diagonal?) of the chunk pairs
    to compute at ``step``; pairs whose keys all come after the queries are left out."""
    queries, keys = ring.chunks, chunk_order(ring.source_of(step), ring.size)
    return [(qi, ki, q == k) for qi, q in enumerate(queries) for ki, k in enumerate(keys) if k <= q]


def _scores(q: torch.Tensor, k: torch.Tensor, scale: float, diagonal: bool) -> torch.Tensor:
    scores = torch.matmul(q, k.transpose(-1, -2)) * scale
    if diagonal:  # same chunk: a key after its query is masked
        above = torch.ones(scores.shape[-2:], dtype=torch.bool, device=scores.device).triu(1)
        scores = scores.masked_fill(above, float("-inf"))
    return scores


def _halves(t: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    return t.chunk(2, dim=-2)


def ring_forward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, ring: Ring,
                 scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Attention output (fp32, shaped as ``q``) and its log-sum-exp (B, H, L) over the whole
    sequence, for the local queries ``q`` (B, H, L, D) and keys/values ``k``, ``v``."""
    q32 = q.float()
    out = torch.zeros_like(q32)
    lse = torch.full(q.shape[:-1], float("-inf"), dtype=torch.float32, device=q.device)
    for step, held in ring.circulate(torch.stack([k, v]), KV_TAG):
        k_halves, v_halves = _halves(held[0].float()), _halves(held[1].float())
        q_halves, out_halves, lse_halves = _halves(q32), _halves(out), lse.chunk(2, dim=-1)
        for qi, ki, diagonal in _pairs(ring, step):
            scores = _scores(q_halves[qi], k_halves[ki], scale, diagonal)
            block_lse = torch.logsumexp(scores, dim=-1)
            block_out = torch.matmul(torch.exp(scores - block_lse.unsqueeze(-1)), v_halves[ki])
            merged = torch.logaddexp(lse_halves[qi], block_lse)
            # In place on views of out and lse: the first step's diagonal makes every lse finite.
            out_halves[qi].mul_(torch.exp(lse_halves[qi] - merged).unsqueeze(-1)).add_(
                block_out * torch.exp(block_lse - merged).unsqueeze(-1))
            lse_halves[qi].copy_(merged)
    return out, lse


def ring_backward(grad_out: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor,
                  lse: torch.Tensor, ring: Ring, scale: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Gradients of ``q``, ``k`` and ``v`` (in their dtypes) given the output's gradient."""
    q32, grad32 = q.float(), grad_out.float()
    row_dot = (grad32 * out).sum(-1)  # D_i = dO_i . O_i, the softmax Jacobian's diagonal term
    grad_q = torch.zeros_like(q32)
    grad_held, grad_requests = None, []
    for step, held in ring.circulate(torch.stack([k, v]), KV_TAG):
        local = _block_gradients(ring, step, q32, grad32, row_dot, lse, held, grad_q, scale)
        if step:  # the gradient of this block accumulated by the ranks it visited before
            _wait(grad_requests)
            local += grad_held
        # One hop behind the block: after the last step it reaches the block's own rank.
        grad_held, grad_requests = ring.pass_on(local, GRAD_TAG)
    _wait(grad_requests)
    return grad_q.to(q.dtype), grad_held[0].to(k.dtype), grad_held[1].to(v.dtype)


def _block_gradients(ring: Ring, step: int, q32: torch.Tensor, grad32: torch.Tensor, row_dot: torch.Tensor,
                     lse: torch.Tensor, held: torch.Tensor, grad_q: torch.Tensor, scale: float) -> torch.Tensor:
    """This rank's part of the gradient of the held keys and values (stacked, fp32); adds
    the held block's part of the queries' gradient to ``grad_q``."""
    k_halves, v_halves = _halves(held[0].float()), _halves(held[1].float())
    grad_kv = torch.zeros((2, *held.shape[1:]), dtype=torch.float32, device=held.device)
    grad_k_halves, grad_v_halves = _halves(grad_kv[0]), _halves(grad_kv[1])
    q_halves, grad_halves, grad_q_halves = _halves(q32), _halves(grad32), _halves(grad_q)
    lse_halves, dot_halves = lse.chunk(2, dim=-1), row_dot.chunk(2, dim=-1)
    for qi, ki, diagonal in _pairs(ring, step):
        probs = torch.exp(_scores(q_halves[qi], k_halves[ki], scale, diagonal) - lse_halves[qi].unsqueeze(-1))
        grad_v_halves[ki].add_(torch.matmul(probs.transpose(-1, -2), grad_halves[qi]))
        grad_probs = torch.matmul(grad_halves[qi], v_halves[ki].transpose(-1, -2))
        grad_scores = probs * (grad_probs - dot_halves[qi].unsqueeze(-1)) * scale
        grad_q_halves[qi].add_(torch.matmul(grad_scores, k_halves[ki]))
        grad_k_halves[ki].add_(torch.matmul(grad_scores.transpose(-1, -2), q_halves[qi]))
    return grad_kv


class RingAttention(torch.autograd.Function):
    """Causal attention of the local queries against the whole sequence's keys and values."""

    @staticmethod
    def forward(ctx, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, ring: Ring, scale: float) -> torch.Tensor:
        out, lse = ring_forward(q, k, v, ring, scale)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.ring, ctx.scale = ring, scale
        return out.to(q.dtype)

    @staticmethod
    def backward(ctx, grad_out: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        q, k, v, out, lse = ctx.saved_tensors
        grad_q, grad_k, grad_v = ring_backward(grad_out, q, k, v, out, lse, ctx.ring, ctx.scale)
        return grad_q, grad_k, grad_v, None, None


def ring_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, ring: Ring,
                   scale: float | None = None) -> torch.Tensor:
    """Causal attention (B, H, L, D) of this rank's queries, keys and values, laid out as
    ``chunk_order`` says, over the sequence the ring holds; ``scale`` defaults to 1/sqrt(D)."""
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    with torch.autocast(q.device.type, enabled=False):  # blocks in fp32 by choice
        return RingAttention.apply(q.contiguous(), k.contiguous(), v.contiguous(), ring, scale)
