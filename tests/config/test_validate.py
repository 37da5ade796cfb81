from __future__ import annotations

import pytest

from meshyard.config.load import ConfigError, load_config
from meshyard.config.validate import validate


def problems_of(world_size: int, *overrides: str) -> list[str]:
    with pytest.raises(ConfigError) as info:
        validate(load_config(None, list(overrides)), world_size)
    return info.value.problems


def test_valid_default_layouts():
    layout = validate(load_config(None, ["--train.global_batch=32", "--train.micro_batch=4"]), 2)
    assert (layout.dims.dp_replicate, layout.dims.dp_shard, layout.dims.dp) == (2, 1, 2)
    assert (layout.batch.micro_batch, layout.batch.grad_accum) == (4, 4)
    hsdp = validate(load_config(None, ["--parallel.strategy=fsdp", "--parallel.dp_replicate=2"]), 4)
    assert (hsdp.dims.dp_replicate, hsdp.dims.dp_shard) == (2, 2)


def test_degrees_that_do_not_multiply_to_world_size():
    [problem] = problems_of(4, "--parallel.strategy=fsdp", "--parallel.dp_replicate=2", "--parallel.dp_shard=3")
    assert "do not multiply to the world size 4" in problem and "--nproc" in problem


def test_global_batch_not_divisible():
    [problem] = problems_of(2, "--train.global_batch=30", "--train.micro_batch=4")
    assert "not divisible by train.micro_batch = 4 x data-parallel size 2" in problem
    [problem] = problems_of(4, "--train.global_batch=6")
    assert "not divisible by the data-parallel size 4" in problem


def test_micro_batch_and_accumulation_disagree():
    [problem] = problems_of(2, "--train.global_batch=32", "--train.micro_batch=4", "--train.grad_accum=2")
    assert "differs from train.global_batch = 32" in problem


def test_impossible_combinations_collected_together():
    problems = problems_of(
        2, "--parallel.strategy=none", "--model.name=gtp-mini", "--model.d_model=100", "--model.n_head=3",
        "--data.source=text", "--data.seq_len=256", "--model.context_length=128", "--optim.betas=[0.9]",
    )
    text = "\n".join(problems)
    assert "did you mean 'gpt-mini'" in text
    assert "d_model = 100 is not divisible by model.n_head = 3" in text
    assert "data.source = 'text' needs data.paths" in text
    assert "context_length = 128 is shorter than data.seq_len = 256" in text
    assert "optim.betas" in text
    assert "'none' runs one process but the world size is 2" in text
    assert len(problems) == 6


def test_shard_degree_needs_fsdp():
    [problem] = problems_of(2, "--parallel.strategy=ddp", "--parallel.dp_shard=2")
    assert "needs parallel.strategy = 'fsdp'" in problem
