from __future__ import annotations

import pytest

from meshyard.runtime.batch_plan import BatchPlan, BatchPlanError


@pytest.mark.parametrize(
    "global_batch, dp, micro, accum, expected",
    [
        (32, 2, 0, 0, (16, 1)),
        (32, 2, 4, 0, (4, 4)),
        (32, 2, 0, 8, (2, 8)),
        (32, 4, 2, 4, (2, 4)),
        (8, 1, 1, 0, (1, 8)),
    ],
)
def test_derive(global_batch, dp, micro, accum, expected):
    plan = BatchPlan.derive(global_batch, dp, micro, accum)
    assert (plan.micro_batch, plan.grad_accum) == expected
    assert plan.micro_batch * plan.grad_accum * dp == global_batch


@pytest.mark.parametrize("args", [(30, 4, 0, 0), (32, 2, 5, 0), (32, 2, 0, 3), (32, 2, 4, 2), (0, 1, 0, 0)])
def test_impossible(args):
    with pytest.raises(BatchPlanError):
        BatchPlan.derive(*args)
