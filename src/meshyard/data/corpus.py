"""Token corpora as flat, memory-mapped token arrays.

Text is tokenized once into a cache file named by a hash of its inputs, written to a
temporary name and renamed into place, so concurrent ranks or an interrupted build never
leave a half-written cache behind that a later run would trust.
"""

from __future__ import annotations

import glob
import hashlib
import os
import sysconfig
import tempfile
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from meshyard.config.sections import DataConfig

BYTE_VOCAB = 256
DOCUMENT_SEPARATOR = 0  # NUL never occurs in source text, so it marks file boundaries


class DataSourceError(ValueError):
    pass


@dataclass(frozen=True)
class TokenCorpus:
    """A read-only array of token ids and the vocabulary they are drawn from."""

    tokens: np.ndarray
    vocab_size: int
    description: str


def default_cache_dir() -> Path:
    return Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "meshyard"


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


def _fingerprint(files: list[Path]) -> str:
    digest = hashlib.sha256(b"byte-v1")
    for f in files:
        stat = f.stat()
        digest.update(f"{f}\0{stat.st_size}\0{stat.st_mtime_ns}\n".encode())
    return digest.hexdigest()[:20]


def _write_atomically(path: Path, array: np.ndarray) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=path.name, suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as out:
            array.tofile(out)
            out.flush()
            os.fsync(out.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def byte_tokenize_files(files: list[Path], cache_dir: Path, label: str) -> TokenCorpus:
    """Byte-level tokens of ``files`` joined by separators, cached as a uint8 file."""
    cache = cache_dir / f"{label}-{_fingerprint(files)}.u8"
    if not cache.exists():
        chunks = []
        for f in files:
            chunks.append(np.frombuffer(f.read_bytes(), dtype=np.uint8))
            chunks.append(np.array([DOCUMENT_SEPARATOR], dtype=np.uint8))
        _write_atomically(cache, np.concatenate(chunks))
    tokens = np.memmap(cache, dtype=np.uint8, mode="r")
    return TokenCorpus(tokens, BYTE_VOCAB, f"{label}: {len(files)} files, {len(tokens):,} byte tokens ({cache})")


def load_token_files(files: list[Path], token_dtype: str) -> np.ndarray:
    arrays = []
    for f in files:
        if f.suffix == ".npy":
            arrays.append(np.load(f, mmap_mode="r").reshape(-1))
        else:
            arrays.append(np.memmap(f, dtype=np.dtype(token_dtype), mode="r"))
    return arrays[0] if len(arrays) == 1 else np.concatenate(arrays)


def load_corpus(cfg: DataConfig) -> TokenCorpus:
    """The corpus named by ``data.source`` (built-in sources only; custom datasets bypass this)."""
    cache_dir = Path(cfg.cache_dir).expanduser() if cfg.cache_dir else default_cache_dir()
    if cfg.source == "stdlib":
        corpus = byte_tokenize_files(stdlib_source_files(), cache_dir, "stdlib")
    elif cfg.source == "text":
        corpus = byte_tokenize_files(expand_paths(cfg.paths), cache_dir, "text")
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
    elif cfg.source == "random":
        vocab = cfg.vocab_size or BYTE_VOCAB
        rng = np.random.default_rng(0)
        tokens = rng.integers(0, vocab, size=cfg.random_tokens, dtype=np.int64)
        corpus = TokenCorpus(tokens, vocab, f"random: {len(tokens):,} tokens over {vocab} ids")
    else:
        raise DataSourceError(f"unknown data.source '{cfg.source}'")
    if cfg.max_tokens and len(corpus.tokens) > cfg.max_tokens:
        corpus = TokenCorpus(corpus.tokens[: cfg.max_tokens], corpus.vocab_size, corpus.description + " (truncated)")
    return corpus
