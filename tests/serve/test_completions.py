"""``TextStream``: a completion's text given out as its tokens come, whatever the tokenizer."""

from __future__ import annotations

import random

import pytest

from meshyard.data.tokenizer import TextTokenizer, train_bpe, tokenizers_module
from meshyard.inference.tokenizer import ByteTokenizer
from meshyard.serve.completions import TextStream

TEXT = ("Grüße aus Köln: the naïve café served crème brûlée at 12:30 — ünïcödé, ✓, 猫 and 🐍.\n"
        "def add(a, b):\n    return a + b\n") * 3


def streamed(stream: TextStream, tokens: list[int], rng: random.Random) -> tuple[list[str], str]:
    """``tokens`` added in random steps of 1-4: the deltas, then what ``end`` gives."""
    deltas, at = [], 0
    while at < len(tokens) and stream.finish is None:
        size = rng.randint(1, 4)
        deltas.append(stream.add(tokens[at:at + size]))
        at += size
    return deltas, stream.end() if stream.finish is None else ""


def metaspace_bpe() -> TextTokenizer:
    """A SentencePiece-like tokenizer (spaces as "▁", a word's leading space rendered by what
    precedes it), the kind that decodes a token differently at a sequence's start."""
    tk = tokenizers_module()
    tokenizer = tk.Tokenizer(tk.models.BPE(unk_token="<unk>"))
    tokenizer.pre_tokenizer = tk.pre_tokenizers.Metaspace()
    tokenizer.decoder = tk.decoders.Metaspace()
    tokenizer.train_from_iterator([TEXT] * 4, tk.trainers.BpeTrainer(vocab_size=300, special_tokens=["<unk>"],
                                                                      show_progress=False))
    return TextTokenizer.from_str(tokenizer.to_str())


def llama_like_bpe() -> TextTokenizer:
    """Spaces as "▁" and byte fallback: a character outside the vocabulary is its UTF-8 bytes
    as tokens <0x..>, and "\n" is the token <0x0A>. Its decoder turns a whole run of byte
    tokens that is not valid UTF-8 into U+FFFD, the newline before a stray byte included."""
    tk = tokenizers_module()
    tokenizer = tk.Tokenizer(tk.models.BPE(unk_token="<unk>", byte_fallback=True))
    tokenizer.normalizer = tk.normalizers.Sequence([tk.normalizers.Prepend("▁"), tk.normalizers.Replace(" ", "▁")])
    trainer = tk.trainers.BpeTrainer(vocab_size=320, limit_alphabet=40, show_progress=False,
                                     special_tokens=["<unk>", *(f"<0x{i:02X}>" for i in range(256))])
    tokenizer.train_from_iterator([TEXT] * 4, trainer)
    tokenizer.decoder = tk.decoders.Sequence([tk.decoders.Replace("▁", " "), tk.decoders.ByteFallback(),
                                              tk.decoders.Fuse(), tk.decoders.Strip(" ", 1, 0)])
    return TextTokenizer.from_str(tokenizer.to_str())


@pytest.fixture(scope="module")
def tokenizers() -> dict[str, object]:
    return {"bytes": ByteTokenizer(), "byte-level BPE": TextTokenizer.from_str(train_bpe([TEXT] * 4, 300,
                                                                                          report=lambda _: None)),
            "metaspace BPE": metaspace_bpe(), "llama-like BPE": llama_like_bpe()}


@pytest.mark.parametrize("kind", ["bytes", "byte-level BPE", "metaspace BPE", "llama-like BPE"])
@pytest.mark.parametrize("seed", range(5))
def test_the_deltas_add_up_to_the_whole_text_whatever_the_steps(tokenizers, kind, seed):
    tokenizer = tokenizers[kind]
    tokens = tokenizer.encode(TEXT)
    whole = tokenizer.decode(tokens)
    deltas, rest = streamed(TextStream(tokenizer, []), tokens, random.Random(seed))
    assert "".join(deltas) + rest == whole
    assert not any("\ufffd" in delta for delta in deltas)  # a character is given out whole or not yet


@pytest.mark.parametrize("kind", ["bytes", "byte-level BPE", "metaspace BPE"])
@pytest.mark.parametrize("stop", ["crème", "a + b", "🐍.", "\n    return"])
def test_a_stop_string_ends_the_text_before_it_even_across_steps(tokenizers, kind, stop):
    tokenizer = tokenizers[kind]
    for seed in range(3):
        stream = TextStream(tokenizer, ["never there", stop])
        deltas, rest = streamed(stream, tokenizer.encode(TEXT), random.Random(seed))
        whole = tokenizer.decode(tokenizer.encode(TEXT))
        assert stream.finish == "stop" and rest == ""
        assert "".join(deltas) == whole[:whole.index(stop)]


def test_the_start_of_a_stop_string_is_held_until_decided_and_given_at_the_end():
    tokenizer = ByteTokenizer()
    stream = TextStream(tokenizer, ["world"])
    given = stream.add(tokenizer.encode("hello wor"))
    assert given == "hello " and stream.finish is None  # "wor" could become "world"
    assert stream.add(tokenizer.encode("k")) == "work"  # it did not
    assert stream.add(tokenizer.encode(" wo")) == " " and stream.end() == "wo"  # no token follows


def test_each_step_decodes_a_window_not_the_whole_completion():
    decoded: list[int] = []

    class Counting(ByteTokenizer):
        def decode(self, ids: list[int]) -> str:
            decoded.append(len(ids))
            return super().decode(ids)

    tokens = list(TEXT.encode())
    stream = TextStream(Counting(), ["never there"])
    deltas = [stream.add([token]) for token in tokens]
    assert "".join(deltas) + stream.end() == TEXT
    assert max(decoded[:-1]) <= 8  # a 4-byte character and its context at most; only end decodes all


def test_a_stop_string_met_in_a_step_that_ends_inside_a_character_stops_there():
    tokenizer = ByteTokenizer()
    stream = TextStream(tokenizer, ["\n"])
    assert stream.add(tokenizer.encode("Hi")) == "Hi"
    # The step brings the stop string and the first byte of a three-byte character.
    assert stream.add([*tokenizer.encode("\n"), 0xE2]) == "" and stream.finish == "stop"
    stream = TextStream(tokenizer, ["ne. "])
    assert stream.add([*tokenizer.encode("Done. "), 0xF0]) == "Do" and stream.finish == "stop"


def test_text_after_a_byte_run_the_decoder_rewrites_still_comes_and_still_stops(tokenizers):
    tokenizer = tokenizers["llama-like BPE"]
    newline, stray = tokenizer.tokenizer.token_to_id("<0x0A>"), tokenizer.tokenizer.token_to_id("<0xE2>")
    steps = [[token] for token in tokenizer.encode("Hello")] + [[newline], [stray]]
    steps += [[token] for token in tokenizer.encode(" Then more text STOP and after")]
    stream = TextStream(tokenizer, ["STOP"])
    deltas = [stream.add(step) for step in steps if stream.finish is None]
    assert stream.finish == "stop"  # once the byte run decodes as U+FFFD, the newline before it included
    assert "".join(deltas).startswith("Hello") and "".join(deltas).endswith("Then more text ")
