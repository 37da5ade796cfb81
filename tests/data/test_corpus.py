from __future__ import annotations

import numpy as np
import pytest

from meshyard.config.load import load_config
from meshyard.data.corpus import DataSourceError, load_corpus, stdlib_source_files
from meshyard.data.loader import build_data


def data_cfg(tmp_path, *overrides):
    return load_config(None, [f"--data.cache_dir={tmp_path / 'cache'}", *overrides]).data


def test_stdlib_corpus_is_real_python_and_cached(tmp_path):
    cfg = data_cfg(tmp_path, "--data.source=stdlib")
    corpus = load_corpus(cfg)
    assert corpus.vocab_size == 256
    assert len(corpus.tokens) > 1_000_000
    assert b"def " in bytes(corpus.tokens[:200_000])
    assert isinstance(corpus.tokens, np.memmap)
    cached = list((tmp_path / "cache").glob("stdlib-*.u8"))
    assert len(cached) == 1 and not list((tmp_path / "cache").glob("*.tmp"))
    mtime = cached[0].stat().st_mtime_ns
    again = load_corpus(cfg)  # second load reads the cache, does not rebuild it
    assert cached[0].stat().st_mtime_ns == mtime and len(again.tokens) == len(corpus.tokens)
    assert all("site-packages" not in str(p) for p in stdlib_source_files())


def test_text_files_by_glob(tmp_path):
    (tmp_path / "a.txt").write_text("hello ")
    (tmp_path / "b.txt").write_text("world")
    corpus = load_corpus(data_cfg(tmp_path, "--data.source=text", f"--data.paths=['{tmp_path}/*.txt']"))
    assert bytes(corpus.tokens) == b"hello \x00world\x00"


@pytest.mark.parametrize("suffix", [".npy", ".bin"])
def test_pretokenized_files(tmp_path, suffix):
    tokens = np.arange(1000, dtype=np.uint16) % 300
    path = tmp_path / f"tokens{suffix}"
    np.save(path, tokens) if suffix == ".npy" else tokens.tofile(path)
    corpus = load_corpus(data_cfg(tmp_path, "--data.source=tokens", f"--data.paths=['{path}']"))
    assert corpus.vocab_size == 300 and np.array_equal(np.asarray(corpus.tokens), tokens)
    with pytest.raises(DataSourceError, match="raise data.vocab_size"):
        load_corpus(data_cfg(tmp_path, "--data.source=tokens", f"--data.paths=['{path}']", "--data.vocab_size=100"))


def test_missing_files_named(tmp_path):
    with pytest.raises(DataSourceError, match="matches no file"):
        load_corpus(data_cfg(tmp_path, "--data.source=text", "--data.paths=['/nowhere/*.txt']"))


def test_windows_are_next_token_pairs_and_splits_disjoint(tmp_path):
    cfg = data_cfg(tmp_path, "--data.source=random", "--data.random_tokens=10000", "--data.seq_len=16",
                   "--data.val_fraction=0.1")
    bundle = build_data(cfg, global_batch=8, micro_batch=4, dp_rank=0, dp_size=2, seed=0)
    x, y = next(iter(bundle.train_loader))
    assert x.shape == y.shape == (4, 16)
    assert torch_equal(x[:, 1:], y[:, :-1])
    assert bundle.train_samples + len(bundle.val_dataset) == (10000 - 1) // 16
    assert len(bundle.val_dataset) == int(624 * 0.1)


def torch_equal(a, b) -> bool:
    return bool((a == b).all())
