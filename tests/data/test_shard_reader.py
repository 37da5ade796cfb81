"""Reading token shards from S3 (moto) through the bounded cache: the sampler's samples,
none twice and none lost, through slow, failing and corrupted fetches and a small cache."""

from __future__ import annotations

import os
import time

import numpy as np
import pytest

import meshyard
from meshyard.config.load import load_config
from meshyard.data.loader import build_data, cache_warning
from meshyard.data.prepare import prepare_shards
from meshyard.data.shard_reader import ShardCache, open_shards
from meshyard.data.corpus import load_corpus
from meshyard.data.shards import ShardStore
from tests.conftest import tiny_config
from tests.data.test_shards import write_text
from tests.inprocess import fit_here
from tests.s3_server import start_s3_server

URL = "s3://corpora/reader"
SHARD_TOKENS = 100
WHOLE_CORPUS = "--data.shuffle_span_shards=0"  # the text source's order, for tests that compare with it


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    """A text corpus prepared to S3 in shards of 100 byte tokens: (text patterns, storage options)."""
    folder = tmp_path_factory.mktemp("corpus")
    server, endpoint = start_s3_server("corpora")
    options = {"key": "testing", "secret": "testing", "client_kwargs": {"endpoint_url": endpoint}}
    paths = write_text(folder / "text", documents=12)
    prepare_shards(paths, URL, shard_tokens=SHARD_TOKENS, storage_options=options, cache_dir=folder / "cache",
                   report=lambda _: None)
    yield paths, options
    server.stop()


def data_config(tmp_path, corpus, *overrides):
    paths, options = corpus
    endpoint = options["client_kwargs"]["endpoint_url"]
    return load_config(None, ["--data.source=shards", f"--data.url={URL}", f"--data.cache_dir={tmp_path}",
                              "--data.seq_len=30", "--data.val_fraction=0",
                              f'--data.storage_options={{ key = "testing", secret = "testing", client_kwargs = '
                              f'{{ endpoint_url = "{endpoint}" }} }}', *overrides]).data


def text_config(tmp_path, corpus):
    return load_config(None, ["--data.source=text", f"--data.paths={corpus[0]}", f"--data.cache_dir={tmp_path}",
                              "--data.seq_len=30", "--data.val_fraction=0"]).data


def batches(cfg, steps, rank=0, ranks=1, patch=None):
    bundle = build_data(cfg, global_batch=8, micro_batch=4 // ranks if ranks > 1 else 4, dp_rank=rank,
                        dp_size=ranks, seed=7)
    if patch:
        patch(bundle.train_loader.dataset.tokens.cache)
    loader = iter(bundle.train_loader)
    return [next(loader) for _ in range(steps * 2)], bundle


def windows(batch_list):
    return [tuple(row.tolist()) for inputs, _ in batch_list for row in inputs]


def test_two_ranks_read_exactly_the_text_sources_windows_through_a_cache_smaller_than_their_shards(tmp_path, corpus):
    steps = 6
    expected, _ = batches(text_config(tmp_path / "text", corpus), steps)
    small = [f"--data.cache_bytes={2 * SHARD_TOKENS}", WHOLE_CORPUS]  # two shards, of the 30+ each rank reads
    fetched: list[str] = []

    def logged(cache: ShardCache) -> None:
        read = cache.store.read
        cache.store.read = lambda name: fetched.append(name) or read(name)

    ranks = [batches(data_config(tmp_path / f"rank{r}", corpus, *small), steps, r, 2, logged) for r in range(2)]
    read = [w for r in range(2) for w in windows(ranks[r][0])]
    assert sorted(read) == sorted(windows(expected))  # the same samples, none twice, none lost
    cache = ranks[0][1].train_loader.dataset.tokens.cache
    assert len(fetched) > len(set(fetched))  # evicted shards were fetched again
    assert sum(p.stat().st_size for p in cache.folder.iterdir()) <= 2 * SHARD_TOKENS


