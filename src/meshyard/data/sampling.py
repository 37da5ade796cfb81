"""Deterministic, resumable assignment of samples to data-parallel ranks.

All ranks walk one global stream of sample indices: epoch ``e`` is a permutation of the
training samples drawn from ``(seed, e)``. Optimizer step ``s`` consumes stream
positions ``[s*B, (s+1)*B)`` for the global batch ``B``; data-parallel rank ``r`` takes
the ``r``-th contiguous slice of that range and cuts it into micro-batches. So:

- ranks are disjoint within every step and together cover the global batch exactly;
- the samples of a step do not depend on how many ranks share it, so a single process
  and N ranks train on the same batches (the basis of parity tests), and a position
  saved as a step index maps onto any other world size.

Every source shuffles over all its samples, except a corpus of token shards on object
storage, which reads best shard by shard: ``SpanOrder`` draws its epochs so that each
place in the global batch reads its own stretch of the corpus, a few shards at a time,
and a rank fetches only its share. It is still a function of the seed and the global
batch (and the corpus), never of the world size.

Stretches of the stream can be skipped (``skip``: the spike and NaN guard drops the
samples of steps it rolled back): optimizer step ``s`` then takes the ``s``-th stream
step that is not skipped, so the skip list and a step index still say exactly where
the stream stands.
"""

from __future__ import annotations

import copy

from typing import Callable

import numpy as np


class GlobalBatchSampler:
    """Batch sampler yielding this rank's micro-batches of dataset indices, forever."""

    def __init__(
        self,
        num_samples: int,
        global_batch: int,
        micro_batch: int,
        dp_rank: int,
        dp_size: int,
        seed: int,
        shuffle: bool = True,
        order: SpanOrder | None = None,
    ) -> None:
        if global_batch > num_samples:
            raise ValueError(
                f"the training split has {num_samples} samples, fewer than one global batch of {global_batch}; "
                "use more data (data.max_tokens, data.paths) or a smaller train.global_batch / data.seq_len"
            )
        if global_batch % (micro_batch * dp_size):
            raise ValueError(f"global batch {global_batch} is not a multiple of {micro_batch} x {dp_size}")
        self.num_samples = num_samples
        self.global_batch = global_batch
        self.micro_batch = micro_batch
        self.dp_rank = dp_rank
        self.dp_size = dp_size
        self.seed = seed
        self.shuffle = shuffle
        self.order = order  # None: each epoch a permutation of all samples
        if order is not None and order.num_samples != num_samples:
            raise ValueError(f"the sample order covers {order.num_samples} samples, the dataset {num_samples}")
        self.steps_per_epoch = num_samples // global_batch  # the last partial batch is dropped
        self.start_step = 0  # where a new iterator begins (set by a resume)
        self.micro_per_step = global_batch // (micro_batch * dp_size)
        self.skipped: list[tuple[int, int]] = []  # stream steps [first, end) never trained on, sorted
        # Told each micro-batch taken and those that follow it (a source that fetches ahead
        # of need, such as token shards on object storage); None: nobody asks.
        self.look_ahead: Callable[[list[list[int]]], None] | None = None
        self.look_ahead_batches = 2 * self.micro_per_step  # two steps ahead

    @property
    def order_description(self) -> str:
        """What decides the order of samples, as checkpoints record it (never the world size)."""
        if not self.shuffle:
            return "in order"
        return self.order.description if self.order is not None else "shuffled over all samples"

    def skip(self, stream_steps: list[int]) -> None:
        """Never take these stream steps (each a whole global batch) again."""
        covered = {s for first, end in self.skipped for s in range(first, end)} | set(stream_steps)
        ranges: list[tuple[int, int]] = []
        for s in sorted(covered):
            if ranges and ranges[-1][1] == s:
                ranges[-1] = (ranges[-1][0], s + 1)
            else:
                ranges.append((s, s + 1))
        self.skipped = ranges

    def stream_step(self, step: int) -> int:
        """The position in the stream of optimizer step ``step`` (1-based, as the trainer
        counts) with the skipped stretches left out: the sampler's 0-based step index."""
        position = step - 1
        for first, end in self.skipped:
            if first <= position:
                position += end - first
        return position

    def _after_skips(self, position: int) -> int:
        for first, end in self.skipped:
            if first <= position < end:
                return end
        return position

    def global_indices(self, stream_step: int) -> list[int]:
        """Every sample of a stream step, over all data-parallel ranks."""
        epoch, step_in_epoch = divmod(stream_step, self.steps_per_epoch)
        start = step_in_epoch * self.global_batch
        return self.epoch_order(epoch)[start : start + self.global_batch].tolist()

    def epoch_order(self, epoch: int) -> np.ndarray:
        if not self.shuffle:
            return np.arange(self.num_samples)
        if self.order is not None:
            return self.order(epoch)
        return np.random.default_rng([self.seed, epoch]).permutation(self.num_samples)

    def step_indices(self, step: int) -> list[list[int]]:
        """This rank's micro-batches for global optimizer step ``step``."""
        epoch, step_in_epoch = divmod(step, self.steps_per_epoch)
        order = self.epoch_order(epoch)
        return self._slice(order, step_in_epoch)

    def _slice(self, order: np.ndarray, step_in_epoch: int) -> list[list[int]]:
        per_rank = self.global_batch // self.dp_size
        start = step_in_epoch * self.global_batch + self.dp_rank * per_rank
        mine = order[start : start + per_rank]
        return [mine[i : i + self.micro_batch].tolist() for i in range(0, per_rank, self.micro_batch)]

    def __iter__(self) -> "SamplerIterator":
        return SamplerIterator(self)


