"""Datasets and the sharded, resumable loaders the Trainer consumes.

The loader needs no state of its own: the batch sampler indexes samples by global step,
so a resume only tells it the step to start at (``DataBundle.seek``).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Iterator, NamedTuple

import numpy as np
import torch
from torch.utils.data import DataLoader, Dataset

from meshyard.config.sections import DataConfig
from meshyard.data.corpus import DataSourceError, load_corpus
from meshyard.data.sampling import GlobalBatchSampler, SpanOrder, eval_indices, span_lanes
from meshyard.data.shard_reader import ShardedTokens
from meshyard.plugins import call_with_accepted, is_custom_reference, load_callable


class TokenWindows(Dataset):
    """Non-overlapping windows of ``seq_len + 1`` tokens: (input, next-token target) pairs."""

    def __init__(self, tokens: np.ndarray, seq_len: int, first: int, count: int) -> None:
        self.tokens = tokens
        self.seq_len = seq_len
        self.first = first
        self.count = count

    def __len__(self) -> int:
        return self.count

    def __getitem__(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        start = (self.first + index) * self.seq_len
        window = torch.from_numpy(np.asarray(self.tokens[start : start + self.seq_len + 1], dtype=np.int64))
        return window[:-1], window[1:]

    def fetch_ahead(self, batches: list[list[int]]) -> None:
        """Let a source that fetches ahead of need (token shards) start on these batches'
        windows: their first and last tokens name every shard they touch."""
        starts = (self.first + np.asarray([i for batch in batches for i in batch], dtype=np.int64)) * self.seq_len
        # Each window's first and last token side by side: what is needed first is named first,
        # and the fetches ahead stop at a cap.
        self.tokens.prefetch(np.stack([starts, starts + self.seq_len], axis=1))

    def span_order(self, span_shards: int, global_batch: int, lanes: int, seed: int) -> SpanOrder | None:
        """The order that reads token shards ``span_shards`` at a time in ``lanes`` lanes
        (``SpanOrder``), or None where the tokens are no shards (or ``span_shards`` is 0:
        shuffle over all). A span's samples are those whose first token lies in its shards."""
        if not isinstance(self.tokens, ShardedTokens) or span_shards <= 0:
            return None
        span_tokens = self.tokens.starts[::span_shards]  # each span's first token, then maybe the end
        # The first sample starting at or after each: ceil(token / seq_len), counted from ``first``.
        firsts = np.clip(-(-span_tokens // self.seq_len) - self.first, 0, self.count)
        starts = np.unique(np.concatenate([[0], firsts, [self.count]]))
        return SpanOrder(starts, global_batch, lanes, seed,
                         f"token shards in spans of {span_shards} shard(s), {lanes} lane(s)")

    def __getitems__(self, indices: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
        """A whole micro-batch in one gather: what the loader fetches instead of one window
        at a time and a collate (``collate_batch`` passes it through). The same tensors as
        stacking ``self[i]`` for each index."""
        starts = (self.first + np.asarray(indices, dtype=np.int64)) * self.seq_len
        windows = torch.from_numpy(np.asarray(self.tokens[starts[:, None] + np.arange(self.seq_len + 1)],
                                              dtype=np.int64))
        return windows[:, :-1].contiguous(), windows[:, 1:].contiguous()


def collate_batch(batch: tuple[torch.Tensor, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    """The loader's collate for ``TokenWindows``, whose batched fetch is already a batch."""
    return batch


@dataclass
class DataBundle:
    """What a run needs from its data: the training loader and evaluation batches."""

    train_loader: DataLoader
    val_dataset: Dataset | None
    vocab_size: int
    description: str
    train_samples: int
    tokenizer_file: Path | None = None  # see ``Splits``
    warnings: tuple[str, ...] = ()  # for the log and the console, once

    @property
    def sampler(self) -> GlobalBatchSampler:
        return self.train_loader.batch_sampler

    def seek(self, step: int) -> None:
        """Make the next iterator over ``train_loader`` start after global step ``step``."""
        self.sampler.start_step = step

    def close(self) -> None:
        """Give back what the data holds outside this process's memory: a shard source's
        local cache folder (loader workers keep theirs inside it)."""
        tokens = getattr(self.train_loader.dataset, "tokens", None)
        if isinstance(tokens, ShardedTokens):
            tokens.close()

    def eval_batches(self, micro_batch: int, batches: int, dp_rank: int, dp_size: int) -> Iterator:
        if self.val_dataset is None:
            return iter(())
        collate = torch.utils.data.default_collate
        indices = eval_indices(len(self.val_dataset), micro_batch, batches, dp_rank, dp_size)
        return (collate([self.val_dataset[i] for i in batch]) for batch in indices)


class Splits(NamedTuple):
    """A built-in corpus cut into training and held-out windows."""

    train: TokenWindows
    held_out: TokenWindows | None
    vocab_size: int
    description: str
    tokenizer_file: Path | None  # the subword tokenizer of text, which the run directory copies


def split_corpus(cfg: DataConfig) -> Splits:
    corpus = load_corpus(cfg)
    windows = (len(corpus.tokens) - 1) // cfg.seq_len
    val = int(windows * cfg.val_fraction) if cfg.val_fraction > 0 else 0
    if cfg.val_fraction > 0:
        val = max(val, 1)
    if windows - val < 1:
        raise DataSourceError(
            f"{corpus.description} holds {windows} samples of {cfg.seq_len} tokens: too few to train; "
            "use more data or a shorter data.seq_len"
        )
    train = TokenWindows(corpus.tokens, cfg.seq_len, 0, windows - val)
    held_out = TokenWindows(corpus.tokens, cfg.seq_len, windows - val, val) if val else None
    return Splits(train, held_out, corpus.vocab_size, corpus.description, corpus.tokenizer_file)


def custom_datasets(cfg: DataConfig) -> tuple[Dataset, Dataset | None, int, str]:
    """A user's builder, called once per split with the keywords it accepts (split, seq_len, config)."""
    builder = load_callable(cfg.source)
    train = call_with_accepted(builder, {"split": "train", "seq_len": cfg.seq_len, "config": cfg}, {})
    val = call_with_accepted(builder, {"split": "val", "seq_len": cfg.seq_len, "config": cfg}, {})
    vocab = cfg.vocab_size or int(getattr(train, "vocab_size", 0))
    return train, val, vocab, f"custom dataset {cfg.source}: {len(train):,} training samples"


def pins_memory(device: torch.device | None) -> bool:
    """Whether batches bound for ``device`` are collated into page-locked memory: only for
    CUDA, where it lets the trainer's non-blocking host-to-device copies overlap compute
    (from pageable memory such a copy is synchronous); elsewhere pinning only costs."""
    return device is not None and device.type == "cuda"


def build_data(
    cfg: DataConfig, global_batch: int, micro_batch: int, dp_rank: int, dp_size: int, seed: int,
    device: torch.device | None = None,
) -> DataBundle:
    """The training loader for one data-parallel rank and the held-out split; batches for a
    CUDA ``device`` come in pinned memory."""
    tokenizer_file = None
    if is_custom_reference(cfg.source):
        train, val, vocab, description = custom_datasets(cfg)
    else:
        train, val, vocab, description, tokenizer_file = split_corpus(cfg)
    order = None
    if isinstance(train, TokenWindows):
        order = train.span_order(cfg.shuffle_span_shards, global_batch, span_lanes(cfg.shuffle_lanes, global_batch),
                                 seed)
    sampler = GlobalBatchSampler(len(train), global_batch, micro_batch, dp_rank, dp_size, seed, order=order)
    warnings = (cache_warning(train.tokens, cfg, -(-order.lanes // dp_size)),) if order is not None else ()
    extra = {"prefetch_factor": cfg.prefetch_factor, "persistent_workers": True} if cfg.num_workers else {}
    # A private generator: creating a loader iterator draws a seed from it, and drawing
    # from the global RNG instead would shift dropout masks after a resume.
    generator = torch.Generator().manual_seed(seed + dp_rank)
    if isinstance(train, TokenWindows):
        extra["collate_fn"] = collate_batch
        if hasattr(train.tokens, "prefetch"):  # loader workers read what the rank fetches ahead
            sampler.look_ahead = train.fetch_ahead
    loader = DataLoader(train, batch_sampler=sampler, num_workers=cfg.num_workers, generator=generator,
                        pin_memory=pins_memory(device), **extra)
    return DataBundle(loader, val, vocab, description, len(train), tokenizer_file,
                      tuple(w for w in warnings if w))


def cache_warning(tokens: ShardedTokens, cfg: DataConfig, lanes: int) -> str:
    """Why this rank's shard cache will fetch shards again and again, or "" when it holds what
    the rank reads at once: for each of its lanes a span and the shards after it that the
    span's last sample ends in, and one lane's worth more, fetched ahead of the next span; or
    the whole corpus, where that is less."""
    smallest = max(1, min(s.tokens for s in tokens.shards))
    beyond = -(-(cfg.seq_len + 1) // smallest)  # shards a sample starting in a span's last one reaches into
    needed = min((lanes + 1) * (cfg.shuffle_span_shards + beyond), len(tokens.shards))
    if tokens.cache.capacity >= needed:
        return ""
    shard_bytes = max(s.tokens for s in tokens.shards) * tokens.dtype.itemsize
    return (f"data.cache_bytes = {cfg.cache_bytes} holds {tokens.cache.capacity} shard(s) of {tokens.cache.store.url}, "
            f"but this rank reads {lanes} lane(s) of the global batch at once, each a span of "
            f"{cfg.shuffle_span_shards} shard(s) (data.shuffle_span_shards) and the shard(s) after it, and fetches ahead: "
            f"shards will be fetched again and again. Raise data.cache_bytes to {needed * shard_bytes}, or lower "
            "data.shuffle_lanes or data.shuffle_span_shards")
