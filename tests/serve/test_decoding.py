from __future__ import annotations

import pytest
import torch

from meshyard.models.gpt import GPT, GPTShape
from meshyard.models.mlp import MLP
from meshyard.serve.decoding import generate_with_cache
from meshyard.serve.engine import EagerEngine
from meshyard.serve.types import Sampling

VOCAB, CONTEXT = 64, 48


pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.fixture(scope="module")
def engine() -> EagerEngine:
    torch.manual_seed(0)
    return EagerEngine(GPT(GPTShape(vocab_size=VOCAB, context_length=CONTEXT, n_layer=2, n_head=2, d_model=32)),
                       VOCAB, CONTEXT)


def prompts_of(lengths: list[int], seed: int = 3) -> list[list[int]]:
    generator = torch.Generator().manual_seed(seed)
    return [torch.randint(0, VOCAB, (n,), generator=generator).tolist() for n in lengths]


def test_greedy_generation_with_a_cache_equals_recomputing_exactly(engine):
    prompts = prompts_of([3, 17, 1, 9])
    sampling = [Sampling(max_new_tokens=n) for n in (20, 5, 30, 0)]
    cached = generate_with_cache(engine.module, prompts, sampling, CONTEXT)
    assert [len(tokens) for tokens in cached] == [20, 5, 30, 0]
    assert cached == engine.generate(prompts, sampling)
    # Each row as it comes alone: batching changes nothing.
    assert [generate_with_cache(engine.module, [p], [s], CONTEXT)[0] for p, s in zip(prompts, sampling)] == cached


def test_seeded_sampling_with_a_cache_draws_what_recomputing_draws(engine):
    prompts = prompts_of([4, 11], seed=5)
    sampling = [Sampling(max_new_tokens=12, temperature=0.8, top_k=10, seed=7),
                Sampling(max_new_tokens=8, temperature=1.3, seed=8)]
    cached = generate_with_cache(engine.module, prompts, sampling, CONTEXT)
    assert cached == engine.generate(prompts, sampling)
    assert cached != generate_with_cache(engine.module, prompts, [Sampling(12), Sampling(8)], CONTEXT)


def test_requests_the_cache_cannot_serve_are_refused(engine):
    with pytest.raises(ValueError, match="exceeds the model's context of 48 tokens"):
        generate_with_cache(engine.module, prompts_of([40]), [Sampling(max_new_tokens=9)], CONTEXT)
    with pytest.raises(ValueError, match="the prompt is empty"):
        generate_with_cache(engine.module, [[]], [Sampling()], CONTEXT)
    with pytest.raises(TypeError, match="does not implement the KV-cache protocol"):
        generate_with_cache(MLP(VOCAB, d_model=8), prompts_of([2]), [Sampling()], CONTEXT)
