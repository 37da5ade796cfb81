"""A token-wise MLP language model: the smallest model that trains on meshyard's data.

Each position predicts the next token from its own embedding only (a learned bigram
model with hidden layers). It is cheap, has no attention, and is handy for quick
checks of the training machinery.
"""

from __future__ import annotations

import torch
from torch import nn


class MLP(nn.Module):
    """Embedding -> ``n_layer`` x (Linear, GELU) -> Linear to vocabulary logits."""

    def __init__(self, vocab_size: int, d_model: int = 128, n_layer: int = 2) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab_size, d_model)
        self.layers = nn.ModuleList(
            nn.Sequential(nn.Linear(d_model, d_model), nn.GELU()) for _ in range(n_layer)
        )
        self.head = nn.Linear(d_model, vocab_size)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.embed(tokens)
        for layer in self.layers:
            x = x + layer(x)
        return self.head(x)