class SamplerIterator:
    """Iterator over micro-batches from the sampler's ``start_step`` on."""

    def __init__(self, sampler: GlobalBatchSampler) -> None:
        self.sampler = sampler
        self.step = sampler.stream_step(sampler.start_step + 1)
        self.micro = 0
        self._epoch = -1
        self._order: np.ndarray | None = None

    def __iter__(self) -> "SamplerIterator":
        return self

    def __next__(self) -> list[int]:
        batch = self._advance()
        if self.sampler.look_ahead is not None:  # this batch too: a loader worker may read it before the rank
            self.sampler.look_ahead([batch, *self.upcoming(self.sampler.look_ahead_batches)])
        return batch

    def upcoming(self, count: int) -> list[list[int]]:
        """The next ``count`` micro-batches, without taking them."""
        ahead = copy.copy(self)
        return [ahead._advance() for _ in range(count)]

    def _advance(self) -> list[int]:
        s = self.sampler
        epoch, step_in_epoch = divmod(self.step, s.steps_per_epoch)
        if epoch != self._epoch:  # one permutation per epoch, computed once
            self._epoch, self._order = epoch, s.epoch_order(epoch)
        assert self._order is not None
        batch = s._slice(self._order, step_in_epoch)[self.micro]
        self.micro += 1
        if self.micro == s.micro_per_step:
            self.step, self.micro = s._after_skips(self.step + 1), 0
        return batch


DEFAULT_MOST_LANES = 64
"""``data.shuffle_lanes = 0`` takes the largest divisor of the global batch up to this."""


def span_lanes(configured: int, global_batch: int) -> int:
    """The lanes of a ``SpanOrder``: ``configured`` (a divisor of the global batch, checked
    with the config), or for 0 the largest divisor of the global batch up to
    ``DEFAULT_MOST_LANES``."""
    if configured:
        return configured
    return max(d for d in range(1, min(global_batch, DEFAULT_MOST_LANES) + 1) if global_batch % d == 0)


class SpanOrder:
    """The epochs of a corpus read in spans of consecutive shards, for a source that fetches
    whole shards (``meshyard.data.shard_reader``).

    Samples are grouped by the span their first token lies in: ``span_starts`` holds the
    first sample of each span (the samples are in corpus order, so every span is a range of
    them), then the number of samples. Each epoch puts the spans in a new order and the
    samples of each span in a new order, one span after another; that sequence is cut into
    ``lanes`` equal stretches, and each global batch takes the next ``global_batch / lanes``
    samples of every lane, lane after lane. So a lane reads one span (a few shards) for many
    steps before it needs another, and a rank, whose slice of every global batch is the same
    places, reads only its lanes' spans: its share of the corpus where the data-parallel
    size divides ``lanes``. The order depends on the seed, the global batch, the lanes and
    the corpus's spans only, never on the world size; samples beyond the last whole global
    batch wait for a later epoch (as with a permutation, each epoch drops a different few).
    ``description`` names the order in checkpoints, so a resume under another one is refused.
    """

    def __init__(self, span_starts: np.ndarray, global_batch: int, lanes: int, seed: int,
                 description: str = "") -> None:
        if global_batch % lanes:
            raise ValueError(f"{lanes} lanes do not divide the global batch of {global_batch}")
        bounds = np.asarray(span_starts, dtype=np.int64)
        self.span_starts = bounds[np.concatenate([np.diff(bounds) > 0, [True]])]  # empty spans left out
        self.num_samples = int(bounds[-1]) if len(bounds) else 0
        self.global_batch = global_batch
        self.lanes = lanes
        self.seed = seed
        self.description = description or f"spans of samples in {lanes} lanes"
        self._recent: dict[int, np.ndarray] = {}  # the last two epochs asked for: asked again each step

    def __call__(self, epoch: int) -> np.ndarray:
        if epoch not in self._recent:
            if len(self._recent) == 2:  # an epoch's last steps look ahead into the next
                del self._recent[min(self._recent)]
            self._recent[epoch] = self._build(epoch)
        return self._recent[epoch]

    def _build(self, epoch: int) -> np.ndarray:
        rng = np.random.default_rng([self.seed, epoch, 1])  # not the permutation's stream
        firsts, sizes = self.span_starts[:-1], np.diff(self.span_starts)
        element = np.int32 if self.num_samples < 2**31 else np.int64
        sequence = np.empty(self.num_samples, dtype=element)
        written = 0
        for span in rng.permutation(len(sizes)):  # the spans in a new order, each shuffled within
            size = int(sizes[span])
            sequence[written:written + size] = firsts[span] + rng.permutation(size)
            written += size
        steps = self.num_samples // self.global_batch
        per_lane = self.global_batch // self.lanes
        lanes = sequence[: steps * self.global_batch].reshape(self.lanes, steps, per_lane)
        return lanes.transpose(1, 0, 2).reshape(-1)  # step s: every lane's s-th run of per_lane samples


def eval_indices(num_samples: int, micro_batch: int, batches: int, dp_rank: int, dp_size: int) -> list[list[int]]:
    """Fixed evaluation micro-batches for one rank: the same samples at every evaluation."""
    out = []
    for k in range(batches):
        first = (k * dp_size + dp_rank) * micro_batch
        out.append([(first + j) % num_samples for j in range(micro_batch)])
    return out
