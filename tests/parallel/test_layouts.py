"""Tensor, pipeline and hybrid layouts train the same model as one process.

Same standard as tests/train/test_parity.py: per-step losses within 1e-5 relative and
gradient norms within 1e-4 (fp32) of a single process with the same seed and global
batch. A 4-block GPT so that interleaved schedules get 2 stages per rank.
"""

from __future__ import annotations

from pathlib import Path

import pytest

import meshyard
from meshyard.config.sections import Config
from tests.conftest import tiny_config
from tests.inprocess import fit_on_ranks
from tests.train.test_parity import DATA, assert_close

STEPS = 4
MODEL = ("--model.n_layer=4", "--train.eval_every=2", "--train.eval_batches=2")


def _config(folder: Path, *overrides: str) -> Config:
    return tiny_config(folder, *DATA, *MODEL, f"--train.steps={STEPS}", *overrides)


def _values(records: list[dict]) -> tuple[list[tuple[float, float]], list[float]]:
    """Per-step (loss, grad norm), and the evaluation losses (every 2 steps)."""
    assert [r["step"] for r in records] == list(range(1, STEPS + 1))
    return [(r["loss"], r["grad_norm"]) for r in records], [r["eval_loss"] for r in records if "eval_loss" in r]


@pytest.fixture(scope="module")
def baseline(tmp_path_factory) -> tuple[list[tuple[float, float]], list[float]]:
    """One process, launched as a user launches it (the layouts are built in-process)."""
    cfg = _config(tmp_path_factory.mktemp("single"), "--parallel.strategy=none")
    values, evals = _values(meshyard.run(cfg, nproc=1).metrics())
    assert values[-1][0] < values[0][0] and len(evals) == STEPS // 2
    return values, evals


LAYOUTS = {
    "tp2": (2, ["--parallel.strategy=none", "--parallel.tp=2"]),  # loss parallel on (the default)
    "tp2-gathered-logits": (2, ["--parallel.strategy=none", "--parallel.tp=2", "--parallel.loss_parallel=false"]),
    "pp2-gpipe": (2, ["--parallel.strategy=none", "--parallel.pp=2", "--parallel.pp_schedule=gpipe"]),
    "pp2-1f1b-accum": (2, ["--parallel.strategy=none", "--parallel.pp=2", "--parallel.pp_schedule=1f1b",
                           "--parallel.microbatches=4", "--train.grad_accum=2"]),
    "pp2-interleaved": (2, ["--parallel.strategy=none", "--parallel.pp=2", "--parallel.pp_schedule=interleaved1f1b",
                            "--parallel.pp_virtual_stages=2"]),
    "pp2-zerobubble": (2, ["--parallel.strategy=none", "--parallel.pp=2", "--parallel.pp_schedule=zerobubble",
                           "--parallel.pp_virtual_stages=2", "--parallel.microbatches=4"]),
    "fsdp2-cpu-offload": (2, ["--parallel.strategy=fsdp", "--parallel.cpu_offload=true"]),
    "fsdp2xtp2": (4, ["--parallel.strategy=fsdp", "--parallel.tp=2"]),
    "ddp2xtp2": (4, ["--parallel.strategy=ddp", "--parallel.tp=2"]),  # replicated with FSDP2
    "hsdp2x2": (4, ["--parallel.strategy=fsdp", "--parallel.dp_replicate=2"]),
    "pp2xfsdp2": (4, ["--parallel.strategy=fsdp", "--parallel.pp=2"]),
    "pp2xddp2": (4, ["--parallel.strategy=ddp", "--parallel.pp=2"]),
    "pp2xtp2-ac": (4, ["--parallel.strategy=none", "--parallel.pp=2", "--parallel.tp=2", "--parallel.ac=full"]),
}


@pytest.fixture(scope="module")
def layout_values(tmp_path_factory) -> dict[str, tuple[list[tuple[float, float]], list[float]]]:
    """Every layout trained in-process: those of each world size one after another in one
    spawn of that many ranks."""
    root = tmp_path_factory.mktemp("layouts")
    values = {}
    for world_size in sorted({nproc for nproc, _ in LAYOUTS.values()}):
        names = [name for name, (nproc, _) in LAYOUTS.items() if nproc == world_size]
        configs = [_config(root / name, *LAYOUTS[name][1]) for name in names]
        values.update({name: _values(records) for name, records in zip(names, fit_on_ranks(configs, world_size))})
    return values


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_layout_matches_single_process(layout_values, baseline, layout):
    _, overrides = LAYOUTS[layout]
    values, evals = layout_values[layout]
    assert_close(values, baseline[0])
    if not any(o.startswith("--train.grad_accum") for o in overrides):
        # Evaluation runs through the same layout (a forward-only schedule under pipelining);
        # it reads eval_batches x micro_batch samples, so only equal micro-batches compare.
        assert evals == pytest.approx(baseline[1], rel=1e-5)


def test_pipeline_step_reports_idle_fraction(tmp_path):
    """The runner measures its stages' idle share beside the schedule's theory."""
    from tests.ranks import run_on_ranks
    from tests.parallel.scenarios import pipeline_stats

    stats = run_on_ranks(pipeline_stats, world_size=2)
    for rank_stats in stats:
        assert 0.0 <= rank_stats["pp_idle_fraction"] < 1.0
        assert rank_stats["pp_bubble_theory"] == pytest.approx(1 / 5)  # p = 2, m = 4
        assert rank_stats["pp_compute_s"] > 0
