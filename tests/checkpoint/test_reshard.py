"""Resume on another world size or strategy: the checkpoint is resharded on load and the
data position maps by global sample index, so every training sample is seen once."""

from __future__ import annotations

import pytest

import meshyard
from meshyard.config.load import load_config
from tests.checkpoint.recording_dataset import seen_indices

STEPS, HALF, GLOBAL_BATCH = 8, 4, 8
REPO_DATASET = "tests/checkpoint/recording_dataset.py:build"


def job(tmp_path, name: str, *overrides: str):
    """A tiny GPT on the recording dataset; checkpoints at the end only; constant lr so the
    first half of a long run equals a short run."""
    return load_config(None, [
        "--model.name=gpt-tiny", f"--data.source={REPO_DATASET}", "--data.seq_len=16",
        f"--data.cache_dir={tmp_path / name / 'seen'}", f"--train.global_batch={GLOBAL_BATCH}",
        "--train.eval_every=0", "--optim.schedule=constant", "--optim.warmup_steps=2", "--checkpoint.interval=0",
        "--metrics.progress_bar=false", f"--run.run_dir={tmp_path / name / 'run'}", *overrides,
    ])


@pytest.fixture(scope="module")
def first_half(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("reshard")
    result = meshyard.run(job(tmp, "a", f"--train.steps={HALF}"), nproc=2)
    return tmp, result


@pytest.fixture(scope="module")
def uninterrupted(first_half):
    tmp, _ = first_half
    return meshyard.run(job(tmp, "u", f"--train.steps={STEPS}"), nproc=2).metrics()


@pytest.mark.parametrize(
    "nproc, strategy",
    [(1, "none"), (4, "ddp"), (2, "fsdp"), (2, "zero1")],
    ids=["2-to-1", "2-to-4", "ddp-to-fsdp", "ddp-to-zero1"],
)
def test_resume_on_new_layout_sees_every_sample_once(first_half, uninterrupted, nproc, strategy):
    tmp, first = first_half
    name = f"b-{nproc}-{strategy}"
    result = meshyard.run(job(tmp, name, f"--train.steps={STEPS}", f"--parallel.strategy={strategy}"),
                          nproc=nproc, resume=str(first.run_dir))
    records = result.metrics()
    assert [r["step"] for r in records] == list(range(HALF + 1, STEPS + 1))
    # The resharded model, optimizer and schedule continue the same trajectory.
    for record, reference in zip(records, uninterrupted[HALF:]):
        assert record["loss"] == pytest.approx(reference["loss"], rel=1e-5)
    seen = seen_indices(tmp / "a" / "seen") + seen_indices(tmp / name / "seen")
    assert len(seen) == STEPS * GLOBAL_BATCH
    assert len(set(seen)) == len(seen), "a sample was seen twice"


def test_zero1_checkpoint_continues_under_ddp(first_half, uninterrupted):
    """ZeRO-1 saves each rank's optimizer partition under parameter names: the whole state."""
    tmp, _ = first_half
    first = meshyard.run(job(tmp, "z", f"--train.steps={HALF}", "--parallel.strategy=zero1"), nproc=2)
    second = meshyard.run(job(tmp, "zd", f"--train.steps={STEPS}"), nproc=2, resume=str(first.run_dir))
    for record, reference in zip(second.metrics(), uninterrupted[HALF:]):
        assert record["loss"] == pytest.approx(reference["loss"], rel=1e-5)
