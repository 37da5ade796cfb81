"""Shard caches' local folders: one per process (loader workers included), gone when the
cache is closed and when the process ends, and those of killed readers removed by the next."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time

import pytest

from meshyard.data.prepare import prepare_shards
from meshyard.data.reader_folders import PREFIX, new_reader_folder, remove_abandoned
from meshyard.data.shard_reader import open_shards
from tests.checkpoint.helpers import REPO
from tests.data.test_shards import write_text

SHARD_TOKENS = 100


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    """A local folder of byte-token shards, 100 tokens each."""
    folder = tmp_path_factory.mktemp("corpus")
    prepare_shards(write_text(folder / "text", documents=12), str(folder / "shards"), shard_tokens=SHARD_TOKENS,
                   cache_dir=folder / "cache", report=lambda _: None)
    return folder / "shards"


def readers(cache_dir):
    return sorted(cache_dir.glob(f"shards/*/{PREFIX}*"))


def test_close_waits_for_fetches_under_way_and_leaves_no_folder(tmp_path, corpus):
    tokens = open_shards(str(corpus), {}, tmp_path, 4 * SHARD_TOKENS)
    read = tokens.cache.store.read
    tokens.cache.store.read = lambda name: time.sleep(0.05) or read(name)
    assert tokens[0:150].tolist() == list(read("shard-00000.u8") + read("shard-00001.u8")[:50])
    tokens.cache.prefetch(tokens.shards[2:6])  # still downloading when the cache is closed
    folder = tokens.cache.folder
    assert folder.parent.parent == tmp_path / "shards" and readers(tmp_path) == [folder]
    tokens.close()
    time.sleep(0.1)
    assert not folder.exists() and readers(tmp_path) == []


def test_folders_of_dead_readers_of_this_host_are_removed_when_the_corpus_is_opened(tmp_path, corpus):
    first = open_shards(str(corpus), {}, tmp_path, 4 * SHARD_TOKENS)
    parent = first.cache.folder.parent
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    dead_pid = int(dead.stdout)
    host = first.cache.folder.name.split("-")[1]
    abandoned = parent / f"{PREFIX}{host}-{dead_pid}-x1y2"
    (abandoned / "nested").mkdir(parents=True)
    elsewhere = parent / f"{PREFIX}otherhost-{dead_pid}-x1y2"  # another host's: it may still run there
    elsewhere.mkdir()
    assert remove_abandoned(parent) == [abandoned]
    second = open_shards(str(corpus), {}, tmp_path, 4 * SHARD_TOKENS)
    assert set(readers(tmp_path)) == {first.cache.folder, second.cache.folder, elsewhere}  # the living stay
    assert new_reader_folder(parent).name.startswith(f"{PREFIX}{host}-{os.getpid()}-")


WORKERS_THEN_EXIT = """
import json, sys
from meshyard.config.load import load_config
from meshyard.data.loader import build_data
url, cache_dir = sys.argv[1:]
cfg = load_config(None, ["--data.source=shards", f"--data.url={url}", f"--data.cache_dir={cache_dir}",
                         "--data.seq_len=30", "--data.num_workers=2", "--data.cache_bytes=300"]).data
bundle = build_data(cfg, global_batch=8, micro_batch=4, dp_rank=0, dp_size=1, seed=7)
bundle.val_dataset[0]  # the rank reads too, into its own folder
loader = iter(bundle.train_loader)
windows = [row.tolist() for _ in range(12) for row in next(loader)[0]]
folder = bundle.train_loader.dataset.tokens.cache.folder
print(json.dumps({"windows": windows, "workers": len([p for p in folder.iterdir() if p.is_dir()])}))
"""


def test_loader_workers_read_through_folders_of_their_own_and_a_process_leaves_none_at_exit(tmp_path, corpus):
    """With three shards of room, two workers and the rank evict shards all the time: a
    worker deleting a file the rank or the other worker reads would fail the read."""
    done = subprocess.run([sys.executable, "-c", WORKERS_THEN_EXIT, str(corpus), str(tmp_path)], cwd=REPO,
                          capture_output=True, text=True, timeout=120, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert done.returncode == 0, done.stderr[-3000:]
    seen = json.loads(done.stdout.splitlines()[-1])
    assert seen["workers"] == 2 and len(seen["windows"]) == 12 * 4
    stream = b"".join((corpus / f"shard-{k:05d}.u8").read_bytes() for k in range(len(list(corpus.glob("shard-*")))))
    assert all(bytes(w) in stream for w in seen["windows"])
    assert readers(tmp_path) == []
