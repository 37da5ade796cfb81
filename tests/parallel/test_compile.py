"""train.compile: the same losses as eager on each kind of region (the model and its loss
on one rank, blocks under FSDP, blocks per pipeline stage), no recompiles once steady,
unchanged parameter names, and a model that does not compile reported the way the
setting asks. Inductor compiles on CPU here: the runs are few and tiny."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

import meshyard
from meshyard.cli import main
from meshyard.config.sections import Config
from meshyard.models import linear_cross_entropy
from meshyard.models.gpt import GPT, GPTShape
from meshyard.parallel.activation_checkpoint import apply_ac, checkpointed_blocks
from meshyard.parallel.compile import (Compilation, apply_compile, compiled_graphs, inductor_options,
                                      resolve_compile)
from meshyard.train.precision import build_precision
from meshyard.train.step import CompileFailed, MicroBatchStep
from meshyard.validate import validate
from tests import shared_spawn
from tests.conftest import tiny_config
from tests.inprocess import fit_each_with_facts, records_and_facts
from tests.models.user_models import untraceable

SHAPE = GPTShape(vocab_size=32, context_length=8, n_layer=3, n_head=2, d_model=16)
STEPS = 5
LAYOUTS = {
    "one process": (1, ["--parallel.strategy=none"]),
    "one process, fused loss": (1, ["--parallel.strategy=none", "--train.fused_linear_loss=true"]),
    "fsdp": (2, ["--parallel.strategy=fsdp"]),
    "pp2": (2, ["--parallel.strategy=none", "--parallel.pp=2", "--parallel.pp_schedule=1f1b"]),
}
UNCOMPILABLE = "--model.name=tests/models/user_models.py:untraceable"


def test_auto_compiles_on_cuda_only():
    assert resolve_compile("auto", torch.device("cuda")) and not resolve_compile("auto", torch.device("cpu"))
    assert resolve_compile(True, torch.device("cpu")) and not resolve_compile(False, torch.device("cuda"))


def test_kernel_tuning_is_an_inductor_option_when_asked(monkeypatch):
    asked = []
    compile_ = torch.compile
    monkeypatch.setattr(torch, "compile",
                        lambda fn, **kwargs: asked.append(kwargs["options"]) or compile_(fn, **kwargs))
    Compilation(True).compile_function(lambda x: x, "identity")
    Compilation(True, inductor_options(True)).compile_function(lambda x: x, "identity")
    assert asked == [None, {"coordinate_descent_tuning": True}]  # what torch.compile is given
    assert inductor_options(False) == {}
    tuned = inductor_options(True)
    # Names Inductor knows: torch.compile rejects unknown options only at the first call.
    import torch._inductor.config as inductor_config

    assert tuned and set(tuned) <= set(inductor_config.get_config_copy())
    graphed = inductor_options(False, cuda_graphs=True)
    assert graphed == {"triton.cudagraphs": True} and set(graphed) <= set(inductor_config.get_config_copy())
    assert inductor_options(True, cuda_graphs=True) == {**tuned, **graphed}
    compilation = Compilation(True, tuned)
    apply_compile(GPT(SHAPE), compilation)
    assert compilation.describe() == "Block x3 (tuned kernels)"
    assert Compilation(True, tuned).describe() == ""  # nothing compiled, nothing tuned


def test_compiling_blocks_keeps_names_and_checkpointing_and_reverts():
    model = apply_ac(GPT(SHAPE), "full")
    names = [name for name, _ in model.state_dict().items()]
    compilation = Compilation(True)
    apply_compile(model, compilation)
    assert compilation.describe() == "Block x3" and checkpointed_blocks(model) == 3
    assert list(model.state_dict()) == names  # no _orig_mod: checkpoints, verify and export unchanged
    compilation.revert()
    assert not compilation.enabled and checkpointed_blocks(model) == 3
    assert all("forward" in vars(block) for block in model.blocks)  # the checkpointing wrapper is back
    plain = GPT(SHAPE)
    compilation = Compilation(True)
    apply_compile(plain, compilation)
    compilation.revert()
    assert not any("forward" in vars(block) for block in plain.blocks)


def _config(folder: Path, *overrides: str) -> Config:
    return tiny_config(folder, f"--train.steps={STEPS}", *overrides)


@pytest.fixture(scope="module")
def eager(tmp_path_factory) -> list[float]:
    result = meshyard.run(_config(tmp_path_factory.mktemp("eager"), "--parallel.strategy=none"), nproc=1)
    return [record["loss"] for record in result.metrics()]


TWO_RANK_LAYOUTS = [name for name, (nproc, _) in LAYOUTS.items() if nproc == 2]


def _two_rank_configs(folder: Path) -> list[Config]:
    return [_config(folder / name, "--train.compile=true", *LAYOUTS[name][1]) for name in TWO_RANK_LAYOUTS]


def _fit_compiled(rank: int, world_size: int, configs: list[Config]) -> tuple[int, list[dict]]:
    """The graphs this process had compiled before (Dynamo counts a whole process's), and
    each config's facts after fitting it."""
    return compiled_graphs(), fit_each_with_facts(rank, world_size, configs)


def _two_rank_job(request: pytest.FixtureRequest, folder: Path) -> tuple:
    configs = _two_rank_configs(folder)
    for cfg in configs:
        validate(cfg, 2)
    return _fit_compiled, (configs,)


shared_spawn.register(2, "compile: layouts", __name__, _two_rank_job)


@pytest.fixture(scope="module")
def two_rank_runs(request) -> dict[str, tuple[list[int], list[float], str]]:
    """Per 2-rank layout, its compiled run's per-step graph counts and losses, and what was
    compiled (the fact a launched run writes to run.json): the layouts one after another
    in the session's one spawn of two ranks."""
    folder, per_rank = shared_spawn.result(request, 2, "compile: layouts")
    before, facts = per_rank[0]
    runs = {}
    for name, (records, run_facts) in zip(TWO_RANK_LAYOUTS, records_and_facts(_two_rank_configs(folder), facts)):
        # The process's count goes on from run to run: each run's own starts where the last ended.
        graphs = [record["compiled_graphs"] - before for record in records]
        runs[name] = (graphs, [record["loss"] for record in records], run_facts["compiled"])
        before += graphs[-1]
    return runs


def _compiled_run(layout: str, folder: Path, request: pytest.FixtureRequest) -> tuple[list[int], list[float], str]:
    """Per-step graph counts and losses of ``layout`` trained compiled, and what run.json
    says was compiled. One process runs as a user launches it (in this process)."""
    if LAYOUTS[layout][0] > 1:
        return request.getfixturevalue("two_rank_runs")[layout]
    result = meshyard.run(_config(folder, "--train.compile=true", *LAYOUTS[layout][1]), nproc=1)
    records = result.metrics()
    return ([record["compiled_graphs"] for record in records], [record["loss"] for record in records],
            json.loads((result.run_dir / "run.json").read_text())["compiled"])


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_compiled_losses_equal_eager_ones_without_recompiling(tmp_path, request, eager, layout, monkeypatch):
    if "fused" in layout:  # 4 blocks of 64 rows (of 256 tokens, vocabulary 256) unrolled in the region
        monkeypatch.setattr(linear_cross_entropy, "BLOCK_ELEMENTS", 64 * 256)
    graphs, losses, what = _compiled_run(layout, tmp_path, request)
    assert losses == pytest.approx(eager, rel=1e-5)
    assert what == ("the model and its loss" if layout.startswith("one process") else
                    "Block x2" if layout == "fsdp" else "Block")  # each stage its blocks
    assert graphs[0] >= 1 and len(set(graphs[1:])) == 1, graphs  # compiled in step 1 (and 2), never again


def test_a_model_that_does_not_compile_falls_back_or_stops_as_asked():
    def runner(requested):
        torch.manual_seed(0)
        model = untraceable(32, 8, n_layer=2)
        warnings: list[str] = []
        precision = build_precision(torch.float32, torch.device("cpu"), False, False)
        step = MicroBatchStep(model, precision, torch.device("cpu"), compilation=Compilation(requested),
                              compile_whole=True, report=warnings.append)
        return model, step, warnings

    tokens = torch.randint(0, 32, (2, 9), generator=torch.Generator().manual_seed(1))
    batch = [(tokens[:, :-1], tokens[:, 1:])]
    model, step, warnings = runner("auto")
    loss = step.forward_backward(batch)
    assert len(warnings) == 1 and "the model and its loss could not be compiled" in warnings[0], warnings
    assert not step.compilation.enabled
    eager_model, _, _ = runner(False)
    eager_loss = MicroBatchStep(eager_model, step.precision, torch.device("cpu")).forward_backward(batch)
    assert loss.item() == pytest.approx(eager_loss.item(), rel=1e-6)
    for (name, param), eager_param in zip(model.named_parameters(), eager_model.parameters()):
        torch.testing.assert_close(param.grad, eager_param.grad, msg=name)  # the failed attempt left nothing
    _, strict, _ = runner(True)
    with pytest.raises(CompileFailed, match=r"train.compile = true, but torch.compile could not compile the model "
                                            r"and its loss: .*Set train.compile = false"):
        strict.forward_backward(batch)


def test_a_mixture_of_experts_that_does_not_trace_whole_falls_back_or_stops_as_asked():
    """Its routing splits tokens by counts read on the host: tracing fails on that data-dependent
    size, which is a compile failure like any other ('auto' trains eagerly, true says so)."""
    from meshyard.models.moe import MoEShape

    shape = GPTShape(vocab_size=32, context_length=8, n_layer=1, n_head=2, d_model=16,
                     moe=MoEShape(experts=4, top_k=2))
    precision = build_precision(torch.float32, torch.device("cpu"), False, False)
    tokens = torch.randint(0, 32, (2, 9), generator=torch.Generator().manual_seed(1))
    batch = [(tokens[:, :-1], tokens[:, 1:])]
    warnings: list[str] = []
    step = MicroBatchStep(GPT(shape), precision, torch.device("cpu"), compilation=Compilation("auto"),
                          compile_whole=True, report=warnings.append)
    assert torch.isfinite(step.forward_backward(batch))
    assert len(warnings) == 1 and "could not be compiled" in warnings[0] and not step.compilation.enabled
    strict = MicroBatchStep(GPT(shape), precision, torch.device("cpu"), compilation=Compilation(True),
                            compile_whole=True)
    with pytest.raises(CompileFailed, match="train.compile = true, but torch.compile could not compile"):
        strict.forward_backward(batch)


def test_compile_setting_is_validated(capsys):
    assert main(["config", "show", "--train.compile=sometimes"]) == 2
    assert "train.compile = 'sometimes' is not one of 'auto', true, false" in capsys.readouterr().err
