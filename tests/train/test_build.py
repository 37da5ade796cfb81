"""``build_trainer`` in-process: one rank in the test process, two in the session's shared spawn."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from meshyard.checkpoint.checkpointer import Checkpointer
from meshyard.metrics.records import read_metrics
from meshyard.runtime.distributed import Runtime
from meshyard.train.build import build_trainer
from meshyard.train.step import MicroBatchStep
from tests import shared_spawn
from tests.conftest import tiny_config
from tests.inprocess import cpu_runtime


@pytest.fixture
def one_rank():
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    yield cpu_runtime()
    dist.destroy_process_group()


def test_a_trainer_built_in_process_trains_and_records(one_rank, tmp_path):
    cfg = tiny_config(tmp_path, "--train.steps=6", "--parallel.strategy=none")
    built = build_trainer(cfg, one_rank, tmp_path / "run")
    trainer = built.trainer
    assert isinstance(trainer.runner, MicroBatchStep) and isinstance(trainer.checkpoints, Checkpointer)
    try:
        summary = trainer.fit()
    finally:
        trainer.close()
    assert summary["steps"] == 6 and summary["final_loss"] < summary["first_loss"]
    records = read_metrics(tmp_path / "run")
    assert [r["step"] for r in records] == list(range(1, 7))
    assert built.facts.strategy == "none" and built.facts.parameters > 0 and built.facts.resumed_from is None
    record = built.facts.record()  # run.json's entries, flat
    assert record["strategy"] == "none" and "resumed_from" not in record and record["hosts"] == list(built.facts.hosts)


def _losses(trainer) -> list[float]:
    try:
        trainer.fit()
    finally:
        trainer.close()
    return trainer.progress.losses


def test_a_rebuilt_trainer_resumes_exactly_from_the_checkpointer(one_rank, tmp_path):
    """A 6-step run saves at steps 3 and 6; with step 6 removed, a fresh trainer on the
    same run directory loads step 3 through the same Checkpointer, and its steps 4-6
    match the first trainer's bit for bit (dropout on: the RNG state is restored too)."""
    cfg = tiny_config(tmp_path, "--train.steps=6", "--parallel.strategy=none", "--checkpoint.enabled=true",
                      "--checkpoint.interval=3", "--checkpoint.async_save=false", "--model.dropout=0.1")
    run_dir = tmp_path / "run"
    full = _losses(build_trainer(cfg, one_rank, run_dir).trainer)
    shutil.rmtree(run_dir / "checkpoints" / "step-00000006")
    resumed = build_trainer(cfg, one_rank, run_dir)
    assert resumed.trainer.progress.step == 3 and resumed.facts.resumed_from.step == 3
    assert resumed.facts.record()["resumed_from"]["checkpoint"].endswith("step-00000003")
    assert _losses(resumed.trainer) == full[3:]


def test_a_part_added_to_the_bundle_is_saved_and_restored(one_rank, tmp_path):
    class Counter:
        def __init__(self) -> None:
            self.value = 0

        def state_dict(self) -> dict:
            return {"value": self.value}

        def load_state_dict(self, state: dict) -> None:
            self.value = state["value"]

    cfg = tiny_config(tmp_path, "--parallel.strategy=none", "--checkpoint.enabled=true",
                      "--checkpoint.async_save=false", "--train.steps=2")
    trainer = build_trainer(cfg, one_rank, tmp_path / "run").trainer
    counter = trainer.checkpoints.state.shared["counter"] = Counter()
    counter.value = 41
    _losses(trainer)  # saves the final checkpoint, with the counter
    rebuilt = build_trainer(cfg, one_rank, tmp_path / "other").trainer
    restored = rebuilt.checkpoints.state.shared["counter"] = Counter()
    point = rebuilt.checkpoints.choose(str(tmp_path / "run"), str(tmp_path / "other" / "checkpoints"), False,
                                       print, 1)
    rebuilt.checkpoints.load(point)
    rebuilt.close()
    assert restored.value == 41 and rebuilt.progress.step == 2


# name -> (overrides, the step runner and the data-parallel wrapping its ranks must build)
TWO_RANK_LAYOUTS = {
    "fsdp": (("--parallel.strategy=fsdp",), "MicroBatchStep", "fsdp"),
    "zero1": (("--parallel.strategy=zero1",), "MicroBatchStep", "ddp"),
    "ddp-pp2": (("--parallel.strategy=ddp", "--parallel.pp=2", "--parallel.microbatches=2"), "PipelineStep", "fsdp"),
}


