"""The data position a checkpoint carries: the step, the global batch and what decides the
order of samples, so a resume under another order is refused instead of training some
samples twice and others never."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest

from meshyard.data.sampling import GlobalBatchSampler, SpanOrder
from meshyard.train.state import DataPosition, TrainProgress


def position(order: SpanOrder | None, step: int = 0) -> DataPosition:
    sampler = GlobalBatchSampler(400, 8, 2, 0, 1, seed=3, order=order)
    data = SimpleNamespace(sampler=sampler, seek=lambda s: setattr(sampler, "start_step", s))
    return DataPosition(data, SimpleNamespace(global_batch=8), TrainProgress(step=step))


def spans(lanes: int) -> SpanOrder:
    return SpanOrder(np.arange(0, 401, 50), 8, lanes, seed=3, description=f"spans of 50, {lanes} lanes")


def test_the_order_travels_with_the_position_and_another_one_is_refused():
    saved = position(spans(8), step=5).state_dict()
    assert saved["order"] == "spans of 50, 8 lanes"
    resumed = position(spans(8))
    resumed.load_state_dict(saved)
    assert resumed.data.sampler.start_step == 5
    with pytest.raises(ValueError, match=r"another order \(spans of 50, 8 lanes\) than this run's \(spans of 50, 4 "
                                         r"lanes\).*data.shuffle_span_shards and data.shuffle_lanes"):
        position(spans(4)).load_state_dict(saved)
    with pytest.raises(ValueError, match=r"\(shuffled over all samples\) than this run's \(spans of 50, 8 lanes\)"):
        position(spans(8)).load_state_dict(position(None, step=5).state_dict())


def test_a_checkpoint_that_recorded_no_order_shuffled_over_all_samples():
    saved = position(None, step=3).state_dict()
    del saved["order"]
    position(None).load_state_dict(saved)  # as before
    with pytest.raises(ValueError, match="another order"):
        position(spans(8)).load_state_dict(saved)
