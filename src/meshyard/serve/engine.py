"""What the server asks of a loaded model, and the eager PyTorch engine that answers it.

An engine takes token ids and gives next-token logits or new tokens, for a batch at a
time. The batch is right-padded to its longest sequence: a causal model's logits at a
position depend only on the positions before it, so the padding after a sequence's last
token never changes that sequence's logits, and each row reads its own last position.
"""

from __future__ import annotations

from typing import Callable, Protocol, Sequence

import torch
from torch import nn

from meshyard.models.kv_cache import supports_kv_cache
from meshyard.models.outputs import logits_of
from meshyard.serve.decoding import generate_with_cache
from meshyard.serve.sampling import generator_for, next_tokens
from meshyard.serve.types import Sampling

PAD_ID = 0  # what fills the right of shorter rows; never read back (see the module docstring)

Forward = Callable[[torch.Tensor], torch.Tensor]
"""A padded [B, T] LongTensor of ids to [B, T, V] logits."""


class Engine(Protocol):
    """A loaded model as the server uses it; every method is synchronous and is called
    from one inference thread."""

    vocab_size: int
    context_length: int  # longest sequence (prompt + new tokens) the model accepts
    bytes: int  # parameters and buffers held in memory
    supports_generate: bool  # False for an engine that only gives logits

    def next_token_logits(self, sequences: list[list[int]]) -> torch.Tensor:
        """[B, V] float32: the logits after each sequence's last token, from one forward."""
        ...

    def generate(self, prompts: list[list[int]], sampling: list[Sampling]) -> list[list[int]]:
        """The new tokens of each prompt; row i has exactly ``sampling[i].max_new_tokens``."""
        ...

    def warm_up(self) -> None:
        """One small forward, so that the first request pays no start-up cost."""
        ...


def check_sequences(sequences: Sequence[Sequence[int]], vocab_size: int, context_length: int,
                    new_tokens: Sequence[int] | None = None) -> None:
    """Raise ValueError naming the first sequence that is empty, holds an id outside
    [0, vocab_size), or with its ``new_tokens`` does not fit ``context_length``."""
    if not sequences:
        raise ValueError("no sequences were given; send at least one sequence of token ids")
    for i, sequence in enumerate(sequences):
        extra = new_tokens[i] if new_tokens is not None else 0
        if not sequence:
            raise ValueError(f"sequence {i} is empty; give at least one token id")
        low, high = min(sequence), max(sequence)
        if low < 0 or high >= vocab_size:
            bad = low if low < 0 else high
            raise ValueError(f"sequence {i} holds token id {bad}, outside this model's vocabulary "
                             f"[0, {vocab_size}); send ids from 0 to {vocab_size - 1}")
        if extra < 0:
            raise ValueError(f"row {i} asks for {extra} new tokens; ask for 0 or more")
        if len(sequence) + extra > context_length:
            asked = f"{len(sequence)} tokens" + (f" + {extra} new tokens" if new_tokens is not None else "")
            raise ValueError(f"sequence {i} needs {asked}, more than this model's context of "
                             f"{context_length}; shorten the prompt or ask for fewer new tokens")


def padded(sequences: Sequence[Sequence[int]]) -> tuple[torch.Tensor, torch.Tensor]:
    """The sequences right-padded into a [B, T] LongTensor, and each one's last index [B]."""
    width = max(len(s) for s in sequences)
    batch = torch.full((len(sequences), width), PAD_ID, dtype=torch.long)
    for i, sequence in enumerate(sequences):
        batch[i, : len(sequence)] = torch.as_tensor(sequence, dtype=torch.long)
    last = torch.tensor([len(s) - 1 for s in sequences], dtype=torch.long)
    return batch, last


def last_logits(forward: Forward, sequences: Sequence[Sequence[int]]) -> torch.Tensor:
    """[B, V] float32 on the CPU: each sequence's logits after its last token, from one
    forward over the right-padded batch (a CPU tensor; ``forward`` moves it where it runs)."""
    batch, last = padded(sequences)
    logits = forward(batch)
    rows = logits[torch.arange(len(sequences), device=logits.device), last.to(logits.device)]
    return rows.to(device="cpu", dtype=torch.float32)


