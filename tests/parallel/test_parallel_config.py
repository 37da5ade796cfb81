"""Validation of the tensor/pipeline fields of [parallel]: every problem named at once."""

from __future__ import annotations

import pytest

from meshyard.config.load import ConfigError, load_config
from meshyard.validate import validate


def problems_of(world_size: int, *overrides: str) -> list[str]:
    try:
        validate(load_config(None, ["--data.source=random", *overrides]), world_size)
    except ConfigError as exc:
        return exc.problems
    return []


def test_valid_hybrid_layouts_resolve():
    layout = validate(load_config(None, ["--parallel.strategy=fsdp", "--parallel.tp=2", "--parallel.pp=2",
                                         "--train.global_batch=8"]), 8)
    assert (layout.dims.pp, layout.dims.dp_shard, layout.dims.tp) == (2, 2, 2)
    assert layout.batch.per_rank_batch == 4  # the batch is split over data-parallel ranks only
    assert problems_of(2, "--parallel.strategy=none", "--parallel.tp=2") == []


@pytest.mark.parametrize("overrides, message", [
    (["--parallel.strategy=none", "--parallel.tp=3"], "do not multiply to the world size"),
    (["--parallel.strategy=none", "--parallel.pp=2", "--parallel.pp_schedule=interleaved1f1b"],
     "set parallel.pp_virtual_stages"),
    (["--parallel.strategy=none", "--parallel.pp=2", "--parallel.pp_virtual_stages=2"], "needs parallel.pp_schedule"),
    (["--parallel.strategy=none", "--parallel.pp=2", "--parallel.pp_split=[1]"], "one positive block count per stage"),
    (["--parallel.strategy=none", "--parallel.pp=2", "--parallel.microbatches=3", "--train.global_batch=8"],
     "does not divide the 8 samples"),
    (["--parallel.strategy=none", "--parallel.tp=2", "--data.seq_len=33"], "not divisible by parallel.tp = 2"),
    (["--parallel.strategy=zero1", "--parallel.tp=2", "--parallel.dp_replicate=1"], "zero1' does not combine"),
    (["--parallel.strategy=none", "--parallel.pp=2", "--comm.compression=fp16"], "not supported with parallel.pp"),
    (["--parallel.strategy=ddp", "--parallel.cpu_offload=true"], "set parallel.strategy = 'fsdp'"),
])
def test_bad_combinations_are_named(overrides, message):
    problems = problems_of(2, *overrides)
    assert any(message in p for p in problems), problems


def test_fsdp_on_one_rank_shards_nothing_and_runs_unwrapped_unless_offloading():
    """One rank has nothing to shard: DTensor parameters would only slow its optimizer."""
    alone = validate(load_config(None, ["--data.source=random", "--parallel.strategy=fsdp"]), 1).layout
    assert alone.shards_nothing and alone.data_parallel == "none" and not alone.meta_init
    assert alone.effective_cfg.strategy == "none" and alone.facts()["strategy"] == "fsdp"
    offloading = validate(load_config(None, ["--data.source=random", "--parallel.strategy=fsdp",
                                             "--parallel.cpu_offload=true"]), 1).layout
    assert not offloading.shards_nothing and offloading.data_parallel == "fsdp"
    two = validate(load_config(None, ["--data.source=random", "--parallel.strategy=fsdp"]), 2).layout
    assert not two.shards_nothing and two.data_parallel == "fsdp" and two.meta_init
