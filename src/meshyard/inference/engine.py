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

from meshyard.inference.checks import check_prompts, check_sequences
from meshyard.inference.decoding import OnStep, device_of, generate_with_cache
from meshyard.inference.sampling import Sampling, generator_for, next_tokens
from meshyard.models.kv_cache import supports_kv_cache
from meshyard.models.outputs import logits_of

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

    def generate(self, prompts: list[list[int]], sampling: list[Sampling],
                 on_step: OnStep | None = None) -> list[list[int]]:
        """The new tokens of each prompt; row i has exactly ``sampling[i].max_new_tokens``
        unless ``on_step`` (called after every step, see ``meshyard.inference.decoding``)
        stopped it."""
        ...

    def warm_up(self) -> None:
        """One small forward, so that the first request pays no start-up cost."""
        ...


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


def generate_by_recomputing(forward: Forward, prompts: list[list[int]], sampling: list[Sampling],
                            context_length: int, vocab_size: int, on_step: OnStep | None = None) -> list[list[int]]:
    """New tokens for each prompt, recomputing the whole padded batch at every step.

    Each step is one forward over the rows still generating; a row leaves once it has its
    ``max_new_tokens``, or when ``on_step`` stops it. Row i draws from its own generator, so its tokens equal what it
    gets alone. Raises ValueError on ids outside the vocabulary or a prompt plus its new
    tokens longer than ``context_length``.
    """
    check_prompts(prompts, sampling, vocab_size, context_length)
    generators = [generator_for(s) for s in sampling]
    sequences = [list(p) for p in prompts]
    new: list[list[int]] = [[] for _ in prompts]
    stopped: set[int] = set()
    while True:
        active = [i for i, s in enumerate(sampling) if len(new[i]) < s.max_new_tokens and i not in stopped]
        if not active:
            return new
        logits = last_logits(forward, [sequences[i] for i in active])
        chosen = next_tokens(logits, [sampling[i] for i in active], [generators[i] for i in active],
                             vocab_size).tolist()
        for i, token in zip(active, chosen):
            sequences[i].append(token)
            new[i].append(token)
        if on_step is not None:
            stopped.update(on_step(active, chosen))


def module_bytes(module: nn.Module) -> int:
    """Bytes of the module's parameters and buffers, a tensor shared by two names (tied
    embeddings) counted once."""
    seen: dict[tuple[int, int], int] = {}
    for tensor in [*module.parameters(), *module.buffers()]:
        key = (tensor.untyped_storage().data_ptr(), tensor.storage_offset())
        seen[key] = tensor.numel() * tensor.element_size()
    return sum(seen.values())


class ForwardEngine:
    """An engine over a forward function ([B, T] ids to [B, T, V] logits): next-token logits
    from one forward, generation by recomputing the padded batch at every step. ``bytes`` is
    what the runtime holds (an export's file size)."""

    supports_generate = True

    def __init__(self, forward: Forward, vocab_size: int, context_length: int, bytes_: int) -> None:
        self.forward = forward
        self.vocab_size = vocab_size
        self.context_length = context_length
        self.bytes = bytes_

    def next_token_logits(self, sequences: list[list[int]]) -> torch.Tensor:
        """[B, V] float32: the logits after each sequence's last token, from one forward; a
        model's padded vocabulary (ids from ``vocab_size`` on) is cut off."""
        check_sequences(sequences, self.vocab_size, self.context_length)
        with torch.inference_mode():
            return last_logits(self.forward, sequences)[:, : self.vocab_size]

    def generate(self, prompts: list[list[int]], sampling: list[Sampling],
                 on_step: OnStep | None = None) -> list[list[int]]:
        """The new tokens of each prompt, recomputing the padded batch at every step."""
        with torch.inference_mode():
            return generate_by_recomputing(self.forward, prompts, sampling, self.context_length, self.vocab_size,
                                           on_step)

    def warm_up(self) -> None:
        """One forward of a single token (a runtime's first call plans its kernels)."""
        self.next_token_logits([[0]])


class EagerEngine(ForwardEngine):
    """A PyTorch module run as is (eval mode, ``torch.inference_mode``).

    ``module`` maps [B, T] ids to [B, T, V] logits (or an object holding them) and must be
    causal. It stays public so that another decoding path (a KV cache) can drive it.
    """

    def __init__(self, module: nn.Module, vocab_size: int, context_length: int, *,
                 supports_generate: bool = True) -> None:
        self.module = module.eval()
        self.device = device_of(module)
        super().__init__(self._logits, vocab_size, context_length, module_bytes(module))
        self.supports_generate = supports_generate
        self._has_kv_cache = supports_kv_cache(module)

    def _logits(self, batch: torch.Tensor) -> torch.Tensor:
        """[B, T] ids (on any device) to [B, T, V] logits on the module's device."""
        return logits_of(self.module(batch.to(self.device)))

    def generate(self, prompts: list[list[int]], sampling: list[Sampling],
                 on_step: OnStep | None = None) -> list[list[int]]:
        """The new tokens of each prompt: with a KV cache when the module has one (the same
        tokens, each step's cost independent of the prefix), else by recomputing the prefix."""
        if self._has_kv_cache:
            return generate_with_cache(self.module, prompts, sampling, self.context_length, self.vocab_size,
                                       on_step)
        return super().generate(prompts, sampling, on_step)
