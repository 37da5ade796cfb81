"""Token corpora as flat, memory-mapped token arrays.

Text is tokenized once into a cache file named by a digest of its inputs (``meshyard.data.cache``):
the files as they are, the tokenizer and a format version. Byte-level text of files
without ``.jsonl`` ones keeps the names caches had before subword tokenizers and
``.jsonl`` documents came (a ``.jsonl`` file adds ``data.text_field`` to the digest), so
those caches stay valid; a subword cache also names the digest of its tokenizer.
"""

from __future__ import annotations

import glob
import os
import sysconfig
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterator

import numpy as np

from meshyard.config.checks import BYTES
from meshyard.config.sections import DataConfig
from meshyard.data.cache import (DataSourceError, default_cache_dir, dtype_suffix, files_fingerprint, token_dtype,
                                 write_atomically)
from meshyard.data.shard_reader import ShardedTokens, open_shards
from meshyard.data.text import (BYTE_ENCODING, BYTE_VOCAB, DOCUMENT_SEPARATOR, JSONL_SUFFIX, Encoding,
                                build_token_cache, documents, tokenizer_encoding)
from meshyard.data.tokenizer import ResolvedTokenizer, resolve_tokenizer

__all__ = ["BYTE_VOCAB", "DOCUMENT_SEPARATOR", "DataSourceError", "TokenCorpus", "default_cache_dir", "load_corpus"]


@dataclass(frozen=True)
class TokenCorpus:
    """A read-only array of token ids and the vocabulary they are drawn from; for text
    tokenized by a subword tokenizer, its ``tokenizer.json`` (what the run directory copies)."""

    tokens: np.ndarray
    vocab_size: int
    description: str
    tokenizer_file: Path | None = None


def expand_paths(patterns: list[str]) -> list[Path]:
    """Files matching each pattern, in sorted order; a pattern matching nothing is an error."""
    files: list[Path] = []
    for pattern in patterns:
        matches = sorted(glob.glob(os.path.expanduser(pattern), recursive=True))
        matches = [m for m in matches if os.path.isfile(m)]
        if not matches:
            raise DataSourceError(f"data.paths entry '{pattern}' matches no file; check the path or glob")
        files.extend(Path(m) for m in matches)
    return files


def stdlib_source_files() -> list[Path]:
    """The ``.py`` files of the running interpreter's standard library (tests and site-packages excluded)."""
    root = Path(sysconfig.get_paths()["stdlib"])
    skip = {"site-packages", "dist-packages", "test", "tests", "idlelib", "__pycache__"}
    files = [p for p in root.rglob("*.py") if not skip.intersection(p.relative_to(root).parts)]
    if not files:
        raise DataSourceError(f"no standard-library sources found under {root}; use data.source = 'random' or 'text'")
    return sorted(files)


def text_corpus(files: list[Path], cfg: DataConfig, cache_dir: Path, label: str,
                report: Callable[[str], None] = print) -> TokenCorpus:
    """The documents of ``files`` tokenized as ``data.tokenizer`` says, from the cache
    (built first when missing: see the module docstring for its name)."""
    extra = f"jsonl:{cfg.text_field}" if any(f.suffix == JSONL_SUFFIX for f in files) else ""
    encoding, tokenizer_file, tag, key = BYTE_ENCODING, None, "byte-v1", extra
    if cfg.tokenizer != BYTES:
        resolved = _subword_tokenizer(files, cfg, cache_dir, extra, report)
        encoding, tokenizer_file = tokenizer_encoding(resolved.tokenizer, resolved.description), resolved.file
        tag, key = "tokens-v1", f"{extra}\0{resolved.digest}"
    dtype = token_dtype(encoding.vocab_size)
    cache = cache_dir / f"{label}-{files_fingerprint(files, tag, key)}{dtype_suffix(dtype)}"
    if not cache.exists():
        build_token_cache(cache, files, cfg.text_field, encoding, report)
    tokens = np.memmap(cache, dtype=dtype, mode="r")
    return TokenCorpus(tokens, encoding.vocab_size, _described(label, files, tokens, encoding, cache), tokenizer_file)