def _two_rank_layouts(rank: int, world_size: int, tmp: str, layouts: dict[str, tuple[str, ...]]) -> dict[str, dict]:
    """Each layout built and trained in turn on these ranks (one spawn for all of them)."""
    results = {}
    for name, overrides in layouts.items():
        cfg = tiny_config(Path(tmp) / name, *overrides)
        trainer = build_trainer(cfg, cpu_runtime(rank, world_size), Path(tmp) / name / "run").trainer
        layout = trainer.layout
        losses = _losses(trainer)
        results[name] = {"runner": type(trainer.runner).__name__, "data_parallel": layout.data_parallel,
                         "zero1": layout.zero1, "losses": losses}
        dist.barrier()  # both ranks are done with this layout before the next one starts
    return results


shared_spawn.register(2, "build: layouts", __name__, lambda request, folder: (
    _two_rank_layouts, (str(folder), {name: overrides for name, (overrides, _, _) in TWO_RANK_LAYOUTS.items()})))


@pytest.fixture(scope="module")
def two_rank_builds(request) -> list[dict[str, dict]]:
    """Per rank, what it built and trained for each layout of TWO_RANK_LAYOUTS (in the
    session's one spawn of two ranks)."""
    return shared_spawn.result(request, 2, "build: layouts")[1]


@pytest.mark.parametrize("layout", list(TWO_RANK_LAYOUTS))
def test_two_ranks_build_the_layout_they_were_given(two_rank_builds, layout):
    overrides, runner, data_parallel = TWO_RANK_LAYOUTS[layout]
    results = [rank_results[layout] for rank_results in two_rank_builds]
    assert {r["runner"] for r in results} == {runner}
    assert {r["data_parallel"] for r in results} == {data_parallel}
    assert results[0]["zero1"] == ("--parallel.strategy=zero1" in overrides)
    assert results[0]["losses"] == results[1]["losses"] and len(results[0]["losses"]) == 4


def test_a_build_that_fails_leaves_no_watchdog_running(tmp_path):
    """A failure after the watchdog started (here: the model builder raises) stops it, or
    an in-process caller would get a false start-up hang report much later."""
    import threading

    (tmp_path / "builders.py").write_text("def build(vocab_size):\n    raise ValueError('no model today')\n")
    cfg = tiny_config(tmp_path, "--parallel.strategy=none", f"--model.name={tmp_path / 'builders.py'}:build")
    store = dist.HashStore()
    dist.init_process_group("gloo", store=store, rank=0, world_size=1)
    runtime = Runtime(rank=0, world_size=1, local_rank=0, device=torch.device("cpu"), backend="gloo", store=store)
    try:
        with pytest.raises(ValueError, match="no model today"):
            build_trainer(cfg, runtime, tmp_path / "run")
    finally:
        dist.destroy_process_group()
    assert not [t for t in threading.enumerate() if t.name.startswith("meshyard-watchdog") and t.is_alive()]


def test_latest_is_resolved_by_the_launcher_not_here(one_rank, tmp_path):
    from meshyard.checkpoint.resume import ResumeError

    with pytest.raises(ResumeError, match="run.name"):
        build_trainer(tiny_config(tmp_path, "--parallel.strategy=none"), one_rank, tmp_path / "run", resume="latest")


def test_cuda_graphs_without_a_cuda_device_build_a_step_without_them_and_say_so(one_rank, tmp_path, capsys):
    """train.cuda_graphs with run.device 'auto' on a machine without CUDA (validate refuses an
    explicit 'cpu'): the model and its loss compile as asked, without graphs, after one line."""
    cfg = tiny_config(tmp_path, "--train.steps=2", "--parallel.strategy=none", "--train.compile=true",
                      "--train.cuda_graphs=true")
    built = build_trainer(cfg, one_rank, tmp_path / "run")
    try:
        compilation = built.trainer.runner.compilation
        assert compilation.enabled and not compilation.graphs
        assert compilation.describe() == "the model and its loss"
    finally:
        built.trainer.close()
    assert "train.cuda_graphs: no CUDA device (training on cpu)" in capsys.readouterr().out
