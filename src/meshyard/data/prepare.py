"""Writing a text corpus as token shards (the format of ``meshyard.data.shards``).

The text is tokenized as a 'text' source would be (the tokenizer's parallel encoder, a
progress line, the per-machine token cache), then cut into shards. A rerun is
idempotent: a shard already there with the same size and digest in the index is left
as it is, and nothing is written when the index is unchanged.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import numpy as np

from meshyard.config.sections import DataConfig
from meshyard.data.corpus import expand_paths, text_corpus
from meshyard.data.cache import default_cache_dir
from meshyard.run_dir import RunDir
from meshyard.data.shards import INDEX_NAME, ShardEntry, ShardIndex, ShardStore, digest, shard_name

DEFAULT_SHARD_TOKENS = 1 << 24
"""Tokens per shard by default: 32 MiB of 16-bit ids, a few seconds to fetch and check."""


@dataclass(frozen=True)
class Prepared:
    """What a prepare wrote: the index, and how many shards were new or already there."""

    index: ShardIndex
    written: int
    kept: int


def prepare_shards(patterns: list[str], out: str, tokenizer: str = "bytes", shard_tokens: int = DEFAULT_SHARD_TOKENS,
                   text_field: str = "text", storage_options: dict[str, Any] | None = None,
                   cache_dir: Path | None = None, report: Callable[[str], None] = print) -> Prepared:
    """Tokenize the files of ``patterns`` with ``tokenizer`` and write them as shards of
    ``shard_tokens`` tokens under ``out`` (see the module docstring)."""
    cfg = DataConfig(source="text", paths=list(patterns), tokenizer=tokenizer, text_field=text_field)
    corpus = text_corpus(expand_paths(cfg.paths), cfg, cache_dir or default_cache_dir(), "text", report)
    store = ShardStore(out, storage_options)
    old = _existing_index(store)
    tokens = np.asarray(corpus.tokens)
    element = tokens.dtype.newbyteorder("<")
    entries, written = [], 0
    for number, start in enumerate(range(0, len(tokens), shard_tokens)):
        data = tokens[start : start + shard_tokens].astype(element, copy=False).tobytes()
        entry = ShardEntry(shard_name(number, tokens.dtype), len(data) // element.itemsize, digest(data))
        if not _already_there(store, old, entry, len(data)):
            store.write(entry.name, data)
            written += 1
        entries.append(entry)
    tokenizer_name = ""
    if corpus.tokenizer_file is not None:
        tokenizer_name = RunDir.TOKENIZER  # the name a run directory and 'meshyard serve' look for
        text = corpus.tokenizer_file.read_bytes()
        if store.size(tokenizer_name) != len(text) or store.read(tokenizer_name) != text:
            store.write(tokenizer_name, text)
    index = ShardIndex(str(tokens.dtype), corpus.vocab_size, shard_tokens, tokenizer_name, entries)
    if old is None or old.to_json() != index.to_json():
        store.write(INDEX_NAME, index.to_json().encode())  # last: readers trust the shards it names
    report(f"meshyard data: {len(entries)} shard(s) of up to {shard_tokens:,} tokens ({index.total_tokens:,} in all) "
           f"in {out}: {written} written, {len(entries) - written} already there")
    return Prepared(index, written, len(entries) - written)


def _existing_index(store: ShardStore) -> ShardIndex | None:
    if store.size(INDEX_NAME) is None:
        return None
    return ShardIndex.from_json(store.read(INDEX_NAME).decode("utf-8"), f"{store.url}/{INDEX_NAME}")


def _already_there(store: ShardStore, old: ShardIndex | None, entry: ShardEntry, size: int) -> bool:
    """Whether ``entry`` is in place: the earlier index lists it with the same digest and
    the file has its size (an interrupted earlier prepare wrote no index for its shards)."""
    listed = old is not None and entry in old.shards
    return listed and store.size(entry.name) == size