def test_a_shard_that_fails_twice_is_fetched_on_the_third_try_and_slow_fetches_only_wait(tmp_path, corpus):
    failures: dict[str, int] = {}

    def flaky(cache: ShardCache) -> None:
        read = cache.store.read

        def slow_and_failing(name: str) -> bytes:
            time.sleep(0.01)
            failures[name] = failures.get(name, 0) + 1
            if name == "shard-00003.u8" and failures[name] <= 2:
                raise ConnectionError("injected: connection reset")
            return read(name)
        cache.store.read = slow_and_failing

    expected, _ = batches(text_config(tmp_path / "text", corpus), 4)
    got, _ = batches(data_config(tmp_path / "shards", corpus, WHOLE_CORPUS), 4, patch=flaky)
    assert windows(got) == windows(expected) and failures["shard-00003.u8"] == 3


def test_in_spans_each_rank_reads_the_samplers_samples_and_fetches_only_its_own_shards_once(tmp_path, corpus):
    """The default order reads a span of 2 shards per place in the global batch: 2 ranks
    together read the sampler's samples of every step, each fetches only the shards its own
    places' spans hold (and the shard its spans' last samples end in), each once, and
    neither fetches what the other does except where one span ends where another begins."""
    steps, fetched = 6, {0: [], 1: []}

    def logged(rank: int):
        def patch(cache: ShardCache) -> None:
            read = cache.store.read
            cache.store.read = lambda name: fetched[rank].append(name) or read(name)
        return patch

    ranks = [batches(data_config(tmp_path / f"rank{r}", corpus), steps, r, 2, logged(r)) for r in range(2)]
    sampler, dataset = ranks[0][1].sampler, ranks[0][1].train_loader.dataset
    stream = np.asarray(load_corpus(text_config(tmp_path / "text", corpus)).tokens)
    for step in range(steps):
        expected = [stream[(dataset.first + i) * 30:(dataset.first + i) * 30 + 31][:-1].tolist()
                    for i in sampler.global_indices(step)]
        read = [row.tolist() for r in range(2) for inputs, _ in ranks[r][0][2 * step:2 * step + 2] for row in inputs]
        assert read == expected
    spans = dataset.tokens.shard_numbers((dataset.first + np.arange(dataset.count)) * 30) // 2
    for r in range(2):
        own = {r_sampler_index for step in range(steps + 2)
               for batch in ranks[r][1].sampler.step_indices(step) for r_sampler_index in batch}
        own_spans = {int(spans[i]) for i in own}
        allowed = {f"shard-{k:05d}.u8" for s in own_spans for k in (2 * s, 2 * s + 1, 2 * s + 2)}
        assert fetched[r] and set(fetched[r]) <= allowed
        assert len(fetched[r]) == len(set(fetched[r]))  # the cache holds what a rank reads at once
    total = len(dataset.tokens.shards)
    assert len(set(fetched[0]) | set(fetched[1])) <= total and len(set(fetched[0])) < total // 2 + 4


def test_a_corrupted_shard_is_fetched_again_then_refused_in_one_paragraph(tmp_path, corpus):
    cfg = data_config(tmp_path, corpus)
    tokens = open_shards(cfg.url, cfg.storage_options, tmp_path, cfg.cache_bytes)
    calls: list[str] = []
    read = tokens.cache.store.read

    def corrupted(name: str) -> bytes:
        calls.append(name)
        data = read(name)
        return data if calls.count(name) > 1 or name != "shard-00001.u8" else b"\xff" + data[1:]
    tokens.cache.store.read = corrupted
    stream = np.asarray(load_corpus(text_config(tmp_path / "text", corpus)).tokens)
    assert np.array_equal(tokens[95:105], stream[95:105])  # a window across two shards
    assert calls.count("shard-00001.u8") == 2  # damaged in transit once: fetched again, then accepted

    tokens.cache.store.read = lambda name: b"\x00" + read(name)[1:]
    with pytest.raises(ValueError, match=r"shard-00004.u8 .* does not match the digest .* twice .*meshyard data "
                                         "prepare"):
        tokens[SHARD_TOKENS * 4 + 50]


