"""Models meshyard has never seen train the same under every layout as on one process.

The acceptance matrix: a nanoGPT-style model, a Hugging Face GPT-2 and a Hugging Face
Llama (``tests/models/user_models.py``, tiny configs, fp32) under DDP, FSDP (ZeRO-3 and
ZeRO-2), FSDP with full activation checkpointing, tp=2, pp=2 (2 ranks) and FSDP x TP
(4 ranks); each cell's per-step losses must lie within 1e-5 (relative) of the same
config on one process.

Cheap by construction: the session's one 2-rank spawn (``tests/shared_spawn.py``) builds
and fits a trainer for every 2-rank cell in sequence, its one 4-rank spawn does the FSDP
x TP cells, and the one-process baselines run in this process, once per session (the
pipeline tests use them too); each (model, layout) cell is then its own test reading
those results.
A cell that raises is recorded with its error (type, message, where it was raised) and the
spawn goes on with the next cell; a spawn that hangs is ended by a deadline inside each
rank, and the cells it had not finished are reported as such.
"""

from __future__ import annotations

import importlib.util
import json
import os
import threading
import time
import traceback
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from meshyard.parallel.activation_checkpoint import checkpointed_blocks
from meshyard.parallel.data_parallel import unwrap
from tests import shared_spawn
from tests.conftest import tiny_config
from tests.inprocess import fitted
from tests.pipeline_masks import can_train, skip_unless_trainable

USER_MODELS = Path(__file__).resolve().parents[1] / "models" / "user_models.py"
MODELS = ("nanogpt", "hf_gpt2", "hf_llama")
STEPS = 3
LOSS_REL = 1e-5
SPAWN_DEADLINE_S = 600.0  # far above the measured time: only a hung collective reaches it

TWO_RANK_LAYOUTS = {
    "ddp": ("--parallel.strategy=ddp",),
    "fsdp": ("--parallel.strategy=fsdp",),
    "fsdp_zero2": ("--parallel.strategy=fsdp", "--parallel.reshard_after_forward=false"),
    "fsdp_ac_full": ("--parallel.strategy=fsdp", "--parallel.ac=full"),
    "tp2": ("--parallel.strategy=none", "--parallel.tp=2"),
    "pp2": ("--parallel.strategy=none", "--parallel.pp=2"),
}
FOUR_RANK_LAYOUTS = {"fsdp_x_tp": ("--parallel.strategy=fsdp", "--parallel.tp=2")}
# What each layout must have done on a rank: degrees, whether parameters became DTensors
# (FSDP shards, TP splits), whether the blocks recompute their activations.
N_BLOCKS = 4
EXPECTED = {
    "ddp": ({"strategy": "ddp", "dp_shard": 1, "tp": 1, "pp": 1}, False, 0),
    "fsdp": ({"strategy": "fsdp", "dp_shard": 2, "tp": 1, "pp": 1}, True, 0),
    "fsdp_zero2": ({"strategy": "fsdp", "dp_shard": 2, "tp": 1, "pp": 1}, True, 0),
    "fsdp_ac_full": ({"strategy": "fsdp", "dp_shard": 2, "tp": 1, "pp": 1}, True, N_BLOCKS),
    "tp2": ({"strategy": "none", "dp_shard": 1, "tp": 2, "pp": 1}, True, 0),
    "pp2": ({"strategy": "none", "dp_shard": 1, "tp": 1, "pp": 2}, False, 0),
    "fsdp_x_tp": ({"strategy": "fsdp", "dp_shard": 2, "tp": 2, "pp": 1}, True, 0),
}
ONE_PROCESS = ("--parallel.strategy=none",)


def _overrides(model: str, layout: tuple[str, ...]) -> tuple[str, ...]:
    return (f"--model.name={USER_MODELS}:{model}", f"--train.steps={STEPS}", "--precision.dtype=fp32", *layout)


def _available(model: str) -> bool:
    """Hugging Face cells need transformers (the test extra installs it)."""
    if not model.startswith("hf_"):
        return True
    return importlib.util.find_spec("transformers") is not None


