"""A layout the model cannot take is refused by ``validate``, before any worker starts,
from the model built on the meta device; a builder that fails is reported as such."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from meshyard.config.load import ConfigError, load_config
from meshyard.parallel.inspect import layout_problems
from meshyard.runtime.parallel_dims import ParallelDims
from meshyard.validate import validate
from tests.models import user_models

USER_MODELS = Path(user_models.__file__).resolve()
GRU = Path(__file__).resolve().parents[2] / "examples" / "custom_model.py"


def problems_of(world_size: int, *overrides: str) -> list[str]:
    cfg = load_config(None, ["--data.seq_len=32", "--train.global_batch=8", *overrides])
    with pytest.raises(ConfigError) as info:
        validate(cfg, world_size)
    return info.value.problems


def passes(world_size: int, *overrides: str) -> None:
    validate(load_config(None, ["--data.seq_len=32", "--train.global_batch=8", *overrides]), world_size)


def test_heads_not_divisible_by_tp_are_refused():
    [problem] = problems_of(2, f"--model.name={USER_MODELS}:nanogpt", "--model.options={ n_head = 3 }",
                            "--parallel.strategy=none", "--parallel.tp=2")
    assert "n_head = 3" in problem and "not divisible by parallel.tp = 2" in problem
    passes(2, f"--model.name={USER_MODELS}:nanogpt", "--parallel.strategy=none", "--parallel.tp=2")


def test_tp_on_a_model_without_a_plan_names_the_three_ways_to_give_one():
    [problem] = problems_of(2, f"--model.name={GRU}:build_model", "--parallel.strategy=none", "--parallel.tp=2")
    assert "no tensor-parallel plan for CharRNN" in problem
    assert "tensor_parallel_plan(tp_mesh)" in problem and "[parallel.tp_plan]" in problem


def test_pp_on_a_model_that_cannot_be_cut_is_refused_quietly(capsys):
    """torch.export prints the graph of a failed trace and logs about it: not on the console."""
    [problem] = problems_of(2, f"--model.name={USER_MODELS}:untraceable", "--parallel.strategy=none",
                            "--parallel.pp=2")
    assert "parallel.pp" in problem and "trace" in problem
    assert capsys.readouterr().err == ""
    passes(2, f"--model.name={USER_MODELS}:nanogpt", "--parallel.strategy=none", "--parallel.pp=2")


def test_fsdp_units_naming_an_unknown_class_are_refused_for_any_model():
    [problem] = problems_of(2, f"--model.name={USER_MODELS}:nanogpt", "--parallel.strategy=fsdp",
                            '--parallel.fsdp_units=["Blok"]')
    assert "parallel.fsdp_units" in problem and "did you mean 'Block'" in problem
    [problem] = problems_of(2, "--model.name=gpt-tiny", '--parallel.fsdp_units=["Blok"]')
    assert "no module of GPT has class 'Blok'" in problem


def test_model_problems_come_with_every_other_problem():
    problems = problems_of(2, f"--model.name={GRU}:build_model", "--parallel.strategy=none", "--parallel.tp=2",
                           "--train.steps=0")
    assert len(problems) == 2 and any("train.steps" in p for p in problems)


def write_builder(tmp_path: Path, body: str) -> str:
    path = tmp_path / "builders.py"
    path.write_text("import torch\nfrom torch import nn\n\n\n" + body)
    return str(path)


def test_a_builder_that_raises_is_reported_with_its_line(tmp_path):
    path = write_builder(tmp_path, "def build(vocab_size):\n    raise ValueError('width must be even')\n")
    [problem] = problems_of(2, f"--model.name={path}:build", "--parallel.strategy=fsdp")
    assert problem.startswith(f"model.name = '{path}:build': building the model failed: ValueError: width must "
                              "be even (at builders.py:6 in build); fix the builder")


def test_a_layout_that_asks_nothing_of_the_model_does_not_build_it(tmp_path):
    """Under DDP the workers build the model; a failing builder fails there (one paragraph)."""
    path = write_builder(tmp_path, "def build(vocab_size):\n    raise ValueError('width must be even')\n")
    passes(2, f"--model.name={path}:build", "--parallel.strategy=ddp")


def test_a_builder_that_cannot_run_on_meta_is_left_to_the_workers(tmp_path, capsys):
    path = write_builder(tmp_path, "def build(vocab_size):\n    model = nn.Linear(4, vocab_size)\n"
                                   "    assert model.weight.abs().sum().item() > 0\n    return model\n")
    passes(2, f"--model.name={path}:build", "--parallel.strategy=fsdp")
    assert "cannot run on the meta device" in capsys.readouterr().err


def test_layout_problems_of_one_model_at_once():
    with torch.device("meta"):
        model = user_models.nanogpt(64, 32, n_head=3)
    cfg = load_config(None, ['--parallel.fsdp_units=["Blok"]', "--parallel.ac=full"]).parallel
    problems = layout_problems(model, cfg, ParallelDims(dp_replicate=1, dp_shard=1, tp=2, pp=1, world_size=2))
    assert len(problems) == 2 and "fsdp_units" in problems[0] and "n_head = 3" in problems[1]
