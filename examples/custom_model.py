"""Bring your own model and dataset.

meshyard calls the functions named in the config and passes the keywords they declare:
a model builder may take ``vocab_size``, ``context_length`` and ``config`` plus anything in
``[model.options]``; a dataset builder may take ``split`` ("train" or "val"), ``seq_len``
and ``config``, and returns a map-style dataset of (input, target) pairs. meshyard
handles sharding, ordering, batching and resumption.

Run it with:  meshyard run examples/custom_model.toml
"""

from __future__ import annotations

import torch
from torch import nn
from torch.utils.data import Dataset


class CharRNN(nn.Module):
    """A GRU language model: a model meshyard knows nothing about."""

    def __init__(self, vocab_size: int, hidden: int = 64) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab_size, hidden)
        self.rnn = nn.GRU(hidden, hidden, batch_first=True)
        self.head = nn.Linear(hidden, vocab_size)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        out, _ = self.rnn(self.embed(tokens))
        return self.head(out)


def build_model(vocab_size: int, hidden: int = 64) -> nn.Module:
    return CharRNN(vocab_size, hidden)


class CountingSequences(Dataset):
    """Sequences counting upward modulo ``vocab_size``: easy to learn, so loss falls fast."""

    vocab_size = 16

    def __init__(self, count: int, seq_len: int, offset: int) -> None:
        self.count, self.seq_len, self.offset = count, seq_len, offset

    def __len__(self) -> int:
        return self.count

    def __getitem__(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        start = (index * 7 + self.offset) % self.vocab_size
        seq = (torch.arange(self.seq_len + 1) + start) % self.vocab_size
        return seq[:-1], seq[1:]


def build_dataset(split: str, seq_len: int) -> Dataset:
    return CountingSequences(count=512 if split == "train" else 64, seq_len=seq_len, offset=0 if split == "train" else 3)
