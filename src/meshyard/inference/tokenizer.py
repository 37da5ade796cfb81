"""Text to token ids and back, for the models whose data has a known text encoding.

meshyard's built-in text sources (``data.source`` ``stdlib`` and ``text``) train on the
UTF-8 bytes of their files, one token per byte (``data.tokenizer = "bytes"``); a model
trained on them reads and writes text through ``ByteTokenizer``. With a subword tokenizer
(``bpe:N`` or a Hugging Face tokenizer) the run directory holds the ``tokenizer.json``
the text was tokenized with, and its models read and write text through that
(``TextTokenizer``); an export's sidecar embeds it. Other sources (pre-tokenized ids,
random tokens, a user's dataset) carry no encoding meshyard knows, so their models take
and return token ids only.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any, Protocol, runtime_checkable

from meshyard.config.checks import BYTES, bpe_vocab
from meshyard.config.sections import DataConfig
from meshyard.data.corpus import BYTE_VOCAB
from meshyard.data.tokenizer import TextTokenizer
from meshyard.run_dir import RunDir

log = logging.getLogger(__name__)

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
        if isinstance(ids, list):  # bytes() of an array would read its memory, of an iterator use it up
            try:
                return bytes(ids).decode("utf-8", errors="replace")
            except ValueError:  # an id that is no byte: the slow way below
                pass
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


def tokenizer_for(data: DataConfig, run_dir: Path | None = None) -> Tokenizer | None:
    """The tokenizer of a model trained on ``data`` in ``run_dir``; None when its ids have
    no text encoding meshyard knows (the model is then served on token ids only). A
    subword tokenizer is the run directory's copy, else (a checkpoint kept away from its
    run) the Hugging Face tokenizer ``data.tokenizer`` names, if it is still there."""
    if data.source not in BYTE_SOURCES:
        return None
    if data.tokenizer == BYTES:
        return ByteTokenizer()
    candidates = [RunDir(run_dir).tokenizer] if run_dir is not None else []
    if bpe_vocab(data.tokenizer) is None:  # a path
        spec = Path(data.tokenizer).expanduser()
        candidates += [spec / RunDir.TOKENIZER, spec]
    for candidate in candidates:
        if _is_file(candidate):
            return TextTokenizer.from_str(candidate.read_text())
    log.warning("the run was trained with data.tokenizer = '%s', but no %s was found beside it (looked in %s); "
                "it is served on token ids only", data.tokenizer, RunDir.TOKENIZER, run_dir or "no run directory")
    return None


def _is_file(path: Path) -> bool:
    try:
        return path.is_file()
    except OSError:  # a name too long for the file system, say
        return False


def tokenizer_record(tokenizer: Tokenizer | None) -> str | dict[str, Any] | None:
    """How an export's sidecar holds a tokenizer: "bytes", a subword tokenizer's JSON (the
    object its ``tokenizer.json`` holds), or None."""
    if isinstance(tokenizer, ByteTokenizer):
        return "bytes"
    if isinstance(tokenizer, TextTokenizer):
        return json.loads(tokenizer.to_str())
    return None


def tokenizer_from_record(record: Any) -> Tokenizer | None:
    """The tokenizer a sidecar holds (``tokenizer_record``'s inverse)."""
    if record == "bytes":
        return ByteTokenizer()
    if isinstance(record, dict):
        return TextTokenizer.from_str(json.dumps(record))
    return None
