from __future__ import annotations

import pytest

from meshyard.runtime.parallel_dims import ParallelDims, ParallelDimsError


@pytest.mark.parametrize(
    "strategy, world, replicate, shard, expected",
    [
        ("ddp", 4, 0, 0, (4, 1)),
        ("zero1", 2, 0, 0, (2, 1)),
        ("fsdp", 4, 0, 0, (1, 4)),
        ("fsdp", 4, 2, 0, (2, 2)),
        ("fsdp", 8, 0, 4, (1, 4)),  # invalid below: 1 x 4 != 8
        ("none", 1, 0, 0, (1, 1)),
    ],
)
def test_resolve(strategy, world, replicate, shard, expected):
    if expected[0] * expected[1] != world:
        with pytest.raises(ParallelDimsError, match="do not multiply to the world size 8"):
            ParallelDims.resolve(strategy, world, replicate, shard)
        return
    dims = ParallelDims.resolve(strategy, world, replicate, shard)
    assert (dims.dp_replicate, dims.dp_shard) == expected
    assert dims.dp == world


def test_rejects_zero_and_bad_products():
    with pytest.raises(ParallelDimsError, match="must be at least 1"):
        ParallelDims(dp_replicate=1, dp_shard=1, tp=0, pp=1, world_size=1)
    with pytest.raises(ParallelDimsError, match="dp_replicate=3 x dp_shard=1"):
        ParallelDims(dp_replicate=3, dp_shard=1, tp=1, pp=1, world_size=2)


def test_context_parallel_ranks_are_not_data_parallel():
    dims = ParallelDims.resolve("fsdp", 8, cp=2)
    assert (dims.dp_shard, dims.cp, dims.dp) == (4, 2, 4)
    dims = ParallelDims.resolve("ddp", 4, cp=2, tp=2)
    assert (dims.dp_replicate, dims.dp) == (1, 1)
    with pytest.raises(ParallelDimsError, match=r"dp_shard=2 x cp=2 x tp=1 x pp=1 = 4 do not multiply to the world size 6"):
        ParallelDims(dp_replicate=1, dp_shard=2, tp=1, pp=1, world_size=6, cp=2)