def _subword_tokenizer(files: list[Path], cfg: DataConfig, cache_dir: Path, extra: str,
                       report: Callable[[str], None]) -> ResolvedTokenizer:
    """``data.tokenizer``'s tokenizer; a BPE to train learns from the documents of ``files``."""
    def texts() -> Iterator[str]:
        return (document.decode("utf-8", errors="replace") for document in documents(files, cfg.text_field))

    return resolve_tokenizer(cfg.tokenizer, texts, files_fingerprint(files, "bpe-v1", extra), cache_dir, report)


def _described(label: str, files: list[Path], tokens: np.ndarray, encoding: Encoding, cache: Path) -> str:
    what = "byte tokens" if encoding is BYTE_ENCODING else f"tokens of {encoding.name} ({encoding.vocab_size} ids)"
    return f"{label}: {len(files)} files, {len(tokens):,} {what} ({cache})"


def load_token_files(files: list[Path], token_dtype: str) -> np.ndarray:
    arrays = []
    for f in files:
        if f.suffix == ".npy":
            arrays.append(np.load(f, mmap_mode="r").reshape(-1))
        else:
            arrays.append(np.memmap(f, dtype=np.dtype(token_dtype), mode="r"))
    return arrays[0] if len(arrays) == 1 else np.concatenate(arrays)


def shard_corpus(cfg: DataConfig, cache_dir: Path) -> TokenCorpus:
    """The prepared corpus at ``data.url``, read through a local shard cache (``shard_reader``)."""
    tokens = open_shards(cfg.url, cfg.storage_options, cache_dir, cfg.cache_bytes)
    index = tokens.cache.index
    tokenizer_file = None
    if index.tokenizer:  # the run directory copies it, so fetch it beside the cached shards
        tokenizer_file = tokens.cache.folder.parent / index.tokenizer
        write_atomically(tokenizer_file, tokens.cache.store.read(index.tokenizer))
    return TokenCorpus(tokens, index.vocab_size,  # type: ignore[arg-type]  # array-like, see ShardedTokens
                       f"shards: {len(index.shards)} of {cfg.url}, {len(tokens):,} tokens", tokenizer_file)


def load_corpus(cfg: DataConfig) -> TokenCorpus:
    """The corpus named by ``data.source`` (built-in sources only; custom datasets bypass this)."""
    cache_dir = Path(cfg.cache_dir).expanduser() if cfg.cache_dir else default_cache_dir()
    if cfg.source == "stdlib":
        corpus = text_corpus(stdlib_source_files(), cfg, cache_dir, "stdlib")
    elif cfg.source == "text":
        corpus = text_corpus(expand_paths(cfg.paths), cfg, cache_dir, "text")
    elif cfg.source == "tokens":
        tokens = load_token_files(expand_paths(cfg.paths), cfg.token_dtype)
        if tokens.size == 0:
            raise DataSourceError(f"token files {cfg.paths} are empty")
        top = int(tokens.max())
        vocab = cfg.vocab_size or top + 1
        if top >= vocab or int(tokens.min()) < 0:
            raise DataSourceError(
                f"token ids range over [{int(tokens.min())}, {top}] but data.vocab_size = {vocab}; "
                "raise data.vocab_size or check data.token_dtype"
            )
        corpus = TokenCorpus(tokens, vocab, f"tokens: {len(tokens):,} from {len(cfg.paths)} pattern(s)")
    elif cfg.source == "shards":
        corpus = shard_corpus(cfg, cache_dir)
    elif cfg.source == "random":
        vocab = cfg.vocab_size or BYTE_VOCAB
        rng = np.random.default_rng(0)
        tokens = rng.integers(0, vocab, size=cfg.random_tokens, dtype=np.int64)
        corpus = TokenCorpus(tokens, vocab, f"random: {len(tokens):,} tokens over {vocab} ids")
    else:
        raise DataSourceError(f"unknown data.source '{cfg.source}'")
    if cfg.max_tokens and len(corpus.tokens) > cfg.max_tokens:
        head = corpus.tokens[: cfg.max_tokens] if not isinstance(corpus.tokens, ShardedTokens) else \
            corpus.tokens.head(cfg.max_tokens)  # shards: no download of what is cut off
        corpus = TokenCorpus(head, corpus.vocab_size, corpus.description + " (truncated)",
                             corpus.tokenizer_file)
    return corpus
