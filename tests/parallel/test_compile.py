"""train.compile: the same losses as eager on each kind of region (the model and its loss
on one rank, blocks under FSDP, blocks per pipeline stage), no recompiles once steady,
unchanged parameter names, and a model that does not compile reported the way the
setting asks. Inductor compiles on CPU here: the runs are few and tiny."""

from __future__ import annotations

import json

import pytest
import torch

import meshyard
from meshyard.cli import main
from meshyard.models.gpt import GPT, GPTShape
from meshyard.parallel.activation_checkpoint import apply_ac, checkpointed_blocks
from meshyard.parallel.compile import Compilation, apply_compile, resolve_compile
from meshyard.train.precision import build_precision
from meshyard.train.step import CompileFailed, MicroBatchStep
from tests.conftest import tiny_config
from tests.models.user_models import untraceable

SHAPE = GPTShape(vocab_size=32, context_length=8, n_layer=3, n_head=2, d_model=16)
STEPS = 5
LAYOUTS = {
    "one process": (1, ["--parallel.strategy=none"]),
    "fsdp": (2, ["--parallel.strategy=fsdp"]),
    "pp2": (2, ["--parallel.strategy=none", "--parallel.pp=2", "--parallel.pp_schedule=1f1b"]),
}
UNCOMPILABLE = "--model.name=tests/models/user_models.py:untraceable"


def test_auto_compiles_on_cuda_only():
    assert resolve_compile("auto", torch.device("cuda")) and not resolve_compile("auto", torch.device("cpu"))
    assert resolve_compile(True, torch.device("cpu")) and not resolve_compile(False, torch.device("cuda"))


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


def _losses(result) -> list[float]:
    return [record["loss"] for record in result.metrics()]


@pytest.fixture(scope="module")
def eager(tmp_path_factory) -> list[float]:
    return _losses(meshyard.run(tiny_config(tmp_path_factory.mktemp("eager"), f"--train.steps={STEPS}",
                                            "--parallel.strategy=none"), nproc=1))


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_compiled_losses_equal_eager_ones_without_recompiling(tmp_path, eager, layout):
    nproc, overrides = LAYOUTS[layout]
    result = meshyard.run(tiny_config(tmp_path, f"--train.steps={STEPS}", "--train.compile=true", *overrides),
                          nproc=nproc)
    assert _losses(result) == pytest.approx(eager, rel=1e-5)
    facts = json.loads((result.run_dir / "run.json").read_text())
    assert facts["compiled"] == ("the model and its loss" if layout == "one process" else
                                 "Block x2" if layout == "fsdp" else "Block")  # each stage its blocks
    graphs = [record["compiled_graphs"] for record in result.metrics()]
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


def test_compile_setting_is_validated(capsys):
    assert main(["config", "show", "--train.compile=sometimes"]) == 2
    assert "train.compile = 'sometimes' is not one of 'auto', true, false" in capsys.readouterr().err