def check_prompts(prompts: Sequence[Sequence[int]], sampling: Sequence[Sampling], vocab_size: int,
                  context_length: int) -> None:
    """Raise ValueError unless there is one ``Sampling`` per prompt and every prompt with its
    new tokens fits (``check_sequences``)."""
    if len(prompts) != len(sampling):
        raise ValueError(f"{len(prompts)} prompts but {len(sampling)} Sampling values; give one per prompt")
    check_sequences(prompts, vocab_size, context_length, [s.max_new_tokens for s in sampling])


def generate_by_recomputing(forward: Forward, prompts: list[list[int]], sampling: list[Sampling],
                            context_length: int, vocab_size: int) -> list[list[int]]:
    """New tokens for each prompt, recomputing the whole padded batch at every step.

    Each step is one forward over the rows still generating; a row leaves once it has its
    ``max_new_tokens``. Row i draws from its own generator, so its tokens equal what it
    gets alone. Raises ValueError on ids outside the vocabulary or a prompt plus its new
    tokens longer than ``context_length``.
    """
    check_prompts(prompts, sampling, vocab_size, context_length)
    generators = [generator_for(s) for s in sampling]
    sequences = [list(p) for p in prompts]
    new: list[list[int]] = [[] for _ in prompts]
    while True:
        active = [i for i, s in enumerate(sampling) if len(new[i]) < s.max_new_tokens]
        if not active:
            return new
        logits = last_logits(forward, [sequences[i] for i in active])
        chosen = next_tokens(logits, [sampling[i] for i in active], [generators[i] for i in active])
        for i, token in zip(active, chosen.tolist()):
            sequences[i].append(token)
            new[i].append(token)


def module_bytes(module: nn.Module) -> int:
    """Bytes of the module's parameters and buffers, a tensor shared by two names (tied
    embeddings) counted once."""
    seen: dict[tuple[int, int], int] = {}
    for tensor in [*module.parameters(), *module.buffers()]:
        key = (tensor.untyped_storage().data_ptr(), tensor.storage_offset())
        seen[key] = tensor.numel() * tensor.element_size()
    return sum(seen.values())


class EagerEngine:
    """A PyTorch module run as is (eval mode, ``torch.inference_mode``).

    ``module`` maps [B, T] ids to [B, T, V] logits (or an object holding them) and must be
    causal. It stays public so that another decoding path (a KV cache) can drive it.
    """

    def __init__(self, module: nn.Module, vocab_size: int, context_length: int, *,
                 supports_generate: bool = True) -> None:
        self.module = module.eval()
        self.vocab_size = vocab_size
        self.context_length = context_length
        self.supports_generate = supports_generate
        self.bytes = module_bytes(module)
        first = next(module.parameters(), None)
        self.device = first.device if first is not None else torch.device("cpu")

    def forward(self, batch: torch.Tensor) -> torch.Tensor:
        """[B, T] ids (on any device) to [B, T, V] logits on the module's device."""
        return logits_of(self.module(batch.to(self.device)))

    def next_token_logits(self, sequences: list[list[int]]) -> torch.Tensor:
        """[B, V] float32: the logits after each sequence's last token, from one forward."""
        check_sequences(sequences, self.vocab_size, self.context_length)
        with torch.inference_mode():
            return last_logits(self.forward, sequences)

    def generate(self, prompts: list[list[int]], sampling: list[Sampling]) -> list[list[int]]:
        """The new tokens of each prompt: with a KV cache when the module has one (the same
        tokens, each step's cost independent of the prefix), else by recomputing the prefix
        (``generate_by_recomputing``)."""
        if supports_kv_cache(self.module):
            check_prompts(prompts, sampling, self.vocab_size, self.context_length)
            return generate_with_cache(self.module, prompts, sampling, self.context_length)
        with torch.inference_mode():
            return generate_by_recomputing(self.forward, prompts, sampling, self.context_length, self.vocab_size)

    def warm_up(self) -> None:
        """One forward of a single token."""
        self.next_token_logits([[0]])
