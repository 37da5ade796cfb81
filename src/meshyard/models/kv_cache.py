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
(B, heads, T, head_dim): the cache stores k and v and returns the attention output. A forward
that has its keys and values side by side (B, T, 2, heads, head_dim), as one projection makes
them, calls ``step.store(i, kv)`` and ``step.read(i, q)`` instead: one write per layer.
"""

from __future__ import annotations

import contextlib
import inspect
from dataclasses import dataclass
from typing import ContextManager, Sequence

import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.attention import SDPBackend, sdpa_kernel

SlotIndex = torch.Tensor | Sequence[int]


# One more attention call costs about as much time as reading this many cached key and value
# elements (positions x heads x head_dim) of one row: ~20 us of fixed cost per call against
# DRAM-bound reads of the cache, measured on CPU for decoding steps. The split of a forward's
# rows into calls (``group_slots``) weighs the two.
SPLIT_COST_ELEMENTS = 48 * 1024


# Attention kernels that run any shape as it comes. A cached forward's key length changes
# with every step and every prompt, and cuDNN's attention, which PyTorch may choose on recent
# GPUs, builds an execution plan for each new shape on the host before it runs: a decoding
# step would pay a plan build per step.
PLANLESS_ATTENTION = [SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH]


def planless_attention(device: torch.device) -> ContextManager[None]:
    """The attention kernels a cached forward on ``device`` may use (see ``PLANLESS_ATTENTION``);
    off CUDA there is nothing to exclude."""
    return sdpa_kernel(PLANLESS_ATTENTION) if device.type == "cuda" else contextlib.nullcontext()


@dataclass(frozen=True)
class SlotGroup:
    """Rows of a forward whose slots are consecutive, attended together in place (no copy of
    the cache): ``rows`` index the forward's rows (a slice when they are too), ``slots`` the
    cache, and only the first ``span`` positions are read."""

    rows: slice | torch.Tensor
    slots: slice
    span: int
    # [rows, 1, T, span] added to the attention scores: 0 where attention is allowed, -inf where
    # not (what scaled_dot_product_attention makes of a boolean mask); None: everything.
    mask: torch.Tensor | None
    # A decoding step's mask as wide as the cache: ``mask`` is its last ``span`` columns, in this
    # step and every later one over the same rows (see KVCache._advance); None: no mask.
    aligned_mask: torch.Tensor | None = None


@dataclass(frozen=True)
class CacheStep:
    """One forward's view of the cache: which slots, where the new tokens go, what they see."""

    cache: KVCache
    slots: torch.Tensor  # [B] slot of each row, on the cache's device
    positions: torch.Tensor  # [B, T] absolute position of each new token, on the cache's device
    fresh: bool  # every row starts at position 0 with the same length: plain causal attention
    groups: tuple[SlotGroup, ...]  # the rows by consecutive slots and similar lengths (unless fresh)
    order: torch.Tensor | None  # puts the groups' rows, concatenated, back in row order; None: they are
    targets: tuple[torch.Tensor, torch.Tensor]  # ([B, T] slot, [B, T] position) each new token is stored at

    def attend(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """Store layer ``layer``'s new keys and values and return attention over the slot's contents.
        q, k, v: (B, heads, T, head_dim) -> (B, heads, T, head_dim)."""
        # (B, 2, heads, T, head_dim) -> (B, T, 2, heads, head_dim), the layout ``store`` takes.
        self.store(layer, torch.stack((k, v), dim=1).permute(0, 3, 1, 2, 4))
        if self.fresh:
            # The same computation as the training forward.
            return F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.read(layer, q)

    def store(self, layer: int, kv: torch.Tensor) -> None:
        """Write layer ``layer``'s new keys and values, kv (B, T, 2, heads, head_dim), into the
        rows' slots at their positions: one indexed write of both."""
        self.cache.by_position[layer].index_put_(self.targets, kv.to(self.cache.dtype))

    def read(self, layer: int, q: torch.Tensor) -> torch.Tensor:
        """Attention of q (B, heads, T, head_dim) over what layer ``layer`` holds in the rows' slots
        up to each query's position (its own keys and values stored first) -> (B, heads, T, head_dim)."""
        keys, values = self.cache.keys[layer], self.cache.values[layer]
        # Each group reads its slots in place, and only as far as its longest row: rows that
        # joined late do not pay for the span of the oldest one.
        outputs = [F.scaled_dot_product_attention(q[group.rows], keys[group.slots, :, : group.span].to(q.dtype),
                                                  values[group.slots, :, : group.span].to(q.dtype),
                                                  attn_mask=None if group.mask is None else group.mask.to(q.dtype))
                   for group in self.groups]
        output = outputs[0] if len(outputs) == 1 else torch.cat(outputs)
        return output if self.order is None else output[self.order]


# CUDA's memory-efficient attention reads an attention mask in 16-byte vectors from its first
# element and checks only the mask's strides, not where it starts: a view that starts
# mid-vector fails with "misaligned address".
CUDA_MASK_ALIGNMENT_BYTES = 16


def last_columns(wide: torch.Tensor, span: int, *, align: bool | None = None) -> torch.Tensor:
    """The last ``span`` columns of a step's wide mask, as attention reads them. A view where
    that is safe; on CUDA (``align`` None: decided by the mask's device) a copy whose start and
    row strides are 16-byte aligned when the view's would not be (one small copy per group and
    step, shared by all layers)."""
    view = wide[..., -span:]
    if not (wide.device.type == "cuda" if align is None else align):
        return view
    per_vector = CUDA_MASK_ALIGNMENT_BYTES // view.element_size()
    if view.storage_offset() % per_vector == 0 and wide.shape[-1] % per_vector == 0:
        return view
    padded = view.new_empty(*view.shape[:-1], -(-span // per_vector) * per_vector)
    return padded[..., :span].copy_(view)


@dataclass(frozen=True)
class _DecodePlan:
    """The last decoding step: its rows' slots (a list, and on the CPU), ends (on the CPU),
    longest end, and its step's parts. Not the step itself: that refers to the cache, which
    holds this plan, and the cycle would keep the cache's memory until a garbage-collector pass."""

    slot_list: list[int]
    slot_ids: torch.Tensor
    ends: torch.Tensor
    longest: int
    slots: torch.Tensor
    positions: torch.Tensor
    groups: tuple[SlotGroup, ...]
    order: torch.Tensor | None
    target_slots: torch.Tensor

    @classmethod
    def of(cls, slot_list: list[int], slot_ids: torch.Tensor, ends: torch.Tensor, longest: int,
           step: CacheStep) -> _DecodePlan:
        return cls(slot_list, slot_ids, ends, longest, step.slots, step.positions, step.groups, step.order,
                   step.targets[0])


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
    ``max_length`` tokens. A layer's keys and values lie in one tensor (slots, 2, heads,
    max_length, head_dim), so that a step writes both in one operation (``by_position``);
    ``keys[i]`` and ``values[i]`` are its two halves (slots, heads, max_length, head_dim),
    which attention reads in place.

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
        layers = [torch.zeros(batch_slots, 2, n_head, max_length, head_dim, dtype=dtype, device=device)
                  for _ in range(n_layer)]
        self.keys = [layer[:, 0] for layer in layers]
        self.values = [layer[:, 1] for layer in layers]
        # The same memory indexed by (slot, position) first: (slots, max_length, 2, heads, head_dim),
        # where a token's keys and values are one entry to write.
        self.by_position = [layer.permute(0, 3, 1, 2, 4) for layer in layers]
        self.batch_slots = batch_slots
        self.max_length = max_length
        self.n_head, self.head_dim = n_head, head_dim
        self.dtype = dtype
        self.device = layers[0].device
        # Lengths live on the CPU: the scheduler reads them every step without a device sync.
        self.lengths = torch.zeros(batch_slots, dtype=torch.long)
        self._free = list(range(batch_slots))
        self._arange = torch.arange(max_length, device=self.device)  # positions, for the masks
        self._plan: _DecodePlan | None = None  # the last decoding step, reused by the next one over its slots
        # On a GPU a decoding step's host work (tens of kernel launches per layer) outweighs its
        # matrix work: there a model may compute every slot at once in fixed shapes
        # (``begin_every_slot``), which a CUDA graph replays; on a CPU reading only the rows'
        # spans (``begin``) is faster. Settable, e.g. to check the two agree.
        self.every_slot_steps = self.device.type == "cuda"
        # Where a model keeps its captured step for this cache (it holds this cache's tensors).
        self.step_graph: object | None = None

    @property
    def bytes(self) -> int:
        """Memory held by the stored keys and values."""
        return sum(t.numel() * t.element_size() for t in self.by_position)

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
        plan = self._plan
        if n_new == 1 and plan is not None and self._continues(plan, slots, positions):
            # Checked by the step that made the plan; each row is one position further on.
            slot_list, slot_ids, ends, longest = plan.slot_list, plan.slot_ids, plan.ends + 1, plan.longest + 1
            step = self._advance(plan)
        else:
            slot_ids = torch.as_tensor(range(self.batch_slots) if slots is None else slots, dtype=torch.long).cpu()
            starts = self.lengths[slot_ids] if positions is None else torch.as_tensor(positions, dtype=torch.long).cpu()
            self._check(slot_ids, starts, n_new)
            step = self._plan_step(slot_ids, starts, n_new)
            slot_list, slot_ids, ends = slot_ids.tolist(), slot_ids.clone(), starts + n_new
            longest = int(ends.max())
        self.lengths.index_copy_(0, slot_ids, ends)
        # A decoding step is planned once: the next step over the same slots, each one token on,
        # keeps its groups and order (see _advance).
        self._plan = _DecodePlan.of(slot_list, slot_ids, ends, longest, step) if n_new == 1 and not step.fresh else None
        return step

    def begin_every_slot(self, slots: SlotIndex) -> tuple[torch.Tensor, torch.Tensor]:
        """Prepare a decoding step that appends one token to each of ``slots`` and computes every
        slot of the cache (see ``every_slot_steps``): the position each slot's token takes and
        whether the slot is stepped, both [batch_slots] on the CPU. The other slots are computed
        at their next position (the last one when full) and neither written nor lengthened."""
        slot_ids = torch.as_tensor(slots, dtype=torch.long).cpu()
        self._check(slot_ids, self.lengths[slot_ids], 1)
        positions = self.lengths.clamp(max=self.max_length - 1)
        stepped = torch.zeros(self.batch_slots, dtype=torch.bool)
        stepped[slot_ids] = True
        self.lengths[slot_ids] += 1
        self._plan = None
        return positions, stepped

    def _continues(self, plan: _DecodePlan, slots: SlotIndex | None, positions: SlotIndex | None) -> bool:
        """Whether a decoding step over ``slots`` from ``positions`` is the one after ``plan``:
        the same rows, each starting where the plan's step ended, with room for one more token.
        Compared on Python ints first: a step that continues costs no new index tensors."""
        if plan.longest >= self.max_length:
            return False
        if slots is None:
            slot_list = list(range(self.batch_slots))
        else:
            slot_list = slots.tolist() if isinstance(slots, torch.Tensor) else list(slots)
        if slot_list != plan.slot_list:
            return False
        if positions is None:
            return torch.equal(self.lengths[plan.slot_ids], plan.ends)
        return torch.equal(torch.as_tensor(positions, dtype=torch.long).cpu(), plan.ends)

    def _plan_step(self, slot_ids: torch.Tensor, starts: torch.Tensor, n_new: int) -> CacheStep:
        """The step of rows ``slot_ids`` writing ``n_new`` tokens from ``starts``: rows grouped by
        consecutive slots and similar lengths (``group_slots``), each group's mask."""
        ends = starts + n_new
        token_positions = (starts[:, None] + torch.arange(n_new)).to(self.device)
        device_slots = slot_ids.to(self.device)
        targets = (device_slots[:, None].expand_as(token_positions), token_positions)
        if bool((starts == 0).all()):
            return CacheStep(self, device_slots, token_positions, True, (), None, targets)
        by_slot = torch.argsort(slot_ids, stable=True)
        sorted_slots, sorted_ends = slot_ids[by_slot], ends[by_slot]
        in_order = bool((by_slot == torch.arange(len(by_slot))).all())
        groups = []
        for a, b in group_slots(sorted_slots, sorted_ends, self.n_head * self.head_dim):
            rows = slice(a, b) if in_order else by_slot[a:b].to(self.device)
            span = int(sorted_ends[a:b].max())
            masked = not bool((sorted_ends[a:b] == span).all()) or n_new > 1
            first = int(sorted_slots[a])
            # A decoding step's mask serves the later steps too: it is made as wide as the cache.
            width = self.max_length if n_new == 1 else span
            aligned = self._mask(span, token_positions, rows, width) if masked else None
            groups.append(SlotGroup(rows, slice(first, first + b - a), span,
                                    None if aligned is None else last_columns(aligned, span), aligned))
        order = None if in_order else torch.argsort(by_slot).to(self.device)
        return CacheStep(self, device_slots, token_positions, False, tuple(groups), order, targets)

    def _advance(self, plan: _DecodePlan) -> CacheStep:
        """The decoding step after ``plan``'s, over the same slots, each row one token further on.
        Its groups are the plan's with every span one longer: a split's cost (``group_slots``) grows
        by the same one position per row whatever the split, so the cheapest split stays the
        cheapest, and rows of equal length stay equal. A group's mask is one column wider: each
        row and the span grow together, so the masked positions past a row's end are as many as
        before and the mask, aligned on its last column, is the same (``aligned_mask``'s last columns).
        Only the positions are a new tensor."""
        positions = plan.positions + 1
        groups = tuple(SlotGroup(group.rows, group.slots, group.span + 1,
                                 None if group.aligned_mask is None
                                 else last_columns(group.aligned_mask, group.span + 1), group.aligned_mask)
                       for group in plan.groups)
        return CacheStep(self, plan.slots, positions, False, groups, plan.order, (plan.target_slots, positions))

    def _mask(self, span: int, positions: torch.Tensor, rows: slice | torch.Tensor, width: int) -> torch.Tensor:
        """[rows, 1, T, width], to add to attention scores over ``span`` positions aligned on the
        last column: 0 where a new token may attend (positions up to its own), -inf elsewhere."""
        # Column c stands for position c - (width - span).
        allowed = self._arange[:width] <= positions[rows][:, :, None] + (width - span)
        mask = torch.zeros(allowed.shape, dtype=self.dtype, device=self.device)
        return mask.masked_fill_(~allowed, float("-inf"))[:, None]

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
