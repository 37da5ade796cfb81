"""Text to token ids and back, for the models whose data has a known text encoding.

meshyard's built-in text sources (``data.source`` ``stdlib`` and ``text``) train on the
UTF-8 bytes of their files, one token per byte; a model trained on them reads and writes
text through ``ByteTokenizer``. Other sources (pre-tokenized ids, random tokens, a user's
dataset) carry no encoding meshyard knows, so their models take and return token ids only.
"""

from __future__ import annotations

from typing import Protocol, runtime_checkable

from meshyard.config.sections import DataConfig
from meshyard.data.corpus import BYTE_VOCAB

BYTE_SOURCES = ("stdlib", "text")


@runtime_checkable
class Tokenizer(Protocol):
    """Encodes a prompt to ids and decodes generated ids to text."""

    vocab_size: int

    def encode(self, text: str) -> list[int]: ...

    def decode(self, ids: list[int]) -> str: ...


class ByteTokenizer:
    """One token per UTF-8 byte (ids 0-255), as the built-in text sources tokenize."""

    vocab_size = BYTE_VOCAB

    def encode(self, text: str) -> list[int]:
        """The UTF-8 bytes of ``text``."""
        return list(text.encode("utf-8"))

    def decode(self, ids: list[int]) -> str:
        """The text of ``ids``. A completion may stop inside a multi-byte character, and a
        model with a vocabulary wider than 256 may emit an id that is no byte: both come out
        as U+FFFD rather than an error, so a request never fails on what the model wrote."""
        out: list[str] = []
        run: list[int] = []
        for token in ids:
            if 0 <= token < BYTE_VOCAB:
                run.append(token)
                continue
            out.append(bytes(run).decode("utf-8", errors="replace"))
            out.append("\ufffd")
            run = []
        out.append(bytes(run).decode("utf-8", errors="replace"))
        return "".join(out)

    def __repr__(self) -> str:
        return "ByteTokenizer()"


def tokenizer_for(data: DataConfig) -> Tokenizer | None:
    """The tokenizer of a model trained on ``data``; None when its ids have no text
    encoding meshyard knows (the model is then served on token ids only)."""
    if data.source in BYTE_SOURCES:
        return ByteTokenizer()
    return None
