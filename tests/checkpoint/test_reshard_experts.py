"""Checkpoints of a mixture-of-experts model move between expert-parallel degrees.

Expert weights are saved as DTensors sharded over the experts (and by FSDP over the rest),
under the names and global shapes of the model, so DCP reshards them on load. One run goes
ep = 2 -> 4 -> 2 x tp = 2 -> 1 -> 2 in segments on four ranks, each segment resuming the
last one's checkpoint (into and out of ep x tp, where attention and the shared expert are
split over tp as well), then ep = 2 -> one process with no parallelism at all; every
segment continues the loss trajectory of a run that trained without stopping.
"""

from __future__ import annotations

from pathlib import Path

import pytest

import meshyard
from tests import shared_spawn
from tests.checkpoint.test_reshard import job, run_dir
from tests.inprocess import fit_jobs

SEGMENT = 2
EP_CHAIN = ((2, 1), (4, 1), (2, 2), (1, 1), (2, 1))  # (ep, tp) of each segment, on four ranks
MOE = ("--model.moe_experts=4", "--model.moe_top_k=2", "--model.moe_shared_experts=1", "--train.micro_batch=2",
       "--metrics.mfu=false")


def _name(index: int, ep: int, tp: int) -> str:
    return f"seg{index}-ep{ep}-tp{tp}"


def _segment(folder: Path, index: int, ep: int, tp: int):
    return job(folder, _name(index, ep, tp), *MOE, "--parallel.strategy=fsdp", f"--parallel.ep={ep}",
               f"--parallel.tp={tp}", f"--train.steps={SEGMENT * (index + 1)}")


def _chain(request: pytest.FixtureRequest, folder: Path) -> tuple:
    """The uninterrupted run, then each segment resuming the one before it."""
    whole = job(folder, "whole", *MOE, "--parallel.strategy=fsdp", "--parallel.ep=2",
                f"--train.steps={SEGMENT * (len(EP_CHAIN) + 1)}")
    jobs, previous = [(whole, "none")], "none"
    for index, (ep, tp) in enumerate(EP_CHAIN):
        jobs.append((_segment(folder, index, ep, tp), previous))
        previous = run_dir(folder, _name(index, ep, tp))
    return fit_jobs, (jobs,)


shared_spawn.register(4, "reshard: expert-parallel degrees", __name__, _chain)


def _read(folder: Path, name: str) -> list[dict]:
    from meshyard.metrics.records import read_metrics

    return read_metrics(run_dir(folder, name))


def test_segments_on_other_ep_degrees_continue_the_same_training(request):
    folder, _ = shared_spawn.result(request, 4, "reshard: expert-parallel degrees")
    whole = _read(folder, "whole")
    for index, (ep, tp) in enumerate(EP_CHAIN):
        records = _read(folder, _name(index, ep, tp))
        assert [r["step"] for r in records] == list(range(SEGMENT * index + 1, SEGMENT * (index + 1) + 1))
        for record in records:
            assert record["loss"] == pytest.approx(whole[record["step"] - 1]["loss"], rel=1e-5), (index, ep, tp)
    # The last segment's checkpoint (ep = 2 on four ranks) into one process without FSDP:
    # accumulating the same micro-batches of two samples, it continues the same training.
    last = run_dir(folder, _name(len(EP_CHAIN) - 1, *EP_CHAIN[-1]))
    steps = SEGMENT * (len(EP_CHAIN) + 1)
    single = job(folder, "single", *MOE, "--parallel.strategy=none", f"--train.steps={steps}")
    records = meshyard.run(single, nproc=1, resume=last).metrics()
    assert [r["step"] for r in records] == list(range(steps - SEGMENT + 1, steps + 1))
    for record in records:
        assert record["loss"] == pytest.approx(whole[record["step"] - 1]["loss"], rel=1e-5)