def test_a_training_run_on_shards_matches_one_on_the_text(tmp_path, corpus):
    paths, options = corpus
    endpoint = options["client_kwargs"]["endpoint_url"]
    common = ["--data.seq_len=30", "--data.val_fraction=0", "--train.steps=3", "--optim.schedule=constant"]
    text = meshyard.run(tiny_config(tmp_path / "a", "--data.source=text", f"--data.paths={paths}", *common), nproc=1)
    shards = meshyard.run(tiny_config(
        tmp_path / "b", "--data.source=shards", f"--data.url={URL}", WHOLE_CORPUS, *common,
        f'--data.storage_options={{ key = "testing", secret = "testing", client_kwargs = '
        f'{{ endpoint_url = "{endpoint}" }} }}'), nproc=1)
    assert [r["loss"] for r in shards.metrics()] == [r["loss"] for r in text.metrics()]


def test_the_next_steps_shards_are_fetched_while_the_current_one_is_read(tmp_path, corpus):
    """After each micro-batch the loader hands out, its sampler names the next two steps'
    batches: their shards download in the background and are there before they are read."""
    cfg = data_config(tmp_path, corpus, f"--data.cache_bytes={400 * SHARD_TOKENS}")
    bundle = build_data(cfg, global_batch=8, micro_batch=4, dp_rank=0, dp_size=1, seed=7)
    dataset, sampler = bundle.train_loader.dataset, bundle.sampler
    cache = dataset.tokens.cache
    assert sampler.look_ahead == dataset.fetch_ahead
    indices = iter(sampler)
    first = next(indices)  # names the next 4 micro-batches
    upcoming = indices.upcoming(1)[0]
    dataset.__getitems__(first)
    deadline = time.monotonic() + 30
    while cache._pending and time.monotonic() < deadline:  # the fetches started ahead of need
        time.sleep(0.01)
    starts = (dataset.first + np.asarray(upcoming)) * dataset.seq_len
    needed = dataset.tokens.shards_of(np.concatenate([starts, starts + dataset.seq_len]))
    assert needed and all(dataset.tokens.shards[k].name in cache._resident for k in needed)
    assert next(indices) == upcoming  # taking it names the batches after it in turn


def test_a_cold_fetch_is_counted_as_data_time_and_the_run_leaves_no_cache_folder(tmp_path, corpus, monkeypatch):
    """The first step's shards arrive 0.6 s late: the wait is the step's data phase, not its
    forward; a closed trainer removes its cache folder."""
    paths, options = corpus
    endpoint = options["client_kwargs"]["endpoint_url"]
    read = ShardStore.read

    def slow(store: ShardStore, name: str) -> bytes:
        if name.startswith("shard-"):
            time.sleep(0.6)
        return read(store, name)
    monkeypatch.setattr(ShardStore, "read", slow)
    cfg = tiny_config(tmp_path, "--data.source=shards", f"--data.url={URL}", "--data.seq_len=30",
                      "--data.val_fraction=0", "--train.steps=2", "--train.global_batch=2", "--metrics.breakdown=true",
                      f'--data.storage_options={{ key = "testing", secret = "testing", client_kwargs = '
                      f'{{ endpoint_url = "{endpoint}" }} }}')
    first = fit_here(cfg)[0]
    assert first["data_s"] >= 0.6 and first["forward_s"] < 0.6, first
    assert list((tmp_path / "cache").glob("shards/*/reader-*")) == []


