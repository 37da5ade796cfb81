"""Validation of model.moe_* and parallel.ep: what expert parallelism needs, named clearly."""

from __future__ import annotations

import pytest

from meshyard.cli import main
from meshyard.config.load import load_config
from meshyard.runtime.parallel_dims import ParallelDims, ParallelDimsError
from meshyard.validate import validate
from tests.parallel.test_parallel_config import problems_of

MOE = ("--model.name=gpt-tiny", "--model.moe_experts=4")


def test_ep_takes_its_ranks_from_the_sharded_data_parallel_degree():
    layout = validate(load_config(None, ["--data.source=random", *MOE, "--parallel.strategy=fsdp",
                                         "--parallel.ep=2", "--train.global_batch=8"]), 4)
    assert (layout.dims.dp_shard, layout.dims.ep, layout.dims.dp) == (4, 2, 4)
    assert layout.batch.per_rank_batch == 2  # experts split, the batch still over all four ranks
    assert layout.layout.facts()["ep"] == 2


def test_ep_combines_with_tp_over_the_remaining_data_parallel_ranks():
    layout = validate(load_config(None, ["--data.source=random", *MOE, "--parallel.strategy=fsdp", "--parallel.tp=2",
                                         "--parallel.ep=2", "--train.global_batch=8"]), 4)
    assert (layout.dims.dp_shard, layout.dims.tp, layout.dims.ep, layout.dims.dp) == (2, 2, 2, 2)


@pytest.mark.parametrize("world, overrides, message", [
    (2, ["--parallel.strategy=fsdp", "--parallel.ep=2"], "but the model has none"),
    (2, [*MOE[:1], "--model.moe_experts=3", "--parallel.strategy=fsdp", "--parallel.ep=2"],
     "model.moe_experts = 3 is not divisible by parallel.ep = 2"),
    (2, [*MOE, "--parallel.strategy=ddp", "--parallel.ep=2"], "needs parallel.strategy = 'fsdp'"),
    (4, [*MOE, "--parallel.strategy=fsdp", "--parallel.dp_replicate=2", "--parallel.ep=4"],
     "does not divide the sharded data-parallel degree dp_shard = 2"),
    (2, [*MOE, "--parallel.strategy=none", "--parallel.pp=2"], "does not combine with parallel.pp = 2"),
    (2, [*MOE, "--parallel.strategy=fsdp", "--parallel.cp=2"], "does not combine with parallel.cp = 2"),
    (1, [*MOE, "--model.moe_top_k=5"], "must be between 1 and model.moe_experts = 4"),
    (1, [*MOE, "--model.moe_capacity_factor=-1"], "must not be negative (0 is dropless)"),
    (1, ["--model.name=mlp", "--model.moe_experts=4"], "gives meshyard's GPT experts"),
])
def test_bad_expert_settings_are_named(world, overrides, message):
    problems = problems_of(world, *overrides)
    assert any(message in p for p in problems), problems


def test_ep_must_divide_dp_shard():
    with pytest.raises(ParallelDimsError, match="parallel.ep = 3 does not divide"):
        ParallelDims(dp_replicate=1, dp_shard=4, tp=1, pp=1, world_size=4, ep=3)


def test_bad_ep_exits_2_from_the_command_line(capsys, tmp_path):
    assert main(["run", "--nproc", "2", *MOE, "--parallel.strategy=ddp", "--parallel.ep=2",
                 f"--run.dir={tmp_path}"]) == 2
    err = capsys.readouterr().err
    assert "needs parallel.strategy = 'fsdp'" in err and "Traceback" not in err
