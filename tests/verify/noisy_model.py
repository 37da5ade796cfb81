"""A model whose training forward adds noise (random beyond any dropout rate): ``verify`` must
say so instead of a bare FAIL."""

import torch
from torch import nn


class NoisyLM(nn.Module):
    def __init__(self, vocab_size: int) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab_size, 16)
        self.head = nn.Linear(16, vocab_size)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        hidden = self.embed(tokens)
        if self.training:
            hidden = hidden + 1e-3 * torch.randn_like(hidden)
        return self.head(hidden)


def build(vocab_size: int) -> nn.Module:
    return NoisyLM(vocab_size)
