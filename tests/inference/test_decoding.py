from __future__ import annotations

import pytest
import torch

from meshyard.inference.decoding import PREFILL_TOKENS, prefill_groups, generate_with_cache
from meshyard.inference.engine import EagerEngine, generate_by_recomputing
from meshyard.inference.sampling import Sampling
from meshyard.models.gpt import GPT, GPTShape
from meshyard.models.mlp import MLP

VOCAB, CONTEXT = 64, 48


pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.fixture(scope="module")
def engine() -> EagerEngine:
    torch.manual_seed(0)
    return EagerEngine(GPT(GPTShape(vocab_size=VOCAB, context_length=CONTEXT, n_layer=2, n_head=2, d_model=32)),
                       VOCAB, CONTEXT)


def recomputed(engine: EagerEngine, prompts: list[list[int]], sampling: list[Sampling]) -> list[list[int]]:
    """The reference: a forward over the whole sequence for every new token, no cache."""
    with torch.inference_mode():
        return generate_by_recomputing(engine.forward, prompts, sampling, CONTEXT, VOCAB)


def prompts_of(lengths: list[int], seed: int = 3) -> list[list[int]]:
    generator = torch.Generator().manual_seed(seed)
    return [torch.randint(0, VOCAB, (n,), generator=generator).tolist() for n in lengths]


def test_greedy_generation_with_a_cache_equals_recomputing_exactly(engine):
    prompts = prompts_of([3, 17, 1, 9])
    sampling = [Sampling(max_new_tokens=n) for n in (20, 5, 30, 0)]
    cached = generate_with_cache(engine.module, prompts, sampling, CONTEXT, VOCAB)
    assert [len(tokens) for tokens in cached] == [20, 5, 30, 0]
    assert cached == recomputed(engine, prompts, sampling)
    # Each row as it comes alone: batching changes nothing.
    assert [generate_with_cache(engine.module, [p], [s], CONTEXT, VOCAB)[0] for p, s in zip(prompts, sampling)] == cached


def test_seeded_sampling_with_a_cache_draws_what_recomputing_draws(engine):
    prompts = prompts_of([4, 11], seed=5)
    sampling = [Sampling(max_new_tokens=12, temperature=0.8, top_k=10, seed=7),
                Sampling(max_new_tokens=8, temperature=1.3, seed=8)]
    cached = generate_with_cache(engine.module, prompts, sampling, CONTEXT, VOCAB)
    assert cached == recomputed(engine, prompts, sampling)
    assert cached != generate_with_cache(engine.module, prompts, [Sampling(12), Sampling(8)], CONTEXT, VOCAB)


def test_requests_the_cache_cannot_serve_are_refused(engine):
    with pytest.raises(ValueError, match="more than this model's context of 48"):
        generate_with_cache(engine.module, prompts_of([40]), [Sampling(max_new_tokens=9)], CONTEXT, VOCAB)
    with pytest.raises(ValueError, match="sequence 0 is empty"):
        generate_with_cache(engine.module, [[]], [Sampling()], CONTEXT, VOCAB)
    with pytest.raises(ValueError, match=f"token id {VOCAB}, outside this model's vocabulary"):
        generate_with_cache(engine.module, [[1, VOCAB]], [Sampling()], CONTEXT, VOCAB)
    with pytest.raises(TypeError, match="does not implement the KV-cache protocol"):
        generate_with_cache(MLP(VOCAB, d_model=8), prompts_of([2]), [Sampling()], CONTEXT, VOCAB)


@pytest.mark.parametrize("cached", [True, False], ids=["kv-cache", "recomputing"])
def test_on_step_sees_every_token_as_drawn_and_stops_the_rows_it_names(engine, cached):
    prompts = prompts_of([5, 9, 2], seed=8)
    sampling = [Sampling(max_new_tokens=n) for n in (6, 3, 10)]

    def generate(on_step):
        if cached:
            return generate_with_cache(engine.module, prompts, sampling, CONTEXT, VOCAB, on_step)
        with torch.inference_mode():
            return generate_by_recomputing(engine.forward, prompts, sampling, CONTEXT, VOCAB, on_step)

    whole = generate(None)
    seen: list[list[int]] = [[] for _ in prompts]
    steps: list[list[int]] = []

    def watch(rows: list[int], tokens: list[int]) -> set[int]:
        steps.append(rows)
        for row, token in zip(rows, tokens):
            seen[row].append(token)
        return set()

    assert generate(watch) == whole == seen
    assert steps[:3] == [[0, 1, 2]] * 3 and steps[3:] == [[0, 2]] * 3 + [[2]] * 4  # a step per token, rows leave
    drawn = [0] * len(prompts)

    def stop_row_2_at_four(rows: list[int], tokens: list[int]) -> set[int]:
        for row in rows:
            drawn[row] += 1
        return {2} if drawn[2] >= 4 else set()

    # Row 2 stops after its fourth token (its reader left): it draws no more, the others go on.
    assert generate(stop_row_2_at_four) == [whole[0], whole[1], whole[2][:4]]
    assert drawn == [6, 3, 4]


def test_a_cache_made_for_one_call_decodes_without_the_every_slot_step(engine, monkeypatch):
    # The every-slot step (a GPU cache's default, forced here) pays off only through a CUDA
    # graph captured after a cache's first steps: a cache for one call keeps the grouped step.
    made = []
    init_kv_cache = engine.module.init_kv_cache

    def every_slot_cache(*args, **kwargs):
        cache = init_kv_cache(*args, **kwargs)
        cache.every_slot_steps = True
        made.append(cache)
        return cache
    monkeypatch.setattr(engine.module, "init_kv_cache", every_slot_cache)
    prompts, sampling = prompts_of([3, 9]), [Sampling(max_new_tokens=12), Sampling(max_new_tokens=4)]
    cached = generate_with_cache(engine.module, prompts, sampling, CONTEXT, VOCAB)
    assert cached == recomputed(engine, prompts, sampling)
    assert [cache.step_graph for cache in made] == [None] and not made[0].every_slot_steps


def test_prompts_prefill_together_by_length_within_the_tokens_a_forward_takes():
    quarter = PREFILL_TOKENS // 4  # four such prompts fill a forward
    lengths = [7, quarter, 7, quarter, 2 * PREFILL_TOKENS, quarter, 7, quarter, quarter, quarter]
    groups = prefill_groups(lengths)
    assert sorted(i for group in groups for i in group) == list(range(len(lengths)))  # each prompt once
    assert all(len({lengths[i] for i in group}) == 1 for group in groups)  # of one length
    assert [0, 2, 6] in groups and [4] in groups  # a prompt longer than the bound goes alone
    assert [1, 3, 5, 7] in groups and [8, 9] in groups  # at most PREFILL_TOKENS tokens a forward
