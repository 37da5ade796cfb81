"""Resume on another world size or strategy: the checkpoint is resharded on load and the
data position maps by global sample index, so every training sample is seen once."""

from __future__ import annotations

import pytest

import meshyard
from meshyard.config.load import load_config
from tests.checkpoint.recording_dataset import seen_indices
from tests.inprocess import fit_in_order

STEPS, HALF, GLOBAL_BATCH = 8, 4, 8
REPO_DATASET = "tests/checkpoint/recording_dataset.py:build"
# The second halves that resume the 2-rank DDP first half on 2 ranks again.
ON_TWO_RANKS = ["fsdp", "zero1"]


def job(tmp_path, name: str, *overrides: str):
    """A tiny GPT on the recording dataset; checkpoints at the end only; constant lr so the
    first half of a long run equals a short run."""
    return load_config(None, [
        "--model.name=gpt-tiny", f"--data.source={REPO_DATASET}", "--data.seq_len=16",
        f"--data.cache_dir={tmp_path / name / 'seen'}", f"--train.global_batch={GLOBAL_BATCH}",
        "--train.eval_every=0", "--optim.schedule=constant", "--optim.warmup_steps=2", "--checkpoint.interval=0",
        "--metrics.progress_bar=false", f"--run.run_dir={run_dir(tmp_path, name)}", *overrides,
    ])


def run_dir(tmp_path, name: str) -> str:
    return str(tmp_path / name / "run")


def second_half(tmp_path, nproc: int, strategy: str):
    return job(tmp_path, f"b-{nproc}-{strategy}", f"--train.steps={STEPS}", f"--parallel.strategy={strategy}")


@pytest.fixture(scope="module")
def two_rank_runs(tmp_path_factory):
    """The module's folder and the records of every run on 2 ranks, by name, all trained
    in-process in one spawn (what is under test is what the checkpoint holds and how it
    loads, not how ranks are launched): DDP's first half "a", the uninterrupted run "u",
    ZeRO-1's first half "z", then the second halves that continue "a" and "z"."""
    tmp = tmp_path_factory.mktemp("reshard")
    jobs = {
        "a": (job(tmp, "a", f"--train.steps={HALF}"), "none"),
        "u": (job(tmp, "u", f"--train.steps={STEPS}"), "none"),
        "z": (job(tmp, "z", f"--train.steps={HALF}", "--parallel.strategy=zero1"), "none"),
        **{f"b-2-{strategy}": (second_half(tmp, 2, strategy), run_dir(tmp, "a")) for strategy in ON_TWO_RANKS},
        "zd": (job(tmp, "zd", f"--train.steps={STEPS}"), run_dir(tmp, "z")),
    }
    return tmp, dict(zip(jobs, fit_in_order(list(jobs.values()), world_size=2)))


@pytest.mark.parametrize(
    "nproc, strategy",
    [(1, "none"), (4, "ddp"), (2, "fsdp"), (2, "zero1")],
    ids=["2-to-1", "2-to-4", "ddp-to-fsdp", "ddp-to-zero1"],
)
def test_resume_on_new_layout_sees_every_sample_once(two_rank_runs, nproc, strategy):
    tmp, runs = two_rank_runs
    name = f"b-{nproc}-{strategy}"
    first = run_dir(tmp, "a")
    if nproc == 2:
        records = runs[name]
    elif nproc == 1:
        records = meshyard.run(second_half(tmp, nproc, strategy), nproc=1, resume=first).metrics()
    else:
        (records,) = fit_in_order([(second_half(tmp, nproc, strategy), first)], world_size=nproc)
    assert [r["step"] for r in records] == list(range(HALF + 1, STEPS + 1))
    # The resharded model, optimizer and schedule continue the same trajectory.
    for record, reference in zip(records, runs["u"][HALF:]):
        assert record["loss"] == pytest.approx(reference["loss"], rel=1e-5)
    seen = seen_indices(tmp / "a" / "seen") + seen_indices(tmp / name / "seen")
    assert len(seen) == STEPS * GLOBAL_BATCH
    assert len(set(seen)) == len(seen), "a sample was seen twice"


def test_zero1_checkpoint_continues_under_ddp(two_rank_runs):
    """ZeRO-1 saves each rank's optimizer partition under parameter names: the whole state."""
    _, runs = two_rank_runs
    assert [r["step"] for r in runs["zd"]] == list(range(HALF + 1, STEPS + 1))
    for record, reference in zip(runs["zd"], runs["u"][HALF:]):
        assert record["loss"] == pytest.approx(reference["loss"], rel=1e-5)
