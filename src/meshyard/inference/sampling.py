"""How a completion is drawn (``Sampling``), and choosing each row's next token from its
logits: greedy, or drawn with temperature, top-k and top-p (nucleus).

Every row draws from its own generator (seeded from the request), so what a request gets
never depends on which other requests shared its batch or in what order they came. The rows
are chosen together, on the device the logits are on.
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
    """The next token of each row of ``logits`` ([B, V]) as a LongTensor [B] on the logits' device.

    Row i is the argmax when ``sampling[i].temperature`` is 0; otherwise it is drawn from
    softmax(logits / temperature) restricted to the ``top_k`` largest logits (all of them
    for top_k 0) and then to the nucleus of mass ``top_p``, with ``generators[i]``. Only ids below ``vocab_size`` are chosen: the
    ids of a vocabulary padded for speed (``model.pad_vocab_multiple``) are no tokens.

    Every row is chosen by batched tensor operations where the logits are (the GPU when the
    model runs there), in float32. A drawn row takes one uniform number from its own CPU
    generator and picks by the inverse of its distribution's cumulative sum, so a seeded row's
    tokens depend on neither its batch nor the device (up to float rounding at a boundary).
    """
    if logits.dim() != 2 or len(sampling) != logits.shape[0] or len(generators) != logits.shape[0]:
        raise ValueError(f"next_tokens needs logits [B, V] with one Sampling and one generator per row; "
                         f"got logits {tuple(logits.shape)}, {len(sampling)} Sampling, {len(generators)} generators")
    rows = logits.detach()[:, :vocab_size].float()
    chosen = torch.argmax(rows, dim=-1)
    drawn = [i for i, settings in enumerate(sampling) if settings.temperature != 0.0]
    if drawn:
        picks = _draw(rows, [sampling[i] for i in drawn], [generators[i] for i in drawn], drawn)
        chosen[torch.tensor(drawn, device=rows.device)] = picks
    return chosen


def _draw(rows: torch.Tensor, sampling: list[Sampling], generators: list[torch.Generator | None],
          index: list[int]) -> torch.Tensor:
    """The drawn tokens of rows ``index`` of ``rows`` (see ``next_tokens``), all rows at once."""
    device, vocab = rows.device, rows.shape[1]
    settings = torch.tensor([[s.temperature, s.top_k if s.top_k > 0 else vocab, s.top_p] for s in sampling],
                            dtype=torch.float32).to(device)
    temperature, top_k, top_p = settings[:, :1], settings[:, 1:2], settings[:, 2:]
    values, ids = torch.sort(rows[torch.tensor(index, device=device)] / temperature, dim=-1, descending=True)
    rank = torch.arange(vocab, device=device)
    values = values.masked_fill(rank >= top_k, float("-inf"))  # outside the top k
    probs = torch.softmax(values, dim=-1)
    # values are sorted: keep each id whose predecessors' mass is below top_p (the first always).
    before = torch.cumsum(probs, dim=-1) - probs
    probs = torch.where((before < top_p) | (top_p >= 1.0) | (rank == 0), probs, torch.zeros_like(probs))
    cumulative = torch.cumsum(probs, dim=-1)
    uniform = _uniforms(generators).to(device)[:, None] * cumulative[:, -1:]
    # The first id whose cumulative mass passes the uniform: one with a probability above 0.
    picks = torch.searchsorted(cumulative, uniform, right=True).clamp_(max=vocab - 1)
    return ids.gather(1, picks)[:, 0]


def _uniforms(generators: list[torch.Generator | None]) -> torch.Tensor:
    """One uniform in [0, 1) per drawn row: from its own generator, or torch's default one."""
    return torch.cat([torch.rand(1, generator=generator) for generator in generators])
