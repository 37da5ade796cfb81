"""The guard's decisions on plain numbers: warm-up, the robust reference, bad steps in a
row, the rollback limit and the lowered learning rate, replayed steps, and its checkpoint
state."""

from __future__ import annotations

import pytest

from meshyard.config.sections import GuardConfig
from meshyard.data.sampling import GlobalBatchSampler
from meshyard.fault.guard import GuardStop, SpikeGuard


def _guard(**fields) -> SpikeGuard:
    return SpikeGuard(GuardConfig(enabled=True, **{"window": 5, "warmup_steps": 3, "spike_mads": 3.0, **fields}))


def _next(guard: SpikeGuard, loss: float, grad_norm: float):
    """The verdict on the step after the last one judged (no rollback in between)."""
    return guard.judge(guard.last_judged + 1, loss, grad_norm)


def test_spikes_count_only_after_warm_up_and_non_finite_values_always():
    guard = _guard()
    assert _next(guard, 100.0, 1.0).keep  # no reference yet: any finite loss is kept
    assert _next(guard, float("nan"), 1.0).reason == "non-finite loss"
    assert _next(guard, 1.0, float("inf")).reason == "non-finite gradient norm"
    for loss in (2.0, 2.1):
        assert _next(guard, loss, 1.0).keep
    # Kept: 100, 2.0, 2.1 -> median 2.1, MAD 0.1 -> threshold 2.4.
    assert guard.threshold() == pytest.approx(2.4)
    spike = _next(guard, 2.5, 1.0)
    assert (spike.keep, spike.reason, spike.in_a_row, spike.roll_back) == (False, "loss spike", 1, False)
    assert _next(guard, 2.3, 1.0).keep and guard.in_a_row == 0  # a good step ends the run of bad ones


def test_a_flat_loss_is_not_a_spike_at_every_wobble():
    guard = _guard()
    for _ in range(5):
        _next(guard, 3.0, 1.0)
    assert guard.threshold() == pytest.approx(3.0 + 3.0 * 0.003)  # the spread's floor, not zero
    assert _next(guard, 3.005, 1.0).keep


def test_bad_steps_in_a_row_ask_for_a_rollback_until_the_limit():
    guard = _guard(bad_in_a_row=2, max_rollbacks=1, lr_factor=0.5, lr_steps=2)
    assert not _next(guard, float("nan"), 1.0).roll_back
    assert _next(guard, float("nan"), 1.0).roll_back
    guard.start_rollback(step=7, to_step=5)
    assert (guard.rollbacks, guard.in_a_row, guard.lr_factor()) == (1, 0, 0.5)
    _next(guard, 1.0, 1.0), _next(guard, 1.0, 1.0)
    assert guard.lr_factor() == 1.0  # back to the schedule after lr_steps kept steps
    _next(guard, float("nan"), 1.0), _next(guard, float("nan"), 1.0)
    with pytest.raises(GuardStop, match=r"^the spike and NaN guard stopped the run at step 9: 2 bad steps in a row "
                                        r".*guard.max_rollbacks = 1 .*raise guard.max_rollbacks"):
        guard.start_rollback(step=9, to_step=5)


def test_a_replayed_step_is_marked_and_its_loss_counts_once():
    guard = _guard(warmup_steps=100)
    for step in range(1, 5):
        guard.judge(step, float(step), 1.0)
    guard.judge(5, float("nan"), 1.0)
    guard.start_rollback(step=5, to_step=2)
    replayed = [guard.judge(step, 10.0 * step, 1.0) for step in (3, 4, 5)]
    assert [(v.keep, v.replay) for v in replayed] == [(True, True)] * 3
    # Steps 3 and 4 were in the window already; step 5 was not kept the first time.
    assert list(guard.losses) == [1.0, 2.0, 3.0, 4.0, 50.0] and guard.kept == 5
    assert not guard.judge(6, 6.0, 1.0).replay


def test_its_state_round_trips():
    guard = _guard()
    for loss in (1.0, 2.0, float("nan")):
        _next(guard, loss, 1.0)
    restored = _guard()
    restored.load_state_dict(guard.state_dict())
    assert restored.state_dict() == guard.state_dict()
    assert _next(restored, float("nan"), 1.0).in_a_row == 2


def test_a_sampler_skips_whole_stream_steps_and_maps_optimizer_steps_past_them():
    sampler = GlobalBatchSampler(64, 8, 4, 0, 1, seed=3)
    sampler.skip([2, 3])
    sampler.skip([5])
    assert sampler.skipped == [(2, 4), (5, 6)]
    assert [sampler.stream_step(step) for step in range(1, 6)] == [0, 1, 4, 6, 7]
    sampler.start_step = 2  # two optimizer steps done: the next takes stream step 4
    iterator = iter(sampler)
    first = [next(iterator) for _ in range(4)]
    assert first == [*sampler.step_indices(4), *sampler.step_indices(6)]
    assert sorted(sampler.global_indices(4)) == sorted(i for micro in sampler.step_indices(4) for i in micro)
