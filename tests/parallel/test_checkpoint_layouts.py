"""Checkpoints move between model-parallel and other layouts: TP -> none, PP -> FSDP.

Parameter names stay those of the full model under TP (DTensors of the full shape) and
under PP (each stage keeps its blocks' global indices), so DCP reshards on load and the
resumed run continues the trajectory of an uninterrupted single process.
"""

from __future__ import annotations

import pytest

import meshyard
from tests.conftest import tiny_config

STEPS, HALF = 6, 3
# Each pipeline rank's optimizer holds other parameters, but DCP keeps one copy of the
# (non-tensor) ``param_groups`` list, the coordinator's; loading then misses the other
# stages' parameters. meshyard.checkpoint.state needs
# StateDictOptions(flatten_optimizer_state_dict=True) in get_state_dict/set_state_dict
# (checked by hand: a 2-stage checkpoint then loads on 1 process with its Adam state).
COMMON = ("--checkpoint.enabled=true", "--checkpoint.interval=0", "--checkpoint.async_save=false",
          "--optim.schedule=constant")


def job(tmp_path, name: str, steps: int, *overrides: str):
    return tiny_config(tmp_path / name, *COMMON, f"--train.steps={steps}", *overrides)


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("whole")
    return meshyard.run(job(tmp, "u", STEPS, "--parallel.strategy=none"), nproc=1).metrics()


@pytest.mark.parametrize(
    "first, second",
    [((2, ["--parallel.strategy=none", "--parallel.tp=2"]), (1, ["--parallel.strategy=none"])),
     ((2, ["--parallel.strategy=none", "--parallel.pp=2"]), (2, ["--parallel.strategy=fsdp"])),
     ((4, ["--parallel.strategy=ddp", "--parallel.tp=2"]), (1, ["--parallel.strategy=none"]))],
    ids=["tp-to-none", "pp-to-fsdp", "ddp-x-tp-to-none"],
)
def test_checkpoint_continues_on_another_layout(tmp_path, uninterrupted, first, second):
    (n1, o1), (n2, o2) = first, second
    before = meshyard.run(job(tmp_path, "a", HALF, *o1), nproc=n1)
    after = meshyard.run(job(tmp_path, "b", STEPS, *o2), nproc=n2, resume=str(before.run_dir))
    records = after.metrics()
    assert [r["step"] for r in records] == list(range(HALF + 1, STEPS + 1))
    for record, reference in zip(before.metrics() + records, uninterrupted):
        assert record["loss"] == pytest.approx(reference["loss"], rel=1e-5)
