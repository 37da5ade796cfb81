"""Generation with a KV cache: each prompt is prefilled once, then every step decodes one token
per unfinished row against the cache instead of recomputing the whole prefix.

Works with any module that follows the protocol of ``meshyard.models.kv_cache`` (meshyard's
GPT does). ``prefill`` and ``decode_step`` are the two forwards the continuous batcher
(``meshyard.serve.continuous``) interleaves between requests; ``generate_with_cache`` is
the plain batched loop over them.

Both generation loops (this one and ``meshyard.inference.engine.generate_by_recomputing``)
take an ``OnStep`` callback: after every step it gets the token each row drew, and answers
which rows nobody reads any more. That is how a server streams a batch's tokens as they
are decoded and frees the rows of clients that left, without a loop of its own.
"""

from __future__ import annotations

from typing import Callable, Collection, Sequence

import torch
from torch import nn

from meshyard.inference.checks import check_prompts
from meshyard.inference.sampling import Sampling, generator_for, next_tokens
from meshyard.models.kv_cache import KVCache, supports_kv_cache
from meshyard.models.outputs import logits_of

PREFILL_TOKENS = 8192
"""The most prompt tokens one prefill forward takes: its logits are (prompts, length,
vocabulary), which for 16 prompts of 8k tokens and a vocabulary of 128k would take 33 GB in
bf16; below it, prompts of one length prefill together (at the cost of about one prompt
where reading the weights dominates)."""

OnStep = Callable[[list[int], list[int]], Collection[int]]
"""on_step(rows, tokens) after each step of a batch's generation: ``tokens[i]`` is what row
``rows[i]`` (an index into the prompts) drew. It returns the rows to stop: they draw no
more, and their result holds the tokens drawn so far. Called on the generating thread."""


def device_of(module: nn.Module) -> torch.device:
    """Where ``module``'s weights are (the CPU for a module without any)."""
    tensor = next(module.parameters(), None)
    return tensor.device if tensor is not None else torch.device("cpu")


def require_kv_cache(module: nn.Module) -> None:
    """A clear error for a model without the cache protocol."""
    if not supports_kv_cache(module):
        raise TypeError(
            f"{type(module).__name__} does not implement the KV-cache protocol (an init_kv_cache method and a "
            "forward taking cache=, slots= and positions=, see meshyard.models.kv_cache): generate without a "
            "cache (serve.scheduler = 'dynamic') or add the protocol to the model")


def prefill(module: nn.Module, cache: KVCache, slot: int, prompt: Sequence[int]) -> torch.Tensor:
    """Write ``prompt`` into ``slot`` from position 0; the logits after its last token, [V] float32."""
    tokens = torch.tensor([list(prompt)], dtype=torch.long, device=cache.device)
    logits = logits_of(module(tokens, cache=cache, slots=[slot], positions=[0]))
    return logits[0, -1].float()


def prefill_together(module: nn.Module, cache: KVCache, slots: Sequence[int],
                     prompts: Sequence[Sequence[int]]) -> torch.Tensor:
    """Write prompts of one length into ``slots`` from position 0 in one forward (a batch
    prefills at the cost of about one prompt where reading the weights dominates); the
    logits after each prompt's last token, [B, V] float32."""
    tokens = torch.tensor([list(prompt) for prompt in prompts], dtype=torch.long, device=cache.device)
    logits = logits_of(module(tokens, cache=cache, slots=list(slots), positions=[0] * len(slots)))
    return logits[:, -1].float()


def decode_step(module: nn.Module, cache: KVCache, slots: Sequence[int], tokens: Sequence[int]) -> torch.Tensor:
    """Append one token per slot (``tokens[b]`` to ``slots[b]``) in one forward; the logits
    after each, [B, V] float32."""
    batch = torch.tensor(list(tokens), dtype=torch.long, device=cache.device)[:, None]
    logits = logits_of(module(batch, cache=cache, slots=list(slots)))
    return logits[:, -1].float()


def prefill_groups(lengths: Sequence[int]) -> list[list[int]]:
    """The indices of prompts of these ``lengths`` in groups that prefill together: prompts of
    one length, at most ``PREFILL_TOKENS`` tokens a forward (a longer prompt alone)."""
    by_length: dict[int, list[int]] = {}
    for index, length in enumerate(lengths):
        by_length.setdefault(length, []).append(index)
    groups = []
    for length, members in by_length.items():
        size = max(1, PREFILL_TOKENS // max(length, 1))
        groups += [members[start:start + size] for start in range(0, len(members), size)]
    return groups


def _prefill_by_length(module: nn.Module, cache: KVCache, slot_of: dict[int, int], prompts: list[list[int]],
                       rows: list[int]) -> torch.Tensor:
    """Prefill ``rows`` in ``prefill_groups``; [len(rows), V] logits in row order."""
    after: dict[int, torch.Tensor] = {}
    for group in prefill_groups([len(prompts[row]) for row in rows]):
        members = [rows[i] for i in group]
        logits = prefill_together(module, cache, [slot_of[row] for row in members], [prompts[row] for row in members])
        after.update(zip(members, logits))
    return torch.stack([after[row] for row in rows])


def generate_with_cache(module: nn.Module, prompts: list[list[int]], sampling: list[Sampling],
                        context_length: int, vocab_size: int, on_step: OnStep | None = None) -> list[list[int]]:
    """The new tokens of each prompt (exactly ``sampling[i].max_new_tokens`` for row i, no stop
    token, unless ``on_step`` stopped the row), decoded with a KV cache: one prefill forward
    per prompt, then one batched forward per step over all unfinished rows. Row i's tokens
    equal what it gives alone (each row draws from its own generator)."""
    require_kv_cache(module)
    check_prompts(prompts, sampling, vocab_size, context_length)
    rows = [i for i, settings in enumerate(sampling) if settings.max_new_tokens > 0]
    out: list[list[int]] = [[] for _ in prompts]
    if not rows:
        return out
    longest = max(len(prompts[i]) + sampling[i].max_new_tokens for i in rows)
    generators = [generator_for(settings) for settings in sampling]
    with torch.inference_mode():
        cache = module.init_kv_cache(len(rows), longest, device=device_of(module))
        # A cache for one call decodes through the grouped step, not the every-slot one. The
        # every-slot step pays off only replayed from a CUDA graph, captured after a cache's
        # first steps (models/decode_graph.py): a capture per call would cost several steps'
        # time for a few replays, and eagerly the every-slot step only adds work (it computes
        # finished rows too and reads each slot to the cache's end, where the grouped step
        # reads the rows' spans). Long-lived caches (the continuous scheduler's) keep it.
        cache.every_slot_steps = False
        slot_of = {row: slot for slot, row in enumerate(rows)}
        logits = _prefill_by_length(module, cache, slot_of, prompts, rows)
        while True:
            chosen = next_tokens(logits, [sampling[i] for i in rows], [generators[i] for i in rows],
                                 vocab_size).tolist()
            for row, token in zip(rows, chosen):
                out[row].append(token)
            stopped = on_step(rows, chosen) if on_step is not None else ()
            going = [(row, token) for row, token in zip(rows, chosen)
                     if len(out[row]) < sampling[row].max_new_tokens and row not in stopped]
            if not going:
                return out
            rows = [row for row, _ in going]
            logits = decode_step(module, cache, [slot_of[row] for row in rows], [token for _, token in going])
