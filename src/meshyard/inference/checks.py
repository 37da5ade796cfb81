"""The checks every way of running a model applies to the token ids it is given: one clear
ValueError naming the first row that cannot be run, and how to fix it."""

from __future__ import annotations

from typing import Sequence

from meshyard.inference.sampling import Sampling


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


def check_prompts(prompts: Sequence[Sequence[int]], sampling: Sequence[Sampling], vocab_size: int,
                  context_length: int) -> None:
    """Raise ValueError unless there is one ``Sampling`` per prompt and every prompt with its
    new tokens fits (``check_sequences``)."""
    if len(prompts) != len(sampling):
        raise ValueError(f"{len(prompts)} prompts but {len(sampling)} Sampling values; give one per prompt")
    check_sequences(prompts, vocab_size, context_length, [s.max_new_tokens for s in sampling])
