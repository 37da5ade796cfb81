from __future__ import annotations

import gc
import weakref

import pytest
import torch

from meshyard.models.decode_graph import DecodeGraph
from meshyard.models.gpt import GPT, GPTShape

pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.fixture
def no_garbage_collector():
    """Only reference counts free objects meanwhile: what a cycle keeps, stays."""
    gc.collect()
    gc.disable()
    yield
    gc.enable()


@pytest.mark.parametrize("every_slot_steps", [True, False], ids=["every-slot", "grouped"])
def test_a_decoded_cache_and_its_step_graph_are_freed_by_reference_counting(every_slot_steps, no_garbage_collector):
    # A server evicts a model by dropping it: its cache (and on a GPU the graph's memory
    # pool) must go with the last reference, not wait for a garbage-collector pass.
    torch.manual_seed(0)
    model = GPT(GPTShape(vocab_size=32, context_length=16, n_layer=1, n_head=2, d_model=16)).eval()
    cache = model.init_kv_cache(3, 16)
    cache.every_slot_steps = every_slot_steps  # the every-slot step is a GPU's default; forced here
    with torch.inference_mode():
        model(torch.tensor([[1, 2, 3], [4, 5, 6]]), cache=cache, slots=[0, 2], positions=[0, 0])
        for token in range(3):
            model(torch.tensor([[token], [token + 1]]), cache=cache, slots=[0, 2])
    assert isinstance(cache.step_graph, DecodeGraph) == every_slot_steps
    graph = weakref.ref(cache.step_graph) if every_slot_steps else None
    freed = weakref.ref(cache)
    del cache
    holders = [] if freed() is None else [type(holder).__name__ for holder in gc.get_referrers(freed())]
    assert freed() is None, f"the cache outlived its last reference, held by {holders}"
    assert graph is None or graph() is None
    del model
