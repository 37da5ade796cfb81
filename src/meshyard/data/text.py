"""Text files to a cached array of token ids: their documents, how documents become ids
(``Encoding``), and the build of the cache file, with a progress line and its speed.

A ``.jsonl`` file holds one document per record (the record's ``data.text_field``); any
other file is one document. Every document is followed by the encoding's end-of-text id
(NUL for bytes: it never occurs in source text), so a model learns where documents end
and generation can stop there. Ids are stored in the narrowest unsigned type the
vocabulary allows (``cache.token_dtype``).
"""

from __future__ import annotations

import json
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterable, Iterator, Sequence

import numpy as np

from meshyard.data.cache import DataSourceError, atomic_file, token_dtype
from meshyard.data.tokenizer import TextTokenizer

BYTE_VOCAB = 256
DOCUMENT_SEPARATOR = 0  # NUL never occurs in source text, so it marks document boundaries
JSONL_SUFFIX = ".jsonl"
BATCH_BYTES = 8 << 20
"""Text encoded per batch: the tokenizer's threads share a batch, and memory holds one."""


@dataclass(frozen=True)
class Encoding:
    """How documents (UTF-8 bytes) become ids: ``encode`` takes a batch of them."""

    encode: Callable[[list[bytes]], list[Sequence[int]]]
    eot_id: int
    vocab_size: int
    name: str  # for messages: 'bytes', 'bpe:N', 'tokenizer PATH'


def _bytes_of(documents: list[bytes]) -> list[Sequence[int]]:
    return [np.frombuffer(document, dtype=np.uint8) for document in documents]


BYTE_ENCODING = Encoding(_bytes_of, DOCUMENT_SEPARATOR, BYTE_VOCAB, "bytes")


def tokenizer_encoding(tokenizer: TextTokenizer, name: str) -> Encoding:
    """Documents through a subword tokenizer, a batch at a time in its parallel encoder;
    bytes that are not UTF-8 become U+FFFD."""
    assert tokenizer.eot_id is not None, "resolve_tokenizer gives tokenizers with an end-of-text token"

    def encode(documents: list[bytes]) -> list[Sequence[int]]:
        return tokenizer.encode_batch([d.decode("utf-8", errors="replace") for d in documents])

    return Encoding(encode, tokenizer.eot_id, tokenizer.vocab_size, name)


def documents(files: list[Path], text_field: str) -> Iterator[bytes]:
    """Each document's bytes, in file order (see the module docstring)."""
    for path in files:
        if path.suffix == JSONL_SUFFIX:
            yield from _records(path, text_field)
        else:
            yield path.read_bytes()


def _records(path: Path, text_field: str) -> Iterator[bytes]:
    """The text of each record of a JSON Lines file, UTF-8 encoded; blank lines are skipped."""
    with path.open("rb") as lines:
        for number, line in enumerate(lines, 1):
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except ValueError as exc:
                raise DataSourceError(f"{path}, line {number}: not a JSON record ({exc})") from None
            text = record.get(text_field) if isinstance(record, dict) else None
            if not isinstance(text, str):
                raise DataSourceError(f"{path}, line {number}: no text in field '{text_field}' (data.text_field); "
                                      f"the record's fields: {', '.join(record) if isinstance(record, dict) else '-'}")
            yield text.encode("utf-8")


def _batches(items: Iterable[bytes], limit: int) -> Iterator[list[bytes]]:
    batch: list[bytes] = []
    size = 0
    for item in items:
        batch.append(item)
        size += len(item)
        if size >= limit:
            yield batch
            batch, size = [], 0
    if batch:
        yield batch


def build_token_cache(cache: Path, files: list[Path], text_field: str, encoding: Encoding,
                      report: Callable[[str], None] = print) -> None:
    """Encode every document of ``files`` into ``cache`` (written atomically), each followed
    by the end-of-text id; a progress line on a terminal, and one line with the speed."""
    dtype = token_dtype(encoding.vocab_size)
    total = max(1, sum(f.stat().st_size for f in files))
    began, seen, tokens, count = time.perf_counter(), 0, 0, 0
    end = np.array([encoding.eot_id], dtype=dtype)
    with atomic_file(cache) as out:
        for batch in _batches(documents(files, text_field), BATCH_BYTES):
            parts = [part for ids in encoding.encode(batch) for part in (np.asarray(ids, dtype=dtype), end)]
            chunk = np.concatenate(parts)
            chunk.tofile(out)
            seen, tokens, count = seen + sum(map(len, batch)), tokens + len(chunk), count + len(batch)
            _progress(f"tokenizing {len(files)} file(s) with {encoding.name}: {min(100, 100 * seen // total)}%, "
                      f"{tokens:,} tokens")
    seconds = max(time.perf_counter() - began, 1e-9)
    _progress("")
    report(f"meshyard: tokenized {count:,} documents of {len(files)} file(s) with {encoding.name}: {tokens:,} tokens "
           f"in {seconds:.1f} s ({tokens / seconds:,.0f} tokens/s), cached in {cache}")


def _progress(line: str) -> None:
    """Overwrite the terminal's current line (nothing when stdout is no terminal)."""
    if sys.stdout.isatty():
        sys.stdout.write(f"\r\033[K{line}" if line else "\r\033[K")
        sys.stdout.flush()
