"""The CUDA-graph decoding step (models/decode_graph.py): captured on the cache's device,
checked against the eager step, and eager with one warning where a capture fails."""

from __future__ import annotations

import itertools
import logging
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch

from meshyard.models import decode_graph
from meshyard.models.decode_graph import EAGER_STEPS, DecodeGraph
from meshyard.models.kv_cache import KVCache

pytestmark = pytest.mark.gpu

SLOTS, VOCAB = 3, 4


def exact_step(tokens, positions, stepped, cache):
    """Logits [slots, VOCAB] that name each slot's token and position (an idempotent step)."""
    row = tokens * 100 + positions * 10 + stepped.long()
    return (row[:, None] + torch.arange(VOCAB, device=tokens.device)).float()


def drive(graph: DecodeGraph, device: torch.device, steps: int) -> None:
    """``steps`` steps over slots 0 and 2 (slot 1 idle), each checked against ``exact_step``."""
    slots = torch.tensor([0, 2])
    for step in range(steps):
        tokens = torch.tensor([step, 7 * step + 1], device=device)
        positions = torch.tensor([step, 0, step + 2])
        stepped = torch.tensor([True, False, True])
        logits = graph(tokens, slots, positions, stepped)
        inputs = torch.zeros(SLOTS, dtype=torch.long, device=device).index_copy_(0, slots.to(device), tokens)
        expected = exact_step(inputs, positions.to(device), stepped.to(device), None)[slots.to(device)]
        assert torch.equal(logits, expected), (step, logits, expected)


def test_a_captured_step_replays_what_the_eager_step_computes():
    cache = KVCache(1, SLOTS, 1, 8, 4, device="cuda")
    graph = DecodeGraph(exact_step, cache)
    drive(graph, cache.device, EAGER_STEPS + 6)
    assert graph._graph is not None and graph.captures


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two GPUs")
def test_a_step_on_another_gpu_is_captured_there_from_a_thread_that_chose_no_device():
    # The server's inference thread never sets a device: its current one is cuda:0.
    cache = KVCache(1, SLOTS, 1, 8, 4, device="cuda:1")
    graph = DecodeGraph(exact_step, cache)
    with ThreadPoolExecutor(1) as executor:
        assert executor.submit(torch.cuda.current_device).result() == 0
        executor.submit(drive, graph, cache.device, EAGER_STEPS + 6).result()
    assert graph._graph is not None


def test_failed_captures_decode_eagerly_on_the_callers_stream_with_one_warning(monkeypatch, caplog):
    monkeypatch.setattr(decode_graph, "_failure_logged", False)

    def refusing_step(tokens, positions, stepped, cache):
        logits = exact_step(tokens, positions, stepped, cache)
        if torch.cuda.is_current_stream_capturing():
            raise RuntimeError("this step cannot be captured")
        return logits

    calls = itertools.count()

    def drifting_step(tokens, positions, stepped, cache):
        # A host value read at capture is frozen into the graph: its replay is not the eager step.
        return exact_step(tokens, positions, stepped, cache) + next(calls)

    cache = KVCache(1, SLOTS, 1, 8, 4, device="cuda")
    stream = torch.cuda.current_stream()
    with caplog.at_level(logging.WARNING, logger="meshyard.models.decode_graph"):
        refusing = DecodeGraph(refusing_step, cache)
        drive(refusing, cache.device, EAGER_STEPS + 3)
        drifting = DecodeGraph(drifting_step, cache)
        for _ in range(EAGER_STEPS + 3):
            drifting(torch.tensor([1], device="cuda"), torch.tensor([0]), torch.zeros(SLOTS, dtype=torch.long),
                     torch.tensor([True, False, False]))
    assert torch.cuda.current_stream() == stream
    for graph in (refusing, drifting):
        assert graph._graph is None and not graph.captures
    warnings = [record.getMessage() for record in caplog.records if record.name == decode_graph.__name__]
    assert len(warnings) == 1 and "this step cannot be captured" in warnings[0], warnings
