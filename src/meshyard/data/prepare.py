"""Writing a text corpus as token shards (the format of ``meshyard.data.shards``).

The text is tokenized as a 'text' source would be (the tokenizer's parallel encoder, a
progress line, the per-machine token cache), then cut into shards. A rerun is
idempotent: a shard file already there is read back and left as it is when its bytes
are the shard's (same size and SHA-256; a name and a size alone prove nothing of a file
damaged in place or left by an interrupted or different prepare), and the index is
written only when it changed. The index goes last, so a reader never finds an index
naming a shard not yet written; shards the earlier index named and the new one does not
are removed after it.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import numpy as np

from meshyard.config.sections import DataConfig
from meshyard.data.corpus import expand_paths, text_corpus
from meshyard.data.cache import DataSourceError, default_cache_dir
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
    old = _existing_index(store, report)
    tokens = np.asarray(corpus.tokens)
    element = tokens.dtype.newbyteorder("<")
    entries, written = [], 0
    for number, start in enumerate(range(0, len(tokens), shard_tokens)):
        data = tokens[start : start + shard_tokens].astype(element, copy=False).tobytes()
        entry = ShardEntry(shard_name(number, tokens.dtype), len(data) // element.itemsize, digest(data))
        if not _already_there(store, entry, data):
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
    _remove_unlisted(store, old, index)
    report(f"meshyard data: {len(entries)} shard(s) of up to {shard_tokens:,} tokens ({index.total_tokens:,} in all) "
           f"in {out}: {written} written, {len(entries) - written} already there")
    return Prepared(index, written, len(entries) - written)


def _existing_index(store: ShardStore, report: Callable[[str], None]) -> ShardIndex | None:
    """The index an earlier prepare left, if any; one that cannot be read is replaced."""
    if store.size(INDEX_NAME) is None:
        return None
    try:
        return ShardIndex.from_json(store.read(INDEX_NAME).decode("utf-8", errors="replace"),
                                    f"{store.url}/{INDEX_NAME}")
    except DataSourceError as exc:
        report(f"meshyard data: replacing {store.url}/{INDEX_NAME}: {exc}")
        return None


def _already_there(store: ShardStore, entry: ShardEntry, data: bytes) -> bool:
    """Whether the file ``entry`` names holds ``data`` already (see the module docstring):
    its size first, which costs no read, then the digest of its bytes read back."""
    return store.size(entry.name) == len(data) and digest(store.read(entry.name)) == entry.sha256


def _remove_unlisted(store: ShardStore, old: ShardIndex | None, index: ShardIndex) -> None:
    """Remove the shards ``old`` named that ``index`` does not (a corpus that shrank, or
    another element type): after the new index, so that no index names a missing shard."""
    if old is None:
        return
    kept = {entry.name for entry in index.shards}
    for entry in old.shards:
        if entry.name not in kept and store.size(entry.name) is not None:
            store.remove(entry.name)
