"""Subword tokenizers of text corpora, through the Hugging Face ``tokenizers`` library.

``data.tokenizer`` names one (``resolve_tokenizer``):

- ``bpe:N``: a byte-level BPE of N tokens (GPT-2's pre-tokenizer, the 256 bytes, an
  end-of-text token and merges), trained on the corpus's documents once and cached by the
  files' digest: a second build with the same files reads it back;
- a path: a Hugging Face tokenizer, a ``tokenizer.json`` file or a folder holding one (a
  meshyard run directory is such a folder).

Either way the result is one ``tokenizer.json`` file, which the run directory copies and
the server and exports encode and decode text with. Documents end with the tokenizer's
end-of-text token; a tokenizer without one gets ``<|endoftext|>`` added, and the copy with
it is what is cached and recorded. Ids come from ``encode`` without the tokenizer's own
special tokens (a BOS or CLS), as training and serving both use them.
"""

from __future__ import annotations

import hashlib
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterable, Iterator

from meshyard.config.checks import bpe_vocab
from meshyard.data.cache import DataSourceError, write_atomically
from meshyard.extras import MissingExtra, require
from meshyard.run_dir import RunDir

EOT = "<|endoftext|>"
EOT_NAMES = (EOT, "<|end_of_text|>", "</s>", "<eos>", "<|eos|>", "<|im_end|>")
"""Names an end-of-text token goes by in published tokenizers, the first found is used."""
REPLACEMENT = "\ufffd"
PIECE_CHARS = 1 << 20
"""A document longer than this is encoded in pieces, in parallel (see ``_pieces``)."""


def tokenizers_module() -> Any:
    """The ``tokenizers`` package; its absence is bad input that names the extra to install."""
    try:
        return require("tokenizers", "data.tokenizer other than 'bytes'")
    except MissingExtra as exc:
        raise DataSourceError(str(exc)) from None


class TextTokenizer:
    """A Hugging Face tokenizer as meshyard uses it: text to ids and back, batches of
    documents encoded in parallel (the library's threads), and its end-of-text id."""

    def __init__(self, tokenizer: Any, cuts_at_lines: bool = False) -> None:
        self.tokenizer = tokenizer
        self.vocab_size = int(tokenizer.get_vocab_size(with_added_tokens=True))
        self.eot_id = next((i for name in EOT_NAMES if (i := tokenizer.token_to_id(name)) is not None), None)
        # Only for byte-level BPE (GPT-2's pre-tokenizer, no normalizer, no prefix space):
        # there ``_pieces`` cuts at pre-token boundaries, so the pieces encode to exactly
        # what the whole document does.
        self.cuts_at_lines = cuts_at_lines

    @classmethod
    def from_str(cls, text: str) -> TextTokenizer:
        return cls(tokenizers_module().Tokenizer.from_str(text))

    def to_str(self) -> str:
        return self.tokenizer.to_str()

    def encode(self, text: str) -> list[int]:
        return self.tokenizer.encode(text, add_special_tokens=False).ids

    def encode_batch(self, texts: list[str]) -> list[list[int]]:
        """Each text's ids, the texts encoded in parallel; long ones in pieces where exact."""
        if not self.cuts_at_lines:
            return [e.ids for e in self.tokenizer.encode_batch(texts, add_special_tokens=False)]
        pieces = [list(_pieces(text, PIECE_CHARS)) for text in texts]
        flat = self.tokenizer.encode_batch([p for parts in pieces for p in parts], add_special_tokens=False)
        out, at = [], 0
        for parts in pieces:
            out.append([i for e in flat[at: at + len(parts)] for i in e.ids])
            at += len(parts)
        return out

    def decode(self, ids: list[int]) -> str:
        """The text of ``ids``; an id outside the vocabulary comes out as U+FFFD (as in
        ``ByteTokenizer``), so a request never fails on what a model wrote."""
        out: list[str] = []
        run: list[int] = []
        for token in ids:
            if 0 <= token < self.vocab_size:
                run.append(token)
                continue
            out += [self.tokenizer.decode(run, skip_special_tokens=False), REPLACEMENT]
            run = []
        out.append(self.tokenizer.decode(run, skip_special_tokens=False))
        return "".join(out)

    def __repr__(self) -> str:
        return f"TextTokenizer(vocab_size={self.vocab_size})"


