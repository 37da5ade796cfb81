"""What the corpus cache stands on: where it lives, how its files are named and written,
and the error of a data source that cannot be read.

A cached file is named by a digest of its inputs and written to a temporary name, then
renamed into place, so concurrent ranks or an interrupted build never leave a half-written
file behind that a later run would trust.
"""

from __future__ import annotations

import hashlib
import os
import tempfile
from contextlib import contextmanager
from pathlib import Path
from typing import BinaryIO, Iterator

import numpy as np


class DataSourceError(ValueError):
    pass


TOKEN_DTYPES = (np.uint8, np.uint16, np.uint32)
"""Element types of cached token arrays, narrowest first; the suffix of a cache file names it."""


def default_cache_dir() -> Path:
    return Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "meshyard"


def files_fingerprint(files: list[Path], tag: str, extra: str = "") -> str:
    """20 hex digits naming ``files`` as they are now (path, size, modification time),
    what is made of them (``tag``, a version: a new one leaves older caches unused) and
    ``extra`` (other inputs; empty adds nothing, which keeps earlier names valid)."""
    digest = hashlib.sha256(tag.encode())
    for f in files:
        stat = f.stat()
        digest.update(f"{f}\0{stat.st_size}\0{stat.st_mtime_ns}\n".encode())
    if extra:
        digest.update(extra.encode())
    return digest.hexdigest()[:20]


def token_dtype(vocab_size: int) -> np.dtype:
    """The narrowest unsigned type that holds every id below ``vocab_size``."""
    for dtype in TOKEN_DTYPES:
        if vocab_size - 1 <= np.iinfo(dtype).max:
            return np.dtype(dtype)
    raise DataSourceError(f"a vocabulary of {vocab_size} ids does not fit 32-bit token ids")


def dtype_suffix(dtype: np.dtype) -> str:
    """'.u8', '.u16' or '.u32': how a token cache file says its element type."""
    return f".u{np.dtype(dtype).itemsize * 8}"


@contextmanager
def atomic_file(path: Path, make_parent: bool = True) -> Iterator[BinaryIO]:
    """A handle to write ``path`` through: the file appears, complete and synced, only
    when the block ends without an exception. Without ``make_parent``, a missing folder
    is a FileNotFoundError (a folder removed on purpose stays removed)."""
    if make_parent:
        path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=path.name, suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as out:
            yield out
            out.flush()
            os.fsync(out.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def write_atomically(path: Path, data: bytes, make_parent: bool = True) -> None:
    with atomic_file(path, make_parent) as out:
        out.write(data)