def test_a_read_waits_only_for_its_own_shards_not_for_those_fetched_ahead(tmp_path, corpus):
    cfg = data_config(tmp_path, corpus)
    tokens = open_shards(cfg.url, cfg.storage_options, tmp_path, cfg.cache_bytes)
    read = tokens.cache.store.read
    tokens.cache.store.read = lambda name: time.sleep(0.2) or read(name)
    tokens.cache.prefetch(tokens.shards[:8])  # 4 rounds of 2 threads ahead of need
    start = time.monotonic()
    tokens[SHARD_TOKENS * 6 + 5]  # queued ahead: taken out of the queue and fetched now
    tokens[SHARD_TOKENS * 9 + 5]  # not asked for before
    assert time.monotonic() - start < 0.8  # behind the queue: 1 s at least
    tokens.close()


def test_a_cache_too_small_for_the_lanes_is_named_at_start_and_one_holding_the_corpus_never_is(tmp_path, corpus):
    """8 lanes of spans of 2 shards (and the shard after each): 27 shards at once."""
    def warnings(shards: int, *extra: str) -> tuple[str, ...]:
        cfg = data_config(tmp_path, corpus, f"--data.cache_bytes={shards * SHARD_TOKENS}", *extra)
        bundle = build_data(cfg, global_batch=8, micro_batch=4, dp_rank=0, dp_size=1, seed=7)
        bundle.close()
        return bundle.warnings

    [warning] = warnings(20)
    assert "data.cache_bytes = 2000 holds 20 shard(s)" in warning and "Raise data.cache_bytes to 2700" in warning
    assert warnings(27) == () and warnings(20, "--data.shuffle_lanes=2") == ()
    assert warnings(20, WHOLE_CORPUS) == ()  # nothing to say about a shuffle over the whole corpus
    tokens = open_shards(data_config(tmp_path, corpus).url, corpus[1], tmp_path, 48 * SHARD_TOKENS)
    assert cache_warning(tokens, data_config(tmp_path, corpus), lanes=64) == ""  # 48 shards: the whole corpus
    tokens.close()


def test_loader_workers_fetch_from_object_storage_what_their_rank_no_longer_holds(tmp_path, corpus):
    """A cache far smaller than the warning asks for, with 2 workers and several batches in
    flight: the rank evicts shards before its workers read them, so the workers fetch them
    from S3 themselves (s3fs refuses to work in a forked child: each worker opens the store
    anew), and the batches are still the ones read without workers."""
    steps = 10
    small = f"--data.cache_bytes={3 * SHARD_TOKENS}"
    plain, plain_bundle = batches(data_config(tmp_path / "plain", corpus, small), steps)
    plain_bundle.close()
    workers, bundle = batches(data_config(tmp_path / "workers", corpus, small, "--data.num_workers=2"), steps)
    assert bundle.warnings  # the warning says this cache is too small
    assert windows(workers) == windows(plain)
    bundle.close()


def test_loader_workers_read_the_shards_their_rank_fetches_and_nothing_is_downloaded_twice(tmp_path, corpus,
                                                                                              monkeypatch):
    """With 2 loader workers the rank's look-ahead fetches (each micro-batch's shards named
    as it is handed out), and the workers read those files: every shard read is downloaded
    once, by the rank, and the batches are the ones read without workers."""
    log = tmp_path / "fetches.txt"
    read = ShardStore.read

    def recorded(store: ShardStore, name: str) -> bytes:  # the class's: a worker opens a store of its own
        with log.open("a") as out:
            out.write(f"{os.getpid()} {name}\n")
        return read(store, name)

    steps = 6
    plain, plain_bundle = batches(data_config(tmp_path / "plain", corpus), steps)
    plain_bundle.close()  # its fetches ahead are not this reader's
    monkeypatch.setattr(ShardStore, "read", recorded)
    workers, bundle = batches(data_config(tmp_path / "workers", corpus, "--data.num_workers=2"), steps)
    assert windows(workers) == windows(plain)
    fetched = [line.split() for line in log.read_text().splitlines()]
    assert fetched and {pid for pid, _ in fetched} == {str(os.getpid())}  # the rank fetched, no worker did
    names = [name for _, name in fetched]
    assert len(names) == len(set(names))
    bundle.close()
