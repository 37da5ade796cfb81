"""Choosing next tokens: greedy, temperature, top-k, and per-request generators."""

from __future__ import annotations

import pytest
import torch

from meshyard.inference.sampling import Sampling, generator_for, next_tokens

LOGITS = torch.tensor([[0.0, 2.0, 1.0, -1.0, 0.5],
                       [3.0, 0.0, 0.0, 2.5, 0.0]])


def draws(row: torch.Tensor, sampling: Sampling, count: int) -> list[int]:
    """``count`` draws for one row from one generator seeded by ``sampling.seed``."""
    generator = generator_for(sampling)
    return [int(next_tokens(row[None], [sampling], [generator])[0]) for _ in range(count)]


def test_greedy_takes_each_rows_argmax():
    out = next_tokens(LOGITS, [Sampling(), Sampling()], [None, None])
    assert out.dtype == torch.long and out.tolist() == [1, 0]


def test_generator_only_for_seeded_sampling():
    assert generator_for(Sampling()) is None
    assert generator_for(Sampling(seed=5)) is None  # greedy draws nothing
    assert generator_for(Sampling(temperature=1.0)) is None  # torch's default generator
    a, b = generator_for(Sampling(temperature=1.0, seed=5)), generator_for(Sampling(temperature=1.0, seed=5))
    assert torch.equal(torch.rand(4, generator=a), torch.rand(4, generator=b))


def test_top_k_one_is_greedy_at_any_temperature():
    for seed in range(20):
        sampling = Sampling(temperature=3.0, top_k=1, seed=seed)
        generators = [generator_for(sampling), generator_for(sampling)]
        assert next_tokens(LOGITS, [sampling, sampling], generators).tolist() == [1, 0]


def test_seeded_draws_repeat_and_seeds_differ():
    row = torch.zeros(1, 50)  # uniform over 50 ids
    first = draws(row[0], Sampling(temperature=1.0, seed=7), 30)
    assert first == draws(row[0], Sampling(temperature=1.0, seed=7), 30)
    assert first != draws(row[0], Sampling(temperature=1.0, seed=8), 30)


def test_a_rows_draw_does_not_depend_on_its_batch_mates():
    mine = Sampling(temperature=1.0, seed=11)
    alone = draws(LOGITS[0], mine, 25)
    mine_gen, other_gen = generator_for(mine), generator_for(Sampling(temperature=0.7, seed=99))
    batched = [int(next_tokens(LOGITS.flip(0), [Sampling(temperature=0.7, seed=99), mine],
                               [other_gen, mine_gen])[1]) for _ in range(25)]
    assert batched == alone


def test_frequencies_follow_softmax_of_logits_over_temperature_within_top_k():
    row, count = LOGITS[0], 6000
    sampling = Sampling(temperature=0.5, top_k=3, seed=0)
    got = torch.bincount(torch.tensor(draws(row, sampling, count)), minlength=5).float() / count
    kept = torch.tensor([False, True, True, False, True])  # the 3 largest logits: 2.0, 1.0, 0.5
    expected = torch.where(kept, row / 0.5, torch.tensor(float("-inf"))).softmax(0)
    assert got[~kept].sum() == 0
    torch.testing.assert_close(got, expected, atol=0.02, rtol=0)


def test_top_k_zero_or_above_the_vocabulary_keeps_every_id():
    row = torch.zeros(4)
    for top_k in (0, 100):
        seen = set(draws(row, Sampling(temperature=1.0, top_k=top_k, seed=3), 200))
        assert seen == {0, 1, 2, 3}


def test_top_p_keeps_the_smallest_set_of_ids_that_reaches_its_mass():
    row = torch.log(torch.tensor([0.1, 0.5, 0.3, 0.05, 0.05]))
    assert set(draws(row, Sampling(temperature=1.0, top_p=0.4, seed=1), 200)) == {1}  # the likeliest alone reaches it
    assert set(draws(row, Sampling(temperature=1.0, top_p=0.75, seed=1), 400)) == {1, 2}
    assert set(draws(row, Sampling(temperature=1.0, top_p=0.85, seed=1), 400)) == {0, 1, 2}


def test_wrong_shapes_are_refused():
    with pytest.raises(ValueError, match="one Sampling and one generator per row"):
        next_tokens(LOGITS, [Sampling()], [None, None])
    with pytest.raises(ValueError, match="logits"):
        next_tokens(LOGITS[0], [Sampling()], [None])


def test_ids_of_a_padded_vocabulary_are_never_chosen():
    padded = torch.cat([LOGITS, torch.full((2, 3), 50.0)], dim=1)  # ids 5-7: padding with the largest logits
    greedy = next_tokens(padded, [Sampling(), Sampling()], [None, None], vocab_size=5)
    assert greedy.tolist() == [1, 0]
    hot = Sampling(temperature=5.0, seed=3)
    generator = generator_for(hot)
    drawn = [int(next_tokens(padded[:1], [hot], [generator], vocab_size=5)[0]) for _ in range(200)]
    assert max(drawn) < 5 and len(set(drawn)) == 5
