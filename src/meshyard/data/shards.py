"""The token shard format and the storage it lives on.

A prepared corpus is a folder, local or an fsspec URL (s3://, gs://, memory://):

- ``shard-00000.u16``, ``shard-00001.u16``, ...: consecutive pieces of one token stream,
  each ``shard_tokens`` ids long (the last may be shorter), as little-endian unsigned
  integers of the narrowest width the vocabulary allows (the suffix names it, as in
  the token cache);
- ``index.json``: the shards in order with their token counts and SHA-256 digests, the
  element type, the vocabulary and the tokenizer's file name (empty for bytes);
- the tokenizer beside them (``tokenizer.json``) when the text was encoded by a subword one.

The index is written last, so a reader that finds it finds every shard it names.
"""

from __future__ import annotations

import hashlib
import json
import posixpath
import uuid
from dataclasses import asdict, dataclass, field
from typing import Any

import fsspec
import numpy as np
from fsspec.implementations.local import LocalFileSystem

from meshyard.data.cache import DataSourceError, dtype_suffix

INDEX_NAME = "index.json"
ONE_REQUEST_BYTES = 16 << 20
"""Shards up to this size are read in one ranged request; larger ones through the
filesystem's whole-object read, which s3fs splits over concurrent requests (after asking
for the size, which costs more than it saves on small ones)."""
FORMAT_VERSION = 1


@dataclass(frozen=True)
class ShardEntry:
    """One shard file: its name in the folder, how many tokens it holds, its SHA-256."""

    name: str
    tokens: int
    sha256: str


@dataclass(frozen=True)
class ShardIndex:
    """What ``index.json`` says (see the module docstring)."""

    dtype: str  # numpy's name: 'uint8', 'uint16' or 'uint32', stored little-endian
    vocab_size: int
    shard_tokens: int
    tokenizer: str  # the tokenizer's file beside the shards; empty for bytes
    shards: list[ShardEntry] = field(default_factory=list)
    version: int = FORMAT_VERSION

    @property
    def total_tokens(self) -> int:
        return sum(shard.tokens for shard in self.shards)

    @property
    def element(self) -> np.dtype:
        return np.dtype(self.dtype).newbyteorder("<")

    def to_json(self) -> str:
        return json.dumps(asdict(self), indent=1) + "\n"

    @classmethod
    def from_json(cls, text: str, where: str) -> ShardIndex:
        try:
            raw = json.loads(text)
            shards = [ShardEntry(**entry) for entry in raw.pop("shards")]
            index = cls(**raw, shards=shards)
        except (ValueError, TypeError, KeyError) as exc:
            raise DataSourceError(f"{where} is no meshyard shard index ({exc}); prepare the corpus again with "
                                  "'meshyard data prepare SOURCE --out URL'") from None
        if index.version != FORMAT_VERSION:
            raise DataSourceError(f"{where} has shard format {index.version}, but this meshyard reads format "
                                  f"{FORMAT_VERSION}; prepare the corpus again with 'meshyard data prepare'")
        return index


def shard_name(number: int, dtype: np.dtype) -> str:
    return f"shard-{number:05d}{dtype_suffix(dtype)}"


def digest(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


class ShardStore:
    """A folder of shards on a local path or an fsspec URL, and the few operations on it."""

    def __init__(self, url: str, storage_options: dict[str, Any] | None = None) -> None:
        self.url = url
        self.storage_options = dict(storage_options or {})
        self.fs, self.root = fsspec.core.url_to_fs(url, **self.storage_options)
        self.is_local = isinstance(self.fs, LocalFileSystem)
        # Bytes of each shard the index read last names: a read of a small one asks for
        # exactly those, in one ranged request (``ONE_REQUEST_BYTES``).
        self.sizes: dict[str, int] = {}

    def reopened(self) -> ShardStore:
        """The same store opened anew, for another process: an fsspec filesystem made in one
        process refuses to work in a forked child (s3fs's event loop belongs to its maker)."""
        store = ShardStore(self.url, self.storage_options)
        store.sizes = dict(self.sizes)
        return store

    def path(self, name: str) -> str:
        return posixpath.join(self.root, name)

    def read(self, name: str) -> bytes:
        size = self.sizes.get(name)
        if size and size <= ONE_REQUEST_BYTES:  # bytes beyond are never read; fewer fail the digest
            return self.fs.cat_file(self.path(name), start=0, end=size)
        return self.fs.cat_file(self.path(name))

    def size(self, name: str) -> int | None:
        """The file's size, or None when it is not there."""
        try:
            return int(self.fs.info(self.path(name))["size"])
        except FileNotFoundError:
            return None

    def write(self, name: str, data: bytes) -> None:
        """Write a whole file so that readers see it complete or not at all: a local file
        under a temporary name renamed into place, an object in one PUT."""
        if not self.is_local:
            self.fs.pipe_file(self.path(name), data)
            return
        self.fs.makedirs(self.root, exist_ok=True)
        tmp = self.path(f".{name}.{uuid.uuid4().hex[:8]}.tmp")
        self.fs.pipe_file(tmp, data)
        self.fs.mv(tmp, self.path(name))

    def remove(self, name: str) -> None:
        self.fs.rm_file(self.path(name))

    def read_index(self) -> ShardIndex:
        try:
            text = self.read(INDEX_NAME).decode("utf-8")
        except FileNotFoundError:
            raise DataSourceError(f"{self.url} holds no {INDEX_NAME}: it is no prepared corpus; write one with "
                                  f"'meshyard data prepare SOURCE --out {self.url}', or fix data.url") from None
        index = ShardIndex.from_json(text, f"{self.url}/{INDEX_NAME}")
        self.sizes = {shard.name: shard.tokens * index.element.itemsize for shard in index.shards}
        return index
