"""``meshyard verify``'s comparison for context parallelism: cp = 2 and cp = 4, cp x fsdp
and cp x tp on 4 ranks, cp under 'ddp' (cp x tp too), and a Hugging Face Llama under
cp = 2, each trained as the command trains it and compared with one process by
``compare_runs``.

The layout runs share the session's spawns of 2 and 4 ranks (``tests.shared_spawn``);
the one-process runs train here, one per model and micro-batch size."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

from meshyard.validate import load_and_validate
from meshyard.verify import VerifyReport, tolerance_for
from meshyard.verify.compare import _for_comparison, compare_runs, describe_layout, single_process
from tests import shared_spawn
from tests.inprocess import fit_each_with_facts, fit_here
from tests.models import user_models

STEPS = 3
TINY = ["--model.name=gpt-tiny", "--data.source=random", "--data.seq_len=32", "--data.random_tokens=65536",
        "--train.global_batch=8", "--optim.warmup_steps=2", "--metrics.progress_bar=false", "--metrics.mfu=false"]
LLAMA = [f"--model.name={Path(user_models.__file__)}:hf_llama"]
HAS_TRANSFORMERS = importlib.util.find_spec("transformers") is not None

CASES: dict[str, tuple[int, list[str]]] = {
    "cp2": (2, ["--parallel.strategy=fsdp", "--parallel.cp=2"]),
    "llama-cp2": (2, [*LLAMA, "--parallel.strategy=fsdp", "--parallel.cp=2"]),
    "cp4": (4, ["--parallel.strategy=fsdp", "--parallel.cp=4"]),
    "cp2-fsdp2": (4, ["--parallel.strategy=fsdp", "--parallel.cp=2"]),
    "cp2-tp2": (4, ["--parallel.strategy=fsdp", "--parallel.cp=2", "--parallel.tp=2"]),
    # 'ddp': DDP over the cp ranks; with tp, FSDP2 replication over them (DDP takes no DTensors).
    "cp2-ddp": (2, ["--parallel.strategy=ddp", "--parallel.cp=2"]),
    # The head and the loss fused: each rank's mean from its hidden states, summed over the ring.
    "cp2-fused-loss": (2, ["--parallel.strategy=fsdp", "--parallel.cp=2", "--train.fused_linear_loss=true"]),
    "cp2-tp2-ddp": (4, ["--parallel.strategy=ddp", "--parallel.cp=2", "--parallel.tp=2"]),
}


def _wanted(world_size: int) -> list[str]:
    return [case for case, (ranks, layout) in CASES.items()
            if ranks == world_size and (HAS_TRANSFORMERS or LLAMA[0] not in layout)]


def _configs(folder: Path, cases: list[str]) -> list:
    """Each case's config as ``meshyard verify`` runs its layout, in ``folder/<case>``."""
    configs = []
    for case in cases:
        ranks, layout = CASES[case]
        cfg, _ = load_and_validate(None, [*TINY, *layout, f"--run.nproc={ranks}", f"--data.cache_dir={folder}"])
        configs.append(_for_comparison(cfg, STEPS, folder / case / "layout"))
    return configs


for _world in (2, 4):
    shared_spawn.register(_world, f"verify context_parallel: {_world} ranks", __name__,
                          lambda request, folder, world=_world: (fit_each_with_facts,
                                                                 (_configs(folder, _wanted(world)),)))


@pytest.fixture(scope="module")
def single_runs(tmp_path_factory) -> dict:
    """One-process runs, trained on first use, by (model, micro-batch size): shared by the
    cases they are the reference of."""
    return {"folder": tmp_path_factory.mktemp("single")}


def _single_run(single_runs: dict, cfg, micro_batch: int) -> Path:
    key = f"{Path(cfg.model.name).name}-{micro_batch}".replace(":", "_")
    if key not in single_runs:
        run_dir = single_runs["folder"] / key
        fit_here(_for_comparison(single_process(cfg, micro_batch), STEPS, run_dir))
        single_runs[key] = run_dir
    return single_runs[key]


@pytest.mark.parametrize("case", list(CASES))
def test_context_parallel_trains_as_one_process(request, single_runs, case):
    """Losses, gradient norms and final parameters within ``meshyard verify``'s fp32 thresholds."""
    world, layout = CASES[case]
    if case not in _wanted(world):
        pytest.skip("needs transformers")
    folder, _ = shared_spawn.result(request, world, f"verify context_parallel: {world} ranks")
    cfg, checked = load_and_validate(None, [*TINY, *layout, f"--run.nproc={world}", f"--data.cache_dir={folder}"])
    precision, tolerance = tolerance_for(cfg.run, cfg.precision)
    report = VerifyReport(precision, tolerance, describe_layout(cfg.parallel, world, checked.dims))
    single = _single_run(single_runs, cfg, checked.batch.micro_batch)
    report = compare_runs(single, folder / case / "layout", report)
    assert report.passed and len(report.steps) == STEPS, report.format()
    assert f"cp {cfg.parallel.cp}" in report.layout