def _cases(layouts: dict[str, tuple[str, ...]], session: pytest.Session) -> list[tuple[str, tuple[str, ...]]]:
    """The cells of ``layouts`` that this session selected (``-k hf_llama`` spawns only those)."""
    ours = [item for item in session.items
            if getattr(item, "module", None) is not None and item.module.__name__ == __name__]
    selected = {(item.callspec.params["model"], item.callspec.params["layout"]) for item in ours
                if hasattr(item, "callspec") and item.callspec.params.get("layout") in layouts}
    return [(f"{model}-{name}", _overrides(model, overrides))
            for model in MODELS if _available(model) for name, overrides in layouts.items()
            if (model, name) in selected and can_train(model, overrides)]


def _describe_error(error: BaseException) -> str:
    """Type, message, the innermost frame and the innermost one in meshyard: enough to
    say which part failed where."""
    frames = traceback.extract_tb(error.__traceback__)
    ours = [f for f in frames if "/meshyard/" in f.filename or "/tests/" in f.filename]
    shown = [frames[-1]] if not ours or ours[-1] is frames[-1] else [frames[-1], ours[-1]]
    where = " called from ".join(f"{f.filename}:{f.lineno} in {f.name}" for f in shown)
    message = " ".join(str(error).split())[:600]
    return f"{type(error).__name__}: {message} (at {where})"


def _fit(cfg, rank: int, world_size: int, run_dir: Path) -> dict:
    """The per-step losses of a trainer fitted on ``cfg``, and what its layout did to the
    model on this rank (so that a cell cannot pass by training some other layout)."""
    built = fitted(cfg, run_dir, rank, world_size)
    model, facts = unwrap(built.trainer.model), built.facts
    return {"losses": list(built.trainer.progress.losses),
            "layout": {"strategy": facts.strategy, "dp_shard": facts.dp_shard, "tp": facts.tp, "pp": facts.pp},
            "dtensor_params": sum(isinstance(p, DTensor) for p in model.parameters()),
            "checkpointed_blocks": checkpointed_blocks(model) if facts.pp == 1 else 0}


def _run_case(rank: int, world_size: int, folder: Path, case: str, overrides: tuple[str, ...]) -> dict:
    start = time.perf_counter()
    try:
        result = _fit(tiny_config(folder / case, *overrides), rank, world_size, folder / case / "run")
    except Exception as error:  # recorded per cell; the next cell still runs
        result = {"error": _describe_error(error)}
    result["seconds"] = time.perf_counter() - start
    # Every rank learns every rank's outcome, so a cell that failed on one rank only fails
    # on all, and the ranks start the next cell together.
    outcomes: list[dict] = [{}] * world_size
    dist.all_gather_object(outcomes, result)
    failed: dict[str, list[str]] = {}
    for index, outcome in enumerate(outcomes):
        if "error" in outcome:
            failed.setdefault(outcome["error"], []).append(str(index))
    if not failed:
        return outcomes[-1]  # the last rank holds the loss under pipelining too
    return {"error": "; ".join(f"rank {', '.join(ranks)}: {error}" for error, ranks in failed.items()),
            "seconds": result["seconds"]}


def _fit_cases(rank: int, world_size: int, folder: str, cases: list[tuple[str, tuple[str, ...]]]) -> dict:
    """Every case in turn on this rank; the results so far are written after each one,
    and a deadline ends this rank (and so the spawn) should a collective hang."""
    deadline = threading.Timer(SPAWN_DEADLINE_S, lambda: os._exit(3))
    deadline.daemon = True
    deadline.start()
    results: dict[str, dict] = {}
    for case, overrides in cases:
        results[case] = _run_case(rank, world_size, Path(folder), case, overrides)
        if rank == 0:
            (Path(folder) / "results.json").write_text(json.dumps(results))
    deadline.cancel()
    return results


# World size -> (the name of its job in the session's shared spawn, its layouts)
JOBS = {2: ("user_models: two-rank cells", TWO_RANK_LAYOUTS), 4: ("user_models: four-rank cells", FOUR_RANK_LAYOUTS)}


def _job(layouts: dict[str, tuple[str, ...]]) -> shared_spawn.JobMaker:
    """The cells of ``layouts`` that this session selected, as a job for the shared spawn."""
    def make(request: pytest.FixtureRequest, folder: Path) -> tuple | None:
        cases = _cases(layouts, request.session)
        return (_fit_cases, (str(folder), cases)) if cases else None
    return make


shared_spawn.register(2, JOBS[2][0], __name__, _job(TWO_RANK_LAYOUTS))
shared_spawn.register(4, JOBS[4][0], __name__, _job(FOUR_RANK_LAYOUTS))


