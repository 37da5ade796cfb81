"""Pipeline parallelism on models meshyard has never seen: traced, cut before their blocks.

Standard: a nanoGPT-style model (blocks in a ModuleList inside a ModuleDict, tied head),
a Hugging Face GPT-2 (tied head, returns a ModelOutput) and a Hugging Face Llama
(rotary tables and a mask passed between stages) train under pp = 2 with the 1F1B and
GPipe schedules to per-step losses within 1e-5 (relative) of one process, and their
stages keep the full model's parameter names. The session's one 2-rank spawn
(``tests/shared_spawn.py``) fits every case in turn; the one-process baselines run in
this process (those of tests/parallel/test_user_models.py).

Refusals, asked before any worker starts: a forward that cannot be traced, fewer blocks
than stages, a pp_split that does not add up.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from meshyard.config.sections import ParallelConfig
from meshyard.parallel.pipeline import example_micro_batch, pp_problems, split_model
from tests import shared_spawn
from tests.conftest import tiny_config
from tests.inprocess import fitted
from tests.models import user_models
from tests.parallel.test_user_models import one_process_fits
from tests.pipeline_masks import PASS_MASKS_ON, can_train, skip_unless_trainable

USER_MODELS = Path(user_models.__file__).resolve()
MODELS = ("nanogpt", "hf_gpt2", "hf_llama")
SCHEDULES = ("1f1b", "gpipe")
STEPS = 3
LOSS_REL = 1e-5


def _overrides(model: str, *layout: str) -> tuple[str, ...]:
    return (f"--model.name={USER_MODELS}:{model}", f"--train.steps={STEPS}", "--precision.dtype=fp32", *layout)


CHECKPOINT = ("--checkpoint.enabled=true", "--checkpoint.interval=0", "--checkpoint.async_save=false",
              "--optim.schedule=constant")
PIPELINED = ("--parallel.strategy=none", "--parallel.pp=2")
INTERLEAVED = (*PIPELINED, "--parallel.pp_schedule=interleaved1f1b", "--parallel.pp_virtual_stages=2")


def _fit(folder: Path, overrides: tuple[str, ...], rank: int = 0, world_size: int = 1, resume: str = "auto") -> dict:
    trainer = fitted(tiny_config(folder, *overrides), folder / "run", rank, world_size, resume).trainer
    names = sorted(name for name, _ in trainer.model.named_parameters())
    return {"losses": list(trainer.progress.losses), "names": names}


def _pipelined_cases(rank: int, world_size: int, folder: str) -> dict:
    """Every (model, schedule) under pp = 2, one after another on these ranks; then Llama
    on 4 interleaved stages, and 2 steps of the nanoGPT that end in a checkpoint."""
    results: dict = {(model, schedule): _fit(Path(folder) / f"{model}-{schedule}",
                                             _overrides(model, *PIPELINED, f"--parallel.pp_schedule={schedule}"),
                                             rank, world_size)
                     for model in MODELS if can_train(model, PIPELINED) for schedule in SCHEDULES}
    if can_train("hf_llama", INTERLEAVED):
        results["interleaved"] = _fit(Path(folder) / "interleaved", _overrides("hf_llama", *INTERLEAVED), rank,
                                      world_size)
    results["checkpoint"] = _fit(Path(folder) / "checkpoint",
                                 (*_overrides("nanogpt", *PIPELINED, *CHECKPOINT), "--train.steps=2"), rank,
                                 world_size)
    return results


def _has_transformers() -> bool:
    return importlib.util.find_spec("transformers") is not None


shared_spawn.register(2, "pipeline_user_models: cases", __name__,
                      lambda request, folder: (_pipelined_cases, (str(folder),)) if _has_transformers() else None)


@pytest.fixture(scope="module")
def pipelined(request) -> tuple[Path, list[dict]]:
    """The folder of the cases, and what each rank fitted (in the session's one spawn of two ranks)."""
    pytest.importorskip("transformers")
    return shared_spawn.result(request, 2, "pipeline_user_models: cases")


@pytest.fixture(scope="module")
def single(request) -> dict:
    """Each model on one process: the runs tests/parallel/test_user_models.py holds its
    layouts to (trained once per test session)."""
    pytest.importorskip("transformers")
    return one_process_fits(request)


@pytest.mark.parametrize("schedule", SCHEDULES)
@pytest.mark.parametrize("model", MODELS)
def test_pp2_matches_one_process(pipelined, single, model, schedule):
    skip_unless_trainable(model, PIPELINED)
    first, last = (rank[(model, schedule)] for rank in pipelined[1])
    want = single[model]["losses"]
    assert len(last["losses"]) == len(want) == STEPS
    for got, expected in zip(last["losses"], want):
        assert got == pytest.approx(expected, rel=LOSS_REL)
    # The two stages hold the whole model under its own names (a tied weight on both).
    assert set(first["names"]) | set(last["names"]) == set(single[model]["names"]) | _tied_copies(model)
    assert not set(first["names"]) & set(last["names"])


def _tied_copies(model: str) -> set[str]:
    """The tied head's name, which one process lists under the embedding's only."""
    return {"lm_head.weight"} if model in ("nanogpt", "hf_gpt2") else set()


def test_interleaved_stages_receive_all_they_need_from_the_stage_before(pipelined, single):
    """4 stages on 2 ranks: Llama's rotary tables and mask, made before the first block,
    pass through the stages in between (the interleaved schedules only connect neighbours)."""
    skip_unless_trainable("hf_llama", INTERLEAVED)
    last = pipelined[1][1]["interleaved"]
    assert last["losses"] == pytest.approx(single["hf_llama"]["losses"], rel=LOSS_REL)


def test_a_pipelined_checkpoint_resumes_on_one_process(pipelined, tmp_path):
    """2 steps under pp = 2 saved (the tied head on both stages), step 3 on one process from
    that checkpoint: the trajectory of 3 uninterrupted steps on one process."""
    folder, results = pipelined
    one_process = (*_overrides("nanogpt", "--parallel.strategy=none", *CHECKPOINT),)
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    whole = _fit(tmp_path / "whole", one_process)
    resumed = _fit(tmp_path / "resumed", one_process, resume=str(folder / "checkpoint" / "run"))
    assert len(resumed["losses"]) == 1
    got = results[1]["checkpoint"]["losses"] + resumed["losses"]
    assert got == pytest.approx(whole["losses"], rel=LOSS_REL)


# --- refusals, before any worker starts ----------------------------------------------------------

def _problems(model: torch.nn.Module, **parallel: object) -> list[str]:
    return pp_problems(model, ParallelConfig(**parallel), int(parallel.get("pp", 2)), example_micro_batch(4, 2, 16))


def test_an_untraceable_forward_is_refused_naming_the_fix():
    with torch.device("meta"):
        model = user_models.untraceable(vocab_size=64, context_length=16)
    [problem] = _problems(model, pp=2)
    assert "tracing its forward with torch.export" in problem and "no Python branches" in problem
    assert "parallel.pp = 1" in problem


@pytest.mark.skipif(importlib.util.find_spec("transformers") is None, reason="needs transformers (the test extra)")
def test_on_a_torch_that_cannot_send_them_stages_passing_integers_on_are_refused(monkeypatch):
    """Before torch 2.13 a traced stage cannot receive a non-floating activation: a Hugging
    Face GPT-2 passes its attention mask (bool) from stage to stage, so it is refused before
    the run starts (its first step would fail on one rank and leave the other waiting); the
    nanoGPT passes floats only and is not."""
    from meshyard.parallel import pipeline_trace

    monkeypatch.setattr(pipeline_trace, "RECEIVES_NON_FLOAT", False)
    with torch.device("meta"):
        hf_model = user_models.hf_gpt2(vocab_size=64, context_length=16)
        nanogpt = user_models.nanogpt(vocab_size=64, context_length=16)
    [problem] = _problems(hf_model, pp=2)
    assert "GPT2LMHeadModel pass non-floating tensors on" in problem and "(bool)" in problem
    assert "torch 2.13 or later" in problem and "parallel.pp = 1" in problem
    assert _problems(nanogpt, pp=2) == []
    # The models whose pipelined cells the other tests skip on such a torch are those refused.
    for name in ("hf_opt", "hf_llama", "hf_neox", "hf_mistral"):
        with torch.device("meta"):
            model = getattr(user_models, name)(vocab_size=64, context_length=16)
        assert bool(_problems(model, pp=2)) == (name in PASS_MASKS_ON), name


def test_fewer_blocks_than_stages_and_a_wrong_split_are_refused():
    with torch.device("meta"):
        model = user_models.nanogpt(vocab_size=64, context_length=16, n_layer=2)
    [problem] = _problems(model, pp=4)
    assert "2 blocks, fewer than the 4 pipeline stages" in problem
    [problem] = _problems(model, pp=2, pp_split=[2, 1])
    assert "pp_split = [2, 1]" in problem and "summing to the model's 2 blocks" in problem
    assert _problems(model, pp=2) == []


def test_a_model_without_repeated_blocks_is_refused():
    with torch.device("meta"):
        model = torch.nn.Sequential(torch.nn.Embedding(64, 8), torch.nn.Linear(8, 64))
    [problem] = _problems(model, pp=2)
    assert "has none" in problem and "parallel.fsdp_units" in problem


def test_stages_traced_on_the_meta_device_keep_the_full_models_names():
    torch.manual_seed(0)
    with torch.device("meta"):
        model = user_models.nanogpt(vocab_size=64, context_length=16)
    full = {name for name, _ in model.named_parameters(remove_duplicate=False)}
    names = set()
    for rank in range(2):
        part = split_model(model, 2, rank, example_tokens=example_micro_batch(4, 2, 16),
                           device=torch.device("cpu"))
        names |= {name for name, _ in part.named_parameters()}
    assert names == full
