"""Checkpoints move between model-parallel and other layouts: TP -> none, PP -> FSDP.

Parameter names stay those of the full model under TP (DTensors of the full shape) and
under PP (each stage keeps its blocks' global indices), so DCP reshards on load and the
resumed run continues the trajectory of an uninterrupted single process.
"""

from __future__ import annotations

import pytest

import meshyard
from tests.conftest import tiny_config
from tests.inprocess import fit_in_order

STEPS, HALF = 6, 3
# Each pipeline rank's optimizer holds other parameters, but DCP keeps one copy of the
# (non-tensor) ``param_groups`` list, the coordinator's; loading then misses the other
# stages' parameters. meshyard.checkpoint.state needs
# StateDictOptions(flatten_optimizer_state_dict=True) in get_state_dict/set_state_dict
# (checked by hand: a 2-stage checkpoint then loads on 1 process with its Adam state).
COMMON = ("--checkpoint.enabled=true", "--checkpoint.interval=0", "--checkpoint.async_save=false",
          "--optim.schedule=constant")
NONE = ["--parallel.strategy=none"]
# name: layout of the first half, layout of the second half that resumes from it
LAYOUTS = {
    "tp-to-none": ([*NONE, "--parallel.tp=2"], NONE),
    "pp-to-fsdp": ([*NONE, "--parallel.pp=2"], ["--parallel.strategy=fsdp"]),
    "ddp-x-tp-to-none": (["--parallel.strategy=ddp", "--parallel.tp=2"], NONE),
}


def job(tmp_path, name: str, steps: int, *overrides: str):
    return tiny_config(tmp_path / name, *COMMON, f"--train.steps={steps}", *overrides)


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("whole")
    return meshyard.run(job(tmp, "u", STEPS, *NONE), nproc=1).metrics()


@pytest.fixture(scope="module")
def halves(tmp_path_factory):
    """Each layout's (first half, second half) records. What is under test is what a
    checkpoint holds and how it loads, not how ranks are launched, so the halves train
    in-process: TP's and PP's first halves and FSDP's second half in one spawn of 2 ranks,
    DDP x TP's first half in one of 4, the second halves on 1 rank in this process."""
    tmp = tmp_path_factory.mktemp("layouts")
    first = {name: job(tmp / name, "a", HALF, *before) for name, (before, _) in LAYOUTS.items()}
    second = {name: job(tmp / name, "b", STEPS, *after) for name, (_, after) in LAYOUTS.items()}
    resume = {name: str(cfg.run.run_dir) for name, cfg in first.items()}
    tp, pp, pp_then_fsdp = fit_in_order([(first["tp-to-none"], "none"), (first["pp-to-fsdp"], "none"),
                                         (second["pp-to-fsdp"], resume["pp-to-fsdp"])], world_size=2)
    (ddp_x_tp,) = fit_in_order([(first["ddp-x-tp-to-none"], "none")], world_size=4)

    def on_one_rank(name: str):
        return meshyard.run(second[name], nproc=1, resume=resume[name]).metrics()

    return {"tp-to-none": (tp, on_one_rank("tp-to-none")), "pp-to-fsdp": (pp, pp_then_fsdp),
            "ddp-x-tp-to-none": (ddp_x_tp, on_one_rank("ddp-x-tp-to-none"))}


@pytest.mark.parametrize("name", LAYOUTS)
def test_checkpoint_continues_on_another_layout(uninterrupted, halves, name):
    before, after = halves[name]
    assert [r["step"] for r in after] == list(range(HALF + 1, STEPS + 1))
    for record, reference in zip(before + after, uninterrupted):
        assert record["loss"] == pytest.approx(reference["loss"], rel=1e-5)