def _results(request: pytest.FixtureRequest, world_size: int) -> dict:
    """Per cell of this world size, its rank-0 result; where a rank died or hung, the cells
    finished before (rank 0 wrote them after each), the others reported as not finished."""
    name, layouts = JOBS[world_size]
    try:
        _, per_rank = shared_spawn.result(request, world_size, name)
        results = per_rank[0]
    except shared_spawn.JobFailed as failed:
        partial = failed.folder / "results.json"
        results = json.loads(partial.read_text()) if partial.exists() else {}
        for case, _ in _cases(layouts, request.session):
            results.setdefault(case, {"error": f"not finished: the {world_size}-rank spawn ended with {failed}"})
    print(f"\n{world_size}-rank cells: " + ", ".join(f"{case} {cell.get('seconds', 0):.1f}s"
                                                  for case, cell in results.items()))
    return results


@pytest.fixture(scope="module")
def two_rank_results(request) -> dict:
    return _results(request, 2)


@pytest.fixture(scope="module")
def four_rank_results(request) -> dict:
    return _results(request, 4)


ONE_PROCESS_FITS = pytest.StashKey[dict[str, dict]]()


def one_process_fits(request: pytest.FixtureRequest) -> dict[str, dict]:
    """Each available model trained on one process (a 1-rank group in this process), same
    seed and batch: its per-step losses and parameter names. The pipeline tests
    (tests/parallel/test_pipeline_user_models.py) hold their stages to the same runs, so
    these are trained once per test session (kept in the session's stash)."""
    stash = request.config.stash
    if ONE_PROCESS_FITS not in stash:
        folder = request.getfixturevalue("tmp_path_factory").mktemp("one-process")
        fits = {}
        for model in filter(_available, MODELS):
            dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
            try:
                trainer = fitted(tiny_config(folder / model, *_overrides(model, ONE_PROCESS)), folder / model / "run").trainer
            finally:
                dist.destroy_process_group()
            fits[model] = {"losses": list(trainer.progress.losses),
                           "names": sorted(name for name, _ in trainer.model.named_parameters())}
        stash[ONE_PROCESS_FITS] = fits
    return stash[ONE_PROCESS_FITS]


@pytest.fixture(scope="module")
def baselines(request) -> dict[str, list[float]]:
    """Each model's per-step losses on one process, same seed and batch."""
    return {model: fit["losses"] for model, fit in one_process_fits(request).items()}


def _check_cell(model: str, layout: str, results: dict, baselines: dict[str, list[float]]) -> None:
    if not _available(model):
        pytest.skip("needs transformers (pip install 'meshyard[hf]')")
    skip_unless_trainable(model, {**TWO_RANK_LAYOUTS, **FOUR_RANK_LAYOUTS}[layout])
    cell = results[f"{model}-{layout}"]
    if cell.get("error"):
        pytest.fail(f"{model} under {layout}: {cell['error']}", pytrace=False)
    layout_facts, distributed, checkpointed = EXPECTED[layout]
    assert cell["layout"] == layout_facts
    assert (cell["dtensor_params"] > 0) == distributed and cell["checkpointed_blocks"] == checkpointed
    expected, actual = baselines[model], cell["losses"]
    assert len(actual) == len(expected) == STEPS
    worst = max(abs(a - e) / abs(e) for a, e in zip(actual, expected))
    assert worst <= LOSS_REL, f"{model} under {layout}: losses {actual} vs one process {expected} (rel {worst:.1e})"


@pytest.mark.parametrize("layout", TWO_RANK_LAYOUTS)
@pytest.mark.parametrize("model", MODELS)
def test_two_rank_layout_matches_one_process(model, layout, two_rank_results, baselines):
    _check_cell(model, layout, two_rank_results, baselines)


@pytest.mark.parametrize("layout", FOUR_RANK_LAYOUTS)
@pytest.mark.parametrize("model", MODELS)
def test_four_rank_layout_matches_one_process(model, layout, four_rank_results, baselines):
    _check_cell(model, layout, four_rank_results, baselines)


def test_the_one_process_baselines_learn(baselines):
    """The reference itself trains (a broken baseline would make every cell meaningless)."""
    for model, losses in baselines.items():
        assert len(losses) == STEPS and all(torch.isfinite(torch.tensor(losses))), model
