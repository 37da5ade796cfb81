"""How a completion is drawn (``Sampling``), and choosing each row's next token from its
logits: greedy, or drawn with temperature, top-k and top-p (nucleus).

Every row draws from its own generator (seeded from the request), so what a request gets
never depends on which other requests shared its batch or in what order they came.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class Sampling:
    """How one completion is drawn. ``temperature`` 0 is greedy; ``top_k`` 0 keeps the whole
    vocabulary; ``top_p`` below 1 keeps the fewest most likely ids whose probabilities sum
    to at least ``top_p`` (after top-k); a ``seed`` makes sampling repeatable (each request draws from its own
    generator, so a request's tokens do not depend on what it was batched with)."""

    max_new_tokens: int = 16
    temperature: float = 0.0
    top_k: int = 0
    seed: int | None = None
    top_p: float = 1.0

    @property
    def deterministic(self) -> bool:
        """The same input always gives the same tokens (what the prediction cache may keep)."""
        return self.temperature == 0.0 or self.seed is not None


def generator_for(sampling: Sampling) -> torch.Generator | None:
    """A CPU generator seeded with the request's seed; None for greedy decoding (it draws
    nothing) and for unseeded sampling (which draws from torch's default generator)."""
    if sampling.temperature == 0.0 or sampling.seed is None:
        return None
    generator = torch.Generator(device="cpu")
    generator.manual_seed(sampling.seed)
    return generator


def next_tokens(logits: torch.Tensor, sampling: list[Sampling],
                generators: list[torch.Generator | None], vocab_size: int | None = None) -> torch.Tensor:
    """The next token of each row of ``logits`` ([B, V]) as a LongTensor [B] on the CPU.

    Row i is the argmax when ``sampling[i].temperature`` is 0; otherwise it is drawn from
    softmax(logits / temperature) restricted to the ``top_k`` largest logits (all of them
    for top_k 0) and then to the nucleus of mass ``top_p``, with ``generators[i]``. Only ids below ``vocab_size`` are chosen: the
    ids of a vocabulary padded for speed (``model.pad_vocab_multiple``) are no tokens.
    """
    if logits.dim() != 2 or len(sampling) != logits.shape[0] or len(generators) != logits.shape[0]:
        raise ValueError(f"next_tokens needs logits [B, V] with one Sampling and one generator per row; "
                         f"got logits {tuple(logits.shape)}, {len(sampling)} Sampling, {len(generators)} generators")
    # Sampling happens on the CPU in float32: generators are CPU ones, and a row's draw must
    # not change with the device or precision the model ran in.
    rows = logits.detach()[:, :vocab_size].to(device="cpu", dtype=torch.float32)
    chosen = [_choose(rows[i], sampling[i], generators[i]) for i in range(rows.shape[0])]
    return torch.tensor(chosen, dtype=torch.long)


def _choose(row: torch.Tensor, sampling: Sampling, generator: torch.Generator | None) -> int:
    """One row's token (see ``next_tokens``)."""
    if sampling.temperature == 0.0:
        return int(torch.argmax(row))
    k = row.shape[0] if sampling.top_k <= 0 else min(sampling.top_k, row.shape[0])
    values, ids = torch.topk(row / sampling.temperature, k)
    probs = torch.softmax(values, dim=0)
    if sampling.top_p < 1.0:
        # values are sorted: keep each id whose predecessors' mass is below top_p (the first always).
        before = torch.cumsum(probs, dim=0) - probs
        probs = torch.where(before < sampling.top_p, probs, torch.zeros_like(probs))
    pick = torch.multinomial(probs, 1, generator=generator)
    return int(ids[pick])
