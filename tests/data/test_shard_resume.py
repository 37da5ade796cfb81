"""Training from token shards on S3 (moto) through slow, failing fetches and a cache smaller
than a rank's shards, killed with SIGKILL mid-run on 2 ranks and resumed on 1: the samples
trained on are the sampler's, in its order, none twice and none lost."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

import meshyard
from meshyard.data.prepare import prepare_shards
from meshyard.data.sampling import GlobalBatchSampler, SpanOrder
from meshyard.data.shards import ShardStore
from tests.checkpoint.helpers import REPO, latest_checkpoint, wait_for_step
from tests.data.recording_shards import read_batches
from tests.data.test_shards import write_text
from tests.s3_server import S3_OPTIONS, start_s3_server

URL = "s3://corpora/resume"
SEQ_LEN, GLOBAL_BATCH, MICRO_BATCH, STEPS, SEED = 16, 8, 2, 12, 1234
SHARD_TOKENS = 400


@pytest.fixture(scope="module")
def endpoint(tmp_path_factory):
    folder = tmp_path_factory.mktemp("corpus")
    server, endpoint = start_s3_server("corpora")
    prepare_shards(write_text(folder / "text", documents=12), URL, shard_tokens=SHARD_TOKENS,
                   storage_options={**S3_OPTIONS, "client_kwargs": {"endpoint_url": endpoint}},
                   cache_dir=folder / "cache", report=lambda _: None)
    yield endpoint
    server.stop()


def job(tmp_path: Path, endpoint: str) -> list[str]:
    return [
        "--model.name=gpt-tiny", "--data.source=tests/data/recording_shards.py:build", f"--data.url={URL}",
        f'--data.storage_options={{ key = "testing", secret = "testing", client_kwargs = '
        f'{{ endpoint_url = "{endpoint}" }} }}', f"--data.cache_bytes={4 * SHARD_TOKENS}",  # 4 of 12 shards
        f"--data.cache_dir={tmp_path / 'cache'}", f"--data.seq_len={SEQ_LEN}", "--data.val_fraction=0",
        f"--train.global_batch={GLOBAL_BATCH}", f"--train.micro_batch={MICRO_BATCH}", f"--train.steps={STEPS}",
        "--train.eval_every=0", "--metrics.mfu=false", "--metrics.progress_bar=false", "--checkpoint.interval=2",
        f"--run.run_dir={tmp_path / 'run'}",
    ]


def span_order(store: ShardStore) -> tuple[int, SpanOrder]:
    """The corpus's training samples and their order by default: in spans of 2 shards."""
    index = store.read_index()
    samples = (index.total_tokens - 1) // SEQ_LEN
    shard_starts = np.cumsum([0] + [shard.tokens for shard in index.shards])
    spans = (np.searchsorted(shard_starts, np.arange(samples) * SEQ_LEN, side="right") - 1) // 2
    starts = np.concatenate([[0], np.flatnonzero(np.diff(spans)) + 1, [samples]])
    return samples, SpanOrder(starts, GLOBAL_BATCH, GLOBAL_BATCH, SEED)  # 8 lanes: the default


def sampler_order(order: tuple[int, SpanOrder], rank: int, ranks: int, steps: range) -> list[list[int]]:
    """The micro-batches rank ``rank`` of ``ranks`` takes in optimizer steps ``steps`` (1-based)."""
    sampler = GlobalBatchSampler(order[0], GLOBAL_BATCH, MICRO_BATCH, rank, ranks, SEED, order=order[1])
    return [batch for step in steps for batch in sampler.step_indices(step - 1)]


def test_killed_on_two_ranks_and_resumed_on_one_trains_on_every_sample_once(tmp_path, endpoint):
    overrides = job(tmp_path, endpoint)
    seen, run_dir = tmp_path / "cache" / "seen", tmp_path / "run"
    first = subprocess.Popen([sys.executable, "-m", "meshyard.cli", "run", "--nproc", "2", *overrides], cwd=REPO,
                             stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, start_new_session=True,
                             env={**os.environ, "OMP_NUM_THREADS": "1"})
    wait_for_step(run_dir, 4, first)
    deadline = time.monotonic() + 60
    while not (run_dir / "checkpoints" / "latest").exists() and time.monotonic() < deadline:
        time.sleep(0.01)  # the step-2 checkpoint is written in the background: kill once it is committed
    os.killpg(first.pid, signal.SIGKILL)  # the agent and both workers: no chance to save or clean up
    first.wait(timeout=30)
    resumed = int(latest_checkpoint(run_dir).name.split("-")[1])
    assert 2 <= resumed < STEPS
    readers = list((tmp_path / "cache").glob("shards/*/reader-*"))
    assert len(readers) == 2  # left by the killed ranks
    first_run = {rank: read_batches(seen, rank) for rank in (0, 1)}
    for path in seen.glob("*.txt"):
        path.rename(path.with_suffix(".first"))

    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("OMP_NUM_THREADS", "1")
        records = meshyard.run(meshyard.load_config(None, overrides), nproc=1).metrics()
    assert records[-1]["step"] == STEPS

    store = ShardStore(URL, {**S3_OPTIONS, "client_kwargs": {"endpoint_url": endpoint}})
    order = span_order(store)
    trained = []
    for rank in (0, 1):  # what each killed rank read up to the checkpoint resumed from, in its order
        expected = sampler_order(order, rank, 2, range(1, resumed + 1))
        assert first_run[rank][: len(expected)] == expected
        trained += expected
    second_run = read_batches(seen)
    assert second_run == sampler_order(order, 0, 1, range(resumed + 1, STEPS + 1))
    trained = [i for batch in trained + second_run for i in batch]
    everything = GlobalBatchSampler(order[0], GLOBAL_BATCH, MICRO_BATCH, 0, 1, SEED, order=order[1])
    assert sorted(trained) == sorted(i for step in range(STEPS) for i in everything.global_indices(step))
    assert len(set(trained)) == len(trained) == STEPS * GLOBAL_BATCH  # none twice, none lost
    assert list(seen.glob("*.failed")) and all(p.read_text() for p in seen.glob("*.failed"))  # faults injected
    assert list((tmp_path / "cache").glob("shards/*/reader-*")) == []  # the killed ranks' and the resumed rank's
