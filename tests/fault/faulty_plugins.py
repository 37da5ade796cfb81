"""Test-only model and dataset builders that misbehave on purpose, on one rank or all.

``build_model`` wraps meshyard's tiny GPT; its options (``model.options``) choose the
misbehaviour: ``sleep_s`` per forward on ``rank``, a ``hang_at`` forward call that does
not return for ``hang_s`` (an hour: never, for a test) on ``rank``, NaN logits from forward
call ``nan_at`` on ``rank``, or a start-up slowed by ``build_sleep_s`` (every rank).
"""

from __future__ import annotations

import os
import time

import torch
from torch import nn
from torch.utils.data import Dataset

from meshyard.models.gpt import GPT, GPTShape


class Misbehaving(nn.Module):
    def __init__(self, inner: nn.Module, rank: int, sleep_s: float, hang_at: int, nan_at: int,
                 hang_s: float = 3600.0) -> None:
        super().__init__()
        self.inner = inner
        self.mine = int(os.environ.get("RANK", "0")) == rank
        self.sleep_s, self.hang_at, self.nan_at, self.hang_s = sleep_s, hang_at, nan_at, hang_s
        self.calls = 0

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        if self.training:
            self.calls += 1
        if self.mine and self.sleep_s:
            time.sleep(self.sleep_s)
        if self.mine and self.calls == self.hang_at:
            time.sleep(self.hang_s)  # does not reach the gradient all-reduce the other ranks wait in
        logits = self.inner(tokens)
        if self.mine and self.calls == self.nan_at:
            logits = logits * float("nan")
        return logits


def build_model(vocab_size: int, context_length: int, rank: int = 1, sleep_s: float = 0.0, hang_at: int = 0,
                nan_at: int = 0, hang_s: float = 3600.0, build_sleep_s: float = 0.0) -> nn.Module:
    time.sleep(build_sleep_s)  # a slow start-up: e.g. weights fetched from far away
    shape = GPTShape(vocab_size=vocab_size, context_length=context_length, n_layer=2, n_head=2, d_model=64)
    return Misbehaving(GPT(shape), rank, sleep_s, hang_at, nan_at, hang_s)


class SlowTokens(Dataset):
    """Random-token samples that take ``delay_s`` each to produce (a starved input pipeline)."""

    vocab_size = 256

    def __init__(self, count: int, seq_len: int, delay_s: float) -> None:
        self.count, self.seq_len, self.delay_s = count, seq_len, delay_s

    def __len__(self) -> int:
        return self.count

    def __getitem__(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        time.sleep(self.delay_s)
        seq = torch.randint(0, 256, (self.seq_len + 1,), generator=torch.Generator().manual_seed(index))
        return seq[:-1], seq[1:]


def slow_dataset(split: str, seq_len: int) -> Dataset:
    # 4 samples per rank and step: 60 ms of waiting, several times a tiny step's compute
    # even when a loaded machine slows the compute down.
    return SlowTokens(4096 if split == "train" else 64, seq_len, delay_s=0.015)
