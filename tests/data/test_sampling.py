"""Sharding: ranks disjoint and complete per step, deterministic, independent of world size."""

from __future__ import annotations

import itertools

import numpy as np
import pytest

from meshyard.data.sampling import GlobalBatchSampler, SpanOrder, eval_indices, span_lanes


def rank_batches(dp_size: int, steps: int, micro: int, global_batch: int = 8, n: int = 50, seed: int = 0):
    """Per step, the concatenated samples of all ranks in rank order."""
    samplers = [iter(GlobalBatchSampler(n, global_batch, micro, r, dp_size, seed)) for r in range(dp_size)]
    per_rank_micro = global_batch // dp_size // micro
    out = []
    for _ in range(steps):
        step = []
        for it in samplers:
            step.extend(itertools.chain.from_iterable(next(it) for _ in range(per_rank_micro)))
        out.append(step)
    return out


def test_ranks_disjoint_and_cover_each_global_batch():
    steps = rank_batches(dp_size=4, steps=6, micro=1)
    for step in steps:
        assert len(step) == len(set(step)) == 8
    seen = list(itertools.chain.from_iterable(steps[:6]))  # 48 of 50 samples: one epoch, no repeats
    assert len(seen) == len(set(seen))


def test_same_samples_per_step_for_any_world_size_and_micro_batch():
    reference = rank_batches(dp_size=1, steps=10, micro=8)
    for dp, micro in [(2, 4), (2, 1), (4, 2), (8, 1)]:
        assert rank_batches(dp, 10, micro) == reference, (dp, micro)


def test_deterministic_from_seed_and_reshuffled_each_epoch():
    assert rank_batches(2, 12, 2, seed=7) == rank_batches(2, 12, 2, seed=7)
    assert rank_batches(2, 12, 2, seed=7) != rank_batches(2, 12, 2, seed=8)
    sampler = GlobalBatchSampler(50, 8, 8, 0, 1, seed=0)
    assert sampler.step_indices(0) != sampler.step_indices(sampler.steps_per_epoch)  # epoch 1 differs


def test_loader_resumes_at_a_step_with_no_state_of_its_own():
    """A resume only seeks the sampler to the saved step (across epochs too): torch's plain
    DataLoader then yields exactly what an uninterrupted one would."""
    import torch
    from torch.utils.data import DataLoader

    from meshyard.data.loader import DataBundle

    def loader() -> DataLoader:
        return DataLoader(torch.arange(50), batch_sampler=GlobalBatchSampler(50, 8, 2, 1, 2, seed=1))

    full = [batch.tolist() for batch in itertools.islice(loader(), 40)]  # 2 micro-batches a step, 20 steps
    resumed = DataBundle(loader(), None, 0, "", 50)
    resumed.seek(7)
    assert [batch.tolist() for batch in itertools.islice(resumed.train_loader, 26)] == full[14:]


def test_too_little_data_is_a_clear_error():
    with pytest.raises(ValueError, match="fewer than one global batch"):
        GlobalBatchSampler(4, 8, 1, 0, 1, seed=0)


def test_eval_indices_disjoint_across_ranks_and_fixed():
    a = eval_indices(100, 4, 3, 0, 2)
    b = eval_indices(100, 4, 3, 1, 2)
    flat_a, flat_b = set(itertools.chain(*a)), set(itertools.chain(*b))
    assert not flat_a & flat_b and len(flat_a) == 12
    assert a == eval_indices(100, 4, 3, 0, 2)


def test_a_batched_fetch_of_token_windows_is_the_collated_windows():
    """The loader fetches a micro-batch of windows in one gather; it holds exactly what
    collating the windows one by one gives, whatever the token file's integer type."""
    import numpy as np
    import torch

    from meshyard.data.loader import TokenWindows

    tokens = (np.arange(1000) * 7 % 65521).astype(np.uint16)
    windows = TokenWindows(tokens, seq_len=16, first=3, count=50)
    indices = [4, 0, 49, 17]
    inputs, targets = windows.__getitems__(indices)
    expected = torch.utils.data.default_collate([windows[i] for i in indices])
    assert inputs.dtype == targets.dtype == torch.int64
    assert inputs.is_contiguous() and targets.is_contiguous()
    assert torch.equal(inputs, expected[0]) and torch.equal(targets, expected[1])


def test_a_span_order_is_one_epoch_of_distinct_samples_the_same_on_every_world_size():
    span_of_sample = np.repeat(np.arange(25), 20)  # 25 spans of 20 samples
    order = SpanOrder(np.arange(0, 501, 20), global_batch=8, lanes=8, seed=3)
    one = order(0)
    assert len(one) == len(set(one.tolist())) == 500 // 8 * 8  # the last partial global batch waits
    assert not np.array_equal(one, order(1)) and np.array_equal(one, SpanOrder(np.arange(0, 501, 20), 8, 8, 3)(0))
    per_step = {}
    for ranks in (1, 2, 4, 8):
        samplers = [GlobalBatchSampler(500, 8, 1, r, ranks, 3, order=order) for r in range(ranks)]
        per_step[ranks] = [[i for s in samplers for micro in s.step_indices(step) for i in micro] for step in range(70)]
    assert per_step[1] == per_step[2] == per_step[4] == per_step[8]
    places = np.asarray(per_step[1][:62])  # one epoch: [step, place]
    spans_per_place = [len(set(span_of_sample[places[:, j]].tolist())) for j in range(8)]
    assert max(spans_per_place) <= 62 // 20 + 2  # each place reads one span after another
    for span in range(25):  # the samples within a span are shuffled
        inside = one[span_of_sample[one] == span]
        assert not np.array_equal(np.sort(inside), inside) or len(inside) < 3


def test_fewer_lanes_give_each_lane_a_run_of_places_and_keep_the_order_independent_of_the_world_size():
    span_of_sample = np.repeat(np.arange(40), 16)  # 40 spans of 16 samples
    order = SpanOrder(np.arange(0, 641, 16), global_batch=8, lanes=2, seed=5)
    per_step = {}
    for ranks in (1, 2, 4):
        samplers = [GlobalBatchSampler(640, 8, 2, r, ranks, 5, order=order) for r in range(ranks)]
        per_step[ranks] = [[i for s in samplers for micro in s.step_indices(step) for i in micro] for step in range(80)]
    assert per_step[1] == per_step[2] == per_step[4]
    steps = np.asarray(per_step[1])  # [step, place]: places 0-3 lane 0, 4-7 lane 1
    for lane in (0, 1):
        spans = span_of_sample[steps[:, 4 * lane:4 * lane + 4]].reshape(-1)  # the lane's samples in order
        assert len(set(spans.tolist())) <= 320 // 16 + 2 and (np.diff(spans) != 0).sum() <= 320 // 16 + 1
    assert len(set(steps.reshape(-1).tolist())) == 640  # one epoch, every sample once
    with pytest.raises(ValueError, match="3 lanes do not divide the global batch of 8"):
        SpanOrder(np.arange(0, 641, 16), 8, 3, 5)


def test_the_default_lanes_are_the_largest_divisor_of_the_global_batch_up_to_64():
    assert [span_lanes(0, b) for b in (8, 48, 64, 96, 512, 7)] == [8, 48, 64, 48, 64, 7]
    assert span_lanes(4, 512) == 4