def _pieces(text: str, size: int) -> Iterator[str]:
    """``text`` cut before a newline that follows a character other than whitespace, about
    every ``size`` characters (a text without such a newline stays whole). With GPT-2's
    pre-tokenizer such a cut is a boundary of pre-tokens that no rule looks across: the
    token before it ends in that character, and a whitespace run starts at the newline."""
    start = 0
    while len(text) - start > size:
        cut = text.find("\n", start + size)
        while cut != -1 and text[cut - 1].isspace():
            cut = text.find("\n", cut + 1)
        if cut == -1:
            break
        yield text[start:cut]
        start = cut
    yield text[start:]


@dataclass(frozen=True)
class ResolvedTokenizer:
    """The tokenizer ``data.tokenizer`` names, and the ``tokenizer.json`` it is."""

    tokenizer: TextTokenizer
    file: Path
    digest: str  # of the file's contents: it names the token caches built with it
    description: str


def resolve_tokenizer(spec: str, documents: Callable[[], Iterable[str]], fingerprint: str,
                      cache_dir: Path, report: Callable[[str], None] = print) -> ResolvedTokenizer:
    """The tokenizer of ``spec`` ('bpe:N' or a path, see the module docstring). A BPE is
    trained on ``documents()`` unless ``cache_dir`` holds one for the files' ``fingerprint``."""
    size = bpe_vocab(spec)
    if size is not None:
        file = cache_dir / f"bpe{size}-{fingerprint}.json"
        if not file.exists():
            write_atomically(file, train_bpe(documents(), size, report).encode())
        return _resolved(file, file.read_text(), f"bpe:{size}", cuts_at_lines=True)
    return _published(Path(spec).expanduser(), spec, cache_dir)


def train_bpe(documents: Iterable[str], size: int, report: Callable[[str], None] = print) -> str:
    """A byte-level BPE of at most ``size`` tokens trained on ``documents``, as JSON.
    Fewer come out when the text offers fewer merges."""
    tk = tokenizers_module()
    tokenizer = tk.Tokenizer(tk.models.BPE())
    tokenizer.pre_tokenizer = tk.pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = tk.decoders.ByteLevel()
    trainer = tk.trainers.BpeTrainer(vocab_size=size, special_tokens=[EOT], show_progress=False,
                                     initial_alphabet=tk.pre_tokenizers.ByteLevel.alphabet())
    began = time.perf_counter()
    tokenizer.train_from_iterator(documents, trainer)
    report(f"meshyard: trained a byte-level BPE of {tokenizer.get_vocab_size()} tokens in "
           f"{time.perf_counter() - began:.1f} s")
    return tokenizer.to_str()


def _published(path: Path, spec: str, cache_dir: Path) -> ResolvedTokenizer:
    """A tokenizer file (or a folder's ``tokenizer.json``); one without an end-of-text
    token is cached with ``<|endoftext|>`` added, and that copy is the one used."""
    try:
        file = path / RunDir.TOKENIZER if path.is_dir() else path
        found = file.is_file()
    except OSError:  # a name too long for the file system, say
        found = False
    if not found:
        raise DataSourceError(f"data.tokenizer = '{spec}' is not 'bytes', 'bpe:N', a {RunDir.TOKENIZER} file or a "
                              f"folder holding one; check the path")
    try:
        text = file.read_text()
        tokenizer = TextTokenizer.from_str(text)
    except Exception as exc:  # OSError, or the library's own (a plain Exception) for a file it cannot read
        raise DataSourceError(f"data.tokenizer = '{spec}': {file} is not a Hugging Face tokenizer ({exc})") from None
    if tokenizer.eot_id is None:
        tokenizer.tokenizer.add_special_tokens([EOT])
        text = tokenizer.to_str()
        file = cache_dir / f"tokenizer-{_digest(text)}.json"
        if not file.exists():
            write_atomically(file, text.encode())
    return _resolved(file, text, f"tokenizer {spec}")


def _resolved(file: Path, text: str, description: str, cuts_at_lines: bool = False) -> ResolvedTokenizer:
    tokenizer = TextTokenizer(tokenizers_module().Tokenizer.from_str(text), cuts_at_lines=cuts_at_lines)
    if tokenizer.eot_id is None:  # a cached file edited by hand
        raise DataSourceError(f"{file} has no end-of-text token ({EOT}); delete it to build it again")
    return ResolvedTokenizer(tokenizer, file, _digest(text), description)


def _digest(text: str) -> str:
    return hashlib.sha256(text.encode()).hexdigest()[:20]
