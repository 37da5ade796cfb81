"""Text corpora through subword tokenizers (the real ``tokenizers`` library): a BPE trained
once and read back from the cache, a Hugging Face tokenizer file, ``.jsonl`` documents,
end-of-text between documents, the narrowest token type, and byte caches kept valid."""

from __future__ import annotations

import hashlib
import json
import random
from pathlib import Path

import numpy as np
import pytest
from tokenizers import Tokenizer, models, pre_tokenizers, trainers

from meshyard.config.load import load_config
from meshyard.data import tokenizer as tokenizer_module
from meshyard.data.cache import DataSourceError, token_dtype
from meshyard.data.corpus import load_corpus
from meshyard.data.tokenizer import EOT, TextTokenizer, train_bpe
from tests.trained_runs import CORPUS_TEXT

PROSE = "The quick brown fox jumps over the lazy dog.\nA lazy dog sleeps in the sun all day long.\n" * 30
CODE = "def add(a, b):\n    return a + b\n\nfor i in range(3):\n    print(add(i, i))\n" * 30


def data_cfg(tmp_path: Path, *overrides: str):
    return load_config(None, ["--data.source=text", f"--data.cache_dir={tmp_path / 'cache'}", *overrides]).data


def write_files(tmp_path: Path) -> Path:
    folder = tmp_path / "corpus"
    folder.mkdir()
    (folder / "a.txt").write_text(PROSE)
    (folder / "b.txt").write_text(CODE)
    return folder


def documents_of(tokens: np.ndarray, eot: int) -> list[list[int]]:
    """The ids between end-of-text tokens (the corpus ends with one)."""
    ids = np.asarray(tokens).tolist()
    assert ids[-1] == eot
    out, run = [], []
    for token in ids:
        if token == eot:
            out.append(run)
            run = []
        else:
            run.append(token)
    return out


def test_a_bpe_is_trained_once_and_read_back_from_the_cache(tmp_path, capsys):
    folder = write_files(tmp_path)
    cfg = data_cfg(tmp_path, f"--data.paths=['{folder}/*.txt']", "--data.tokenizer=bpe:300")
    corpus = load_corpus(cfg)
    out = capsys.readouterr().out
    assert out.count("trained a byte-level BPE") == 1 and out.count("tokens/s") == 1
    [trained] = (tmp_path / "cache").glob("bpe300-*.json")
    assert corpus.tokenizer_file == trained and 256 < corpus.vocab_size <= 300
    assert corpus.tokens.dtype == np.uint16 and isinstance(corpus.tokens, np.memmap)
    assert len(list((tmp_path / "cache").glob("text-*.u16"))) == 1
    made = trained.stat().st_mtime_ns

    again = load_corpus(cfg)  # neither trained nor tokenized again: nothing printed, file untouched
    assert capsys.readouterr().out == ""
    assert trained.stat().st_mtime_ns == made and np.array_equal(again.tokens, corpus.tokens)

    (folder / "b.txt").write_text(CODE + "print('changed')\n")  # other files: another BPE
    load_corpus(cfg)
    assert "trained a byte-level BPE" in capsys.readouterr().out
    assert len(list((tmp_path / "cache").glob("bpe300-*.json"))) == 2


def test_documents_end_with_the_end_of_text_token_and_decode_back(tmp_path):
    folder = write_files(tmp_path)
    (folder / "c.jsonl").write_text(json.dumps({"body": "first record", "id": 1}) + "\n\n"
                                    + json.dumps({"body": "second, déjà vu", "id": 2}) + "\n")
    cfg = data_cfg(tmp_path, f"--data.paths=['{folder}/*']", "--data.tokenizer=bpe:320", "--data.text_field=body")
    corpus = load_corpus(cfg)
    tokenizer = TextTokenizer.from_str(corpus.tokenizer_file.read_text())
    parts = documents_of(corpus.tokens, tokenizer.eot_id)
    assert [tokenizer.decode(ids) for ids in parts] == [PROSE, CODE, "first record", "second, déjà vu"]
    assert tokenizer.eot_id == tokenizer.tokenizer.token_to_id(EOT)


def test_jsonl_records_are_byte_documents_too(tmp_path):
    path = tmp_path / "notes.jsonl"
    path.write_text("\n".join(json.dumps({"text": t}) for t in ("abc", "dé")) + "\n")
    corpus = load_corpus(data_cfg(tmp_path, f"--data.paths=['{path}']"))
    assert bytes(corpus.tokens) == "abc\0dé\0".encode() and corpus.vocab_size == 256
    with pytest.raises(DataSourceError, match=r"notes.jsonl, line 1: no text in field 'body' \(data.text_field\)"):
        load_corpus(data_cfg(tmp_path, f"--data.paths=['{path}']", "--data.text_field=body"))


