"""Preparing a corpus as token shards: the format, idempotent reruns, local folders and S3 (moto)."""

from __future__ import annotations

import numpy as np
import pytest

from meshyard.cli import main as cli_main
from meshyard.config.sections import DataConfig
from meshyard.data.corpus import load_corpus
from meshyard.data.prepare import prepare_shards
from meshyard.data.shards import INDEX_NAME, ShardStore
from meshyard.run_dir import RunDir
from tests.s3_server import S3_OPTIONS, start_s3_server

def write_text(folder, documents=6):
    folder.mkdir(parents=True, exist_ok=True)
    for k in range(documents):
        (folder / f"doc{k}.txt").write_text(f"document {k}: " + "the quick brown fox jumps over the lazy dog. " * (k + 3))
    return [str(folder / "*.txt")]


@pytest.fixture(scope="module")
def s3_options():
    server, endpoint = start_s3_server("corpora")
    yield {**S3_OPTIONS, "client_kwargs": {"endpoint_url": endpoint}}
    server.stop()


def test_shards_hold_the_token_stream_of_the_text_source(tmp_path):
    paths = write_text(tmp_path / "text")
    out = tmp_path / "shards"
    prepared = prepare_shards(paths, str(out), shard_tokens=100, cache_dir=tmp_path / "cache", report=lambda _: None)
    index = ShardStore(str(out)).read_index()
    expected = np.asarray(load_corpus(DataConfig(source="text", paths=paths, cache_dir=str(tmp_path / "cache"))).tokens)
    stream = np.concatenate([np.fromfile(out / s.name, dtype=index.element) for s in index.shards])
    assert np.array_equal(stream, expected)
    assert [s.tokens for s in index.shards[:-1]] == [100] * (len(index.shards) - 1)
    assert index.total_tokens == len(expected) and index.vocab_size == 256 and index.tokenizer == ""
    assert prepared.written == len(index.shards) > 3


def test_a_rerun_rewrites_nothing_and_a_subword_tokenizer_lies_beside_the_shards(tmp_path):
    paths = write_text(tmp_path / "text")
    out = tmp_path / "shards"
    args = dict(tokenizer="bpe:300", shard_tokens=64, cache_dir=tmp_path / "cache", report=lambda _: None)
    first = prepare_shards(paths, str(out), **args)
    stamps = {p.name: p.stat().st_mtime_ns for p in out.iterdir()}
    again = prepare_shards(paths, str(out), **args)
    assert again.written == 0 and again.kept == first.written and again.index == first.index
    assert {p.name: p.stat().st_mtime_ns for p in out.iterdir()} == stamps
    assert first.index.tokenizer == RunDir.TOKENIZER and (out / RunDir.TOKENIZER).exists()
    assert first.index.dtype == "uint16" and first.index.vocab_size == 300


def test_prepare_writes_to_s3_from_the_command_line(tmp_path, s3_options, capsys):
    paths = write_text(tmp_path / "text")
    endpoint = s3_options["client_kwargs"]["endpoint_url"]
    command = ["data", "prepare", *paths, "--out", "s3://corpora/small", "--shard-tokens", "128",
               "--cache-dir", str(tmp_path / "cache"), "--storage-option", "key=testing",
               "--storage-option", "secret=testing", "--storage-option", f"endpoint_url={endpoint}"]
    assert cli_main(command) == 0
    store = ShardStore("s3://corpora/small", s3_options)
    index = store.read_index()
    assert all(store.size(s.name) == s.tokens * index.element.itemsize for s in index.shards)
    assert cli_main(command) == 0
    assert f"{len(index.shards)} already there" in capsys.readouterr().out


def test_a_folder_without_an_index_is_refused_in_one_paragraph(tmp_path, capsys):
    code = cli_main(["data", "prepare", str(tmp_path / "missing*.txt"), "--out", str(tmp_path / "out")])
    assert code == 2
    assert "matches no file" in capsys.readouterr().err
    with pytest.raises(ValueError, match="holds no index.json.*meshyard data prepare"):
        ShardStore(str(tmp_path)).read_index()
    assert INDEX_NAME == "index.json"


def test_a_rerun_reads_back_what_is_there_and_rewrites_only_damaged_shards(tmp_path):
    """A shard damaged in place (same name, same size) and one without an index beside it
    (an interrupted prepare) are judged by their bytes, not their names."""
    paths = write_text(tmp_path / "text")
    out = tmp_path / "shards"
    args = dict(shard_tokens=100, cache_dir=tmp_path / "cache", report=lambda _: None)
    first = prepare_shards(paths, str(out), **args)
    damaged = out / first.index.shards[2].name
    data = bytearray(damaged.read_bytes())
    data[7] ^= 0xFF
    damaged.write_bytes(bytes(data))
    again = prepare_shards(paths, str(out), **args)
    assert (again.written, again.kept) == (1, first.written - 1)
    assert ShardStore(str(out)).read_index() == first.index and damaged.read_bytes() != bytes(data)

    (out / INDEX_NAME).write_text("{ not an index")  # an interrupted or foreign index: replaced
    lines: list[str] = []
    third = prepare_shards(paths, str(out), **{**args, "report": lines.append})
    assert (third.written, third.kept) == (0, first.written)
    assert "replacing" in lines[0] and ShardStore(str(out)).read_index() == first.index


def test_a_rerun_with_larger_shards_removes_those_the_new_index_does_not_name(tmp_path):
    paths = write_text(tmp_path / "text")
    out = tmp_path / "shards"
    first = prepare_shards(paths, str(out), shard_tokens=100, cache_dir=tmp_path / "cache", report=lambda _: None)
    second = prepare_shards(paths, str(out), shard_tokens=400, cache_dir=tmp_path / "cache", report=lambda _: None)
    assert len(second.index.shards) < len(first.index.shards)
    assert sorted(p.name for p in out.glob("shard-*")) == [s.name for s in second.index.shards]
    tokens = load_corpus(DataConfig(source="shards", url=str(out), cache_dir=str(tmp_path / "read"))).tokens
    assert np.array_equal(tokens[0:1000], np.concatenate(
        [np.fromfile(out / s.name, dtype=second.index.element) for s in second.index.shards])[:1000])


def test_a_shard_is_read_in_one_ranged_request_of_the_size_its_index_gives(tmp_path):
    """s3fs asks for an object's size (a request of its own) before a whole-object read; a
    read of the bytes the index names needs none, and never reads past them."""
    prepare_shards(write_text(tmp_path / "text"), str(tmp_path / "out"), shard_tokens=100,
                   cache_dir=tmp_path / "cache", report=lambda _: None)
    store = ShardStore(str(tmp_path / "out"))
    index = store.read_index()
    calls = []
    cat_file = store.fs.cat_file
    store.fs.cat_file = lambda path, **ranged: calls.append(ranged) or cat_file(path, **ranged)
    first = index.shards[0]
    with open(store.path(first.name), "ab") as damaged:
        damaged.write(b"tail")  # bytes beyond the index's are never read
    assert len(store.read(first.name)) == first.tokens
    assert calls == [{"start": 0, "end": first.tokens}]
