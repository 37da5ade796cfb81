"""A slot-based key/value cache for incremental decoding, and the protocol a model follows to use it.

Generating a token with a causal transformer needs the keys and values of every earlier token
in every layer. Recomputing them costs a forward over the whole prefix per new token; keeping
them costs memory and turns each decoding step into a forward over one token per sequence.

The cache is organised in **slots**, one per running sequence, so sequences of different
lengths decode together and a sequence can leave while the others go on: a freed slot is taken
by the next one (continuous batching). Each slot has its own length, and attention is masked
beyond it.

The protocol (what ``supports_kv_cache`` checks and ``meshyard.inference.decoding`` calls):

``model.init_kv_cache(batch_slots, max_length, dtype=None, device=None) -> KVCache``
    a cache with ``batch_slots`` slots of ``max_length`` positions (at most the model's context).
``model(tokens, cache=cache, slots=slots, positions=positions)``
    ``tokens`` [B, T] are new tokens only. Row b is written into slot ``slots[b]`` (default:
    slot b) at positions ``positions[b] .. positions[b] + T - 1`` (default: the slot's length,
    i.e. appended) and attends to everything the slot holds before it. Returns the logits of
    the given tokens only, [B, T, vocab] (or an object with ``.logits``). A prefill is a call
    with position 0; a decoding step is a call with T = 1.

Inside the model: ``step = cache.begin(slots, positions, T)`` once per forward (it checks the
request, updates the slots' lengths, and groups the rows by consecutive slots and similar
lengths with their masks, shared by all layers: each group is read in place), the absolute
token positions are ``step.positions`` (for position embeddings), and each attention layer ``i``
calls ``step.attend(i, q, k, v)`` with its new queries, keys and values shaped
(B, heads, T, head_dim): the cache stores k and v and returns the attention output.
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass
from typing import Sequence

import torch
import torch.nn.functional as F
from torch import nn

SlotIndex = torch.Tensor | Sequence[int]


# One more attention call costs about as much time as reading this many cached key and value
# elements (positions x heads x head_dim) of one row: ~20 us of fixed cost per call against
# DRAM-bound reads of the cache, measured on CPU for decoding steps. The split of a forward's
# rows into calls (``group_slots``) weighs the two.
SPLIT_COST_ELEMENTS = 48 * 1024


@dataclass(frozen=True)
class SlotGroup:
    """Rows of a forward whose slots are consecutive, attended together in place (no copy of
    the cache): ``rows`` index the forward's rows (a slice when they are too), ``slots`` the
    cache, and only the first ``span`` positions are read."""

    rows: slice | torch.Tensor
    slots: slice
    span: int
    mask: torch.Tensor | None  # [rows, 1, T, span] True where attention is allowed; None: everything


@dataclass(frozen=True)
class CacheStep:
    """One forward's view of the cache: which slots, where the new tokens go, what they see."""

    cache: KVCache
    slots: torch.Tensor  # [B] slot of each row, on the cache's device
    positions: torch.Tensor  # [B, T] absolute position of each new token, on the cache's device
    fresh: bool  # every row starts at position 0 with the same length: plain causal attention
    groups: tuple[SlotGroup, ...]  # the rows by consecutive slots and similar lengths (unless fresh)
    order: torch.Tensor | None  # puts the groups' rows, concatenated, back in row order; None: they are

    def attend(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """Store layer ``layer``'s new keys and values and return attention over the slot's contents.
        q, k, v: (B, heads, T, head_dim) -> (B, heads, T, head_dim)."""
        keys, values = self.cache.keys[layer], self.cache.values[layer]
        rows = self.slots[:, None].expand_as(self.positions)
        # Advanced indices on dims 0 and 2 around a slice put (B, T) first: (B, T, heads, head_dim).
        keys[rows, :, self.positions] = k.transpose(1, 2).to(keys.dtype)
        values[rows, :, self.positions] = v.transpose(1, 2).to(values.dtype)
        if self.fresh:
            # The same computation as the training forward.
            return F.scaled_dot_product_attention(q, k, v, is_causal=True)
        # Each group reads its slots in place, and only as far as its longest row: rows that
        # joined late do not pay for the span of the oldest one.
        outputs = [F.scaled_dot_product_attention(q[group.rows], keys[group.slots, :, : group.span].to(q.dtype),
                                                  values[group.slots, :, : group.span].to(q.dtype),
                                                  attn_mask=group.mask)
                   for group in self.groups]
        output = outputs[0] if len(outputs) == 1 else torch.cat(outputs)
        return output if self.order is None else output[self.order]


@dataclass(frozen=True)
class _DecodePlan:
    """The last decoding step: its rows' slots and ends (on the CPU) and its step."""

    slot_ids: torch.Tensor
    ends: torch.Tensor
    step: CacheStep


def group_slots(slots: torch.Tensor, ends: torch.Tensor, row_elements: int) -> list[tuple[int, int]]:
    """Split rows, sorted by slot, into ranges [a, b) of consecutive slots, choosing the cuts
    that minimise what attention reads (each range reads its longest row's ``ends`` positions
    for every row, ``row_elements`` elements per position) plus ``SPLIT_COST_ELEMENTS`` per
    range. Exact, by dynamic programming over the cut points: O(B^2) for B rows, nothing next
    to a forward."""
    split_positions = SPLIT_COST_ELEMENTS / row_elements
    slot_list, end_list = slots.tolist(), ends.tolist()
    count = len(slot_list)
    best = [0.0] + [float("inf")] * count  # best[b]: cheapest split of rows [0, b)
    cut = [0] * (count + 1)
    for b in range(1, count + 1):
        longest = 0
        for a in range(b - 1, -1, -1):
            if a < b - 1 and slot_list[a] + 1 != slot_list[a + 1]:
                break  # a range holds consecutive slots only
            longest = max(longest, end_list[a])
            cost = best[a] + split_positions + (b - a) * longest
            if cost < best[b]:
                best[b], cut[b] = cost, a
    ranges, b = [], count
    while b > 0:
        ranges.append((cut[b], b))
        b = cut[b]
    return ranges[::-1]


class KVCache:
    """Keys and values of ``n_layer`` attention layers for ``batch_slots`` sequences of up to
    ``max_length`` tokens, stored as (slots, heads, max_length, head_dim) per layer.

    ``lengths[s]`` is how many positions slot ``s`` holds. ``allocate`` / ``release`` hand out
    slots to a scheduler; a released slot's old contents are never read again, since a new
    sequence writes positions from 0 and attends only up to its own position."""

    def __init__(self, n_layer: int, batch_slots: int, n_head: int, max_length: int, head_dim: int, *,
                 dtype: torch.dtype = torch.float32, device: torch.device | str | None = None) -> None:
        if min(n_layer, batch_slots, n_head, max_length, head_dim) < 1:
            raise ValueError(
                f"a KV cache needs at least one layer, slot, head, position and head dimension; got "
                f"n_layer={n_layer}, batch_slots={batch_slots}, n_head={n_head}, max_length={max_length}, "
                f"head_dim={head_dim}: pass positive sizes")
        shape = (batch_slots, n_head, max_length, head_dim)
        self.keys = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(n_layer)]
        self.values = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(n_layer)]
        self.batch_slots = batch_slots
        self.max_length = max_length
        self.n_head, self.head_dim = n_head, head_dim
        self.device = self.keys[0].device
        # Lengths live on the CPU: the scheduler reads them every step without a device sync.
        self.lengths = torch.zeros(batch_slots, dtype=torch.long)
        self._free = list(range(batch_slots))
        self._arange = torch.arange(max_length, device=self.device)  # positions, for the masks
        self._plan: _DecodePlan | None = None  # the last decoding step, reused by the next one over its slots

    @property
    def bytes(self) -> int:
        """Memory held by the stored keys and values."""
        return sum(t.numel() * t.element_size() for t in (*self.keys, *self.values))

    @property
    def free_slots(self) -> int:
        """Slots not held by a sequence."""
        return len(self._free)

    def allocate(self) -> int:
        """Take a free slot (length 0) for a new sequence: the one beside the shortest held
        neighbours (the lowest of equals). A new sequence is the shortest one running, and
        sequences of similar lengths in neighbouring slots are attended together without
        reading far past their own lengths (see ``group_slots``)."""
        if not self._free:
            raise RuntimeError(f"all {self.batch_slots} slots of the KV cache are in use: release one "
                               "(release(slot)) when its sequence finishes, or make a cache with more slots")
        lengths = self.lengths.tolist()

        def neighbours(slot: int) -> int:
            return max((lengths[s] for s in (slot - 1, slot + 1) if 0 <= s < self.batch_slots), default=0)
        slot = min(self._free, key=lambda s: (neighbours(s), s))
        self._free.remove(slot)
        self.lengths[slot] = 0
        return slot

    def release(self, slot: int) -> None:
        """Give ``slot`` back; the next ``allocate`` may hand it to another sequence."""
        if slot in self._free or not 0 <= slot < self.batch_slots:
            raise ValueError(f"slot {slot} is not held (slots are 0..{self.batch_slots - 1}; free: "
                             f"{sorted(self._free)}): release each allocated slot exactly once")
        self.lengths[slot] = 0
        self._free.append(slot)

    def begin(self, slots: SlotIndex | None, positions: SlotIndex | None, n_new: int) -> CacheStep:
        """Prepare a forward of ``n_new`` tokens per row: row b goes to slot ``slots[b]`` at
        ``positions[b]`` (default: appended at the slot's length). Updates the lengths."""
        slot_ids = torch.as_tensor(range(self.batch_slots) if slots is None else slots, dtype=torch.long).cpu()
        starts = self.lengths[slot_ids] if positions is None else torch.as_tensor(positions, dtype=torch.long).cpu()
        plan = self._plan
        if (n_new == 1 and plan is not None and not plan.step.fresh and plan.slot_ids.shape == slot_ids.shape
                and torch.equal(plan.slot_ids, slot_ids) and torch.equal(plan.ends, starts)
                and int(starts.max()) < self.max_length):
            step = self._advance(plan.step)
        else:
            self._check(slot_ids, starts, n_new)
            step = self._plan_step(slot_ids, starts, n_new)
        ends = starts + n_new
        self.lengths[slot_ids] = ends
        # A decoding step is planned once: the next step over the same slots, each one token on,
        # keeps its groups and order (see _advance).
        self._plan = _DecodePlan(slot_ids.clone(), ends, step) if n_new == 1 else None
        return step

    def _plan_step(self, slot_ids: torch.Tensor, starts: torch.Tensor, n_new: int) -> CacheStep:
        """The step of rows ``slot_ids`` writing ``n_new`` tokens from ``starts``: rows grouped by
        consecutive slots and similar lengths (``group_slots``), each group's mask."""
        ends = starts + n_new
        token_positions = (starts[:, None] + torch.arange(n_new)).to(self.device)
        device_slots = slot_ids.to(self.device)
        if bool((starts == 0).all()):
            return CacheStep(self, device_slots, token_positions, True, (), None)
        by_slot = torch.argsort(slot_ids, stable=True)
        sorted_slots, sorted_ends = slot_ids[by_slot], ends[by_slot]
        in_order = bool((by_slot == torch.arange(len(by_slot))).all())
        groups = []
        for a, b in group_slots(sorted_slots, sorted_ends, self.n_head * self.head_dim):
            rows = slice(a, b) if in_order else by_slot[a:b].to(self.device)
            span = int(sorted_ends[a:b].max())
            masked = not bool((sorted_ends[a:b] == span).all()) or n_new > 1
            first = int(sorted_slots[a])
            groups.append(SlotGroup(rows, slice(first, first + b - a), span,
                                    self._mask(span, token_positions, rows) if masked else None))
        order = None if in_order else torch.argsort(by_slot).to(self.device)
        return CacheStep(self, device_slots, token_positions, False, tuple(groups), order)

    def _advance(self, step: CacheStep) -> CacheStep:
        """The decoding step after ``step``, over the same slots, each row one token further on.
        Its plan is ``step``'s with every span one longer: a split's cost (``group_slots``) grows
        by the same one position per row whatever the split, so the cheapest split stays the
        cheapest, and rows of equal length stay equal. Only positions and masks are new."""
        positions = step.positions + 1
        groups = tuple(SlotGroup(group.rows, group.slots, group.span + 1,
                                 None if group.mask is None else self._mask(group.span + 1, positions, group.rows))
                       for group in step.groups)
        return CacheStep(self, step.slots, positions, False, groups, step.order)

    def _mask(self, span: int, positions: torch.Tensor, rows: slice | torch.Tensor) -> torch.Tensor:
        """[rows, 1, T, span]: True where a new token may attend (positions up to its own)."""
        return (self._arange[:span] <= positions[rows][:, :, None])[:, None]

    def _check(self, slots: torch.Tensor, starts: torch.Tensor, n_new: int) -> None:
        """One clear error for a request the cache cannot hold."""
        if slots.ndim != 1 or starts.shape != slots.shape or len(slots) == 0 or n_new < 1:
            raise ValueError(f"a cached forward needs one slot and one start position per row and at least one "
                             f"new token; got slots of shape {tuple(slots.shape)}, positions of shape "
                             f"{tuple(starts.shape)} and {n_new} tokens per row")
        if len(set(slots.tolist())) != len(slots) or int(slots.min()) < 0 or int(slots.max()) >= self.batch_slots:
            raise ValueError(f"slots {slots.tolist()} must be distinct and in 0..{self.batch_slots - 1}")
        if bool((starts > self.lengths[slots]).any()) or int(starts.min()) < 0:
            raise ValueError(f"positions {starts.tolist()} skip past what slots {slots.tolist()} hold "
                             f"({self.lengths[slots].tolist()} tokens): write from a slot's length or earlier")
        if int(starts.max()) + n_new > self.max_length:
            raise ValueError(f"{n_new} new tokens at positions {starts.tolist()} exceed the cache's max_length="
                             f"{self.max_length}: make the cache longer (at most the model's context length)")


def supports_kv_cache(module: nn.Module) -> bool:
    """Whether ``module`` follows the cache protocol above: an ``init_kv_cache`` method and a
    forward that takes ``cache``, ``slots`` and ``positions``."""
    if not callable(getattr(module, "init_kv_cache", None)):
        return False
    try:
        parameters = inspect.signature(module.forward).parameters
    except (TypeError, ValueError):
        return False
    return all(name in parameters for name in ("cache", "slots", "positions"))
