"""Serving on a GPU: weights, KV cache and sampling on the CUDA device, /v1/completions answered."""

from __future__ import annotations

import asyncio
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest
import torch

from meshyard.inference.loading import describe, load_engine
from meshyard.inference.sampling import Sampling
from meshyard.models.decode_graph import EAGER_STEPS
from meshyard.serve.continuous import ContinuousBatcher
from tests.serve.servers import running_servers

pytestmark = [pytest.mark.gpu, pytest.mark.usefixtures("one_torch_thread")]


def continuous_tokens(engine, prompt: list[int], max_new_tokens: int):
    """``prompt``'s greedy tokens through a continuous batcher of two slots, and its cache."""
    async def generate():
        with ThreadPoolExecutor(1) as executor:
            batcher = ContinuousBatcher(engine, max_batch_size=2, max_queue=4, executor=executor)
            tokens = await batcher.submit((prompt, Sampling(max_new_tokens=max_new_tokens)), deadline=1e12)
            cache = batcher._cache
            await batcher.close()
            return tokens, cache
    return asyncio.run(generate())


def test_a_checkpoint_on_cuda_keeps_weights_cache_and_tokens_on_the_device(trained_run):
    # More steps than a cache decodes eagerly: the batcher's long-lived cache captures its step.
    steps = EAGER_STEPS + 16
    engine = load_engine(describe(str(trained_run)), device="cuda", dtype="auto")
    assert {p.device.type for p in engine.module.parameters()} == {"cuda"}
    expected_dtype = torch.bfloat16 if torch.cuda.is_bf16_supported() else torch.float32
    assert {p.dtype for p in engine.module.parameters()} == {expected_dtype}
    tokens, cache = continuous_tokens(engine, [72, 105], steps)
    assert len(tokens) == steps
    assert cache.device.type == "cuda" and cache.keys[0].dtype == expected_dtype
    assert cache.step_graph is not None and cache.step_graph._graph is not None
    # Token for token against a one-row generation (its own cache, the grouped step) in fp32:
    # in bf16 the two-slot and one-row matrix products round differently, and a near tie
    # between two tokens may go either way.
    fp32 = load_engine(describe(str(trained_run)), device="cuda", dtype="fp32")
    tokens, cache = continuous_tokens(fp32, [72, 105], steps)
    assert cache.step_graph._graph is not None
    assert tokens == fp32.generate([[72, 105]], [Sampling(max_new_tokens=steps)])[0]


def test_the_default_scheduler_batches_a_model_on_cuda_continuously(trained_run):
    from meshyard.config.sections import ServeConfig
    from meshyard.serve.app import Server
    from meshyard.serve.routing import Router

    server = Server(ServeConfig(), Router.from_specs([], []))
    try:
        assert server.cfg.scheduler == "auto"
        engine = load_engine(describe(str(trained_run)), device="cuda", dtype="auto")
        assert server._runs_continuously(engine)
        cpu = load_engine(describe(str(trained_run)), device="cpu", dtype="fp32")
        assert not server._runs_continuously(cpu)
    finally:
        server.executor.shutdown()


def test_a_cuda_server_answers_completions(tmp_path, trained_run):
    args = [str(trained_run), "--pin", "tiny", "--cache", "off", "--scheduler", "continuous",
            "--serve.device=cuda", "--serve.max_new_tokens=16"]
    with running_servers(tmp_path, [args]) as (server,):
        reply = httpx.post(f"{server.url}/v1/completions", timeout=60.0,
                           json={"model": "tiny", "prompt": "def add(", "max_tokens": 8, "temperature": 0})
        assert reply.status_code == 200, server.explain(reply)
        assert reply.json()["choices"][0]["text"]


@pytest.mark.parametrize("every_slot_steps", [True, False], ids=["every-slot", "grouped"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_decoding_steps_on_cuda_over_rows_of_different_lengths_match_the_full_forward(dtype, every_slot_steps):
    # Grouped: rows of different lengths attend through a mask; over 40 steps its span crosses
    # every alignment, which CUDA's memory-efficient attention needs from the mask's start.
    # Every slot: the step is captured after EAGER_STEPS steps, and the replays are checked.
    from meshyard.models.gpt import GPT, GPTShape

    torch.manual_seed(0)
    with torch.device("cuda"):
        model = GPT(GPTShape(vocab_size=64, context_length=96, n_layer=2, n_head=2, d_model=64)).to(dtype).eval()
    cache = model.init_kv_cache(4, 96)
    cache.every_slot_steps = every_slot_steps
    sequences = [torch.randint(0, 64, (length,)).tolist() for length in (3, 11, 5, 8)]
    with torch.inference_mode():
        for slot, sequence in enumerate(sequences):
            model(torch.tensor([sequence[:-1]], device="cuda"), cache=cache, slots=[slot], positions=[0])
        for _ in range(40):
            tokens = torch.tensor([[sequence[-1]] for sequence in sequences], device="cuda")
            logits = model(tokens, cache=cache, slots=[0, 1, 2, 3])[:, -1].float()
            for row, sequence in enumerate(sequences):
                full = model(torch.tensor([sequence], device="cuda"))[0, -1].float()
                error = (logits[row] - full).abs().max() / full.abs().max()
                assert error < (3e-2 if dtype == torch.bfloat16 else 1e-4), error
                sequence.append(int(torch.argmax(full)))
    assert (cache.step_graph is not None and cache.step_graph._graph is not None) == every_slot_steps


def test_the_cuda_graph_step_matches_the_grouped_step_and_is_captured_once():
    from meshyard.models.gpt import GPT, GPTShape

    torch.manual_seed(0)
    with torch.device("cuda"):
        model = GPT(GPTShape(vocab_size=64, context_length=64, n_layer=2, n_head=2, d_model=64)).eval()
    caches = [model.init_kv_cache(5, 64), model.init_kv_cache(5, 64)]
    caches[1].every_slot_steps = False
    assert caches[0].every_slot_steps  # on by default on CUDA
    prompts = [[3, 4, 5], [9] * 12, [1, 2]]
    tokens = [[p[-1] for p in prompts] for _ in caches]
    with torch.inference_mode():
        for cache in caches:
            for slot, prompt in zip((0, 1, 3), prompts):
                model(torch.tensor([prompt[:-1]], device="cuda"), cache=cache, slots=[slot], positions=[0])
        for _ in range(30):
            logits = [model(torch.tensor([[t] for t in row], device="cuda"), cache=cache, slots=[0, 1, 3])[:, -1]
                      for cache, row in zip(caches, tokens)]
            assert (logits[0] - logits[1]).abs().max() <= 1e-4 * logits[1].abs().max()
            tokens = [row.argmax(-1).tolist() for row in logits]
            assert tokens[0] == tokens[1]
    graph = caches[0].step_graph
    assert graph is not None and graph._graph is not None, "the decoding step was not captured as a CUDA graph"