def test_byte_caches_of_before_keep_their_names(tmp_path):
    """A byte corpus without .jsonl files is the one of earlier versions, under the same
    cache name: a cache built before is read, not built again."""
    folder = write_files(tmp_path)
    files = sorted(folder.glob("*.txt"))
    digest = hashlib.sha256(b"byte-v1")
    for f in files:
        digest.update(f"{f}\0{f.stat().st_size}\0{f.stat().st_mtime_ns}\n".encode())
    corpus = load_corpus(data_cfg(tmp_path, f"--data.paths=['{folder}/*.txt']"))
    assert (tmp_path / "cache" / f"text-{digest.hexdigest()[:20]}.u8").exists()
    assert bytes(corpus.tokens) == PROSE.encode() + b"\0" + CODE.encode() + b"\0"
    assert corpus.tokens.dtype == np.uint8 and corpus.tokenizer_file is None


def published_tokenizer(tmp_path: Path, special: list[str]) -> Path:
    """A word-level Hugging Face tokenizer saved as a folder's tokenizer.json."""
    tokenizer = Tokenizer(models.WordLevel(unk_token="[UNK]"))
    tokenizer.pre_tokenizer = pre_tokenizers.Whitespace()
    tokenizer.train_from_iterator([PROSE, CODE], trainers.WordLevelTrainer(special_tokens=["[UNK]", *special]))
    folder = tmp_path / "published"
    folder.mkdir(exist_ok=True)
    tokenizer.save(str(folder / "tokenizer.json"))
    return folder


def test_a_tokenizer_file_or_folder_is_used_as_published(tmp_path):
    folder = write_files(tmp_path)
    published = published_tokenizer(tmp_path, ["</s>"])
    for spec in (published, published / "tokenizer.json"):
        corpus = load_corpus(data_cfg(tmp_path, f"--data.paths=['{folder}/*.txt']", f"--data.tokenizer={spec}"))
        assert corpus.tokenizer_file == published / "tokenizer.json"  # it has an end-of-text token: used as is
        tokenizer = TextTokenizer.from_str(corpus.tokenizer_file.read_text())
        assert corpus.vocab_size == tokenizer.vocab_size < 256 and corpus.tokens.dtype == np.uint8
        assert len(documents_of(corpus.tokens, tokenizer.tokenizer.token_to_id("</s>"))) == 2
        assert tokenizer.decode(tokenizer.encode("the lazy dog")) == "the lazy dog"


def test_a_tokenizer_without_end_of_text_gets_one_in_the_copy_it_records(tmp_path):
    folder = write_files(tmp_path)
    published = published_tokenizer(tmp_path, [])
    corpus = load_corpus(data_cfg(tmp_path, f"--data.paths=['{folder}/*.txt']", f"--data.tokenizer={published}"))
    original = TextTokenizer.from_str((published / "tokenizer.json").read_text())
    recorded = TextTokenizer.from_str(corpus.tokenizer_file.read_text())
    assert corpus.tokenizer_file.parent == tmp_path / "cache" and original.eot_id is None
    assert recorded.vocab_size == corpus.vocab_size == original.vocab_size + 1
    assert len(documents_of(corpus.tokens, recorded.tokenizer.token_to_id(EOT))) == 2


def test_a_missing_tokenizer_is_named(tmp_path):
    folder = write_files(tmp_path)
    with pytest.raises(DataSourceError, match="data.tokenizer = '/no/such/tok' is not 'bytes', 'bpe:N'"):
        load_corpus(data_cfg(tmp_path, f"--data.paths=['{folder}/*.txt']", "--data.tokenizer=/no/such/tok"))


@pytest.mark.parametrize("vocab, dtype", [(256, np.uint8), (257, np.uint16), (65536, np.uint16),
                                          (65537, np.uint32), (2 ** 32, np.uint32)])
def test_token_ids_take_the_narrowest_type_the_vocabulary_allows(vocab, dtype):
    assert token_dtype(vocab) == np.dtype(dtype)


def test_a_long_document_encodes_in_pieces_to_what_it_encodes_whole(monkeypatch):
    tokenizer = TextTokenizer.from_str(train_bpe([CORPUS_TEXT], 400, report=lambda _: None))
    tokenizer.cuts_at_lines = True
    whole = tokenizer.encode(CORPUS_TEXT)
    monkeypatch.setattr(tokenizer_module, "PIECE_CHARS", 100)
    assert len(list(tokenizer_module._pieces(CORPUS_TEXT, 100))) > 10
    assert tokenizer.encode_batch([CORPUS_TEXT, "short"]) == [whole, tokenizer.encode("short")]
    rng = random.Random(0)  # whitespace runs, other spaces and letters around newlines, cut anywhere
    texts = ["".join(rng.choice("ab é1.\n\t  \n\n:'s\u3000\u00a0\r\x1c-") for _ in range(300)) for _ in range(50)]
    for size in (1, 7):
        monkeypatch.setattr(tokenizer_module, "PIECE_CHARS", size)
        assert tokenizer.encode_batch(texts) == [tokenizer.encode(text) for text in texts]
