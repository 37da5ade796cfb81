"""A decoding step replayed from a CUDA graph.

A decoding step of a small model is a few milliseconds of GPU work behind hundreds of kernel
launches, each with its own host-side cost: the GPU waits on Python. A CUDA graph records
the launches of one step once and replays them in one call. It needs a step whose shapes and
tensors never change: the model's step over every slot of its KV cache
(``GPTDecoder.every_slot``), fed through fixed input buffers. Capturing also runs the step,
so it is done on a real step, twice on a side stream first to settle the kernels'
workspaces (the step is idempotent: a rerun writes the same keys and values where the first
run did). A capture costs a few steps' time, so a cache's first ``EAGER_STEPS`` steps run
eagerly: a short generation never pays for it. Off CUDA, or where a capture fails, the
same step runs eagerly.
"""

from __future__ import annotations

import logging
from typing import Callable

import torch

from meshyard.models.kv_cache import KVCache

log = logging.getLogger(__name__)

EAGER_STEPS = 8

EverySlotStep = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]
"""step(tokens, positions, stepped) -> logits [slots, vocab], all [slots] on the cache's device."""


class DecodeGraph:
    """Every slot's decoding step of one model and one cache, replayed from a CUDA graph."""

    def __init__(self, step: EverySlotStep, cache: KVCache) -> None:
        self._step = step
        self.device = cache.device
        # The step's inputs: a replay reads whatever these hold.
        self.tokens = torch.zeros(cache.batch_slots, dtype=torch.long, device=self.device)
        self.positions = torch.zeros(cache.batch_slots, dtype=torch.long, device=self.device)
        self.stepped = torch.zeros(cache.batch_slots, dtype=torch.bool, device=self.device)
        self._graph: torch.cuda.CUDAGraph | None = None
        self._logits: torch.Tensor | None = None  # the graph's output, rewritten by each replay
        self.captures = self.device.type == "cuda"
        self.steps = 0

    def __call__(self, tokens: torch.Tensor, slots: torch.Tensor, positions: torch.Tensor,
                 stepped: torch.Tensor) -> torch.Tensor:
        """Logits [len(slots), vocab] of ``tokens`` [len(slots)] (on the device) appended to
        ``slots``; ``positions`` and ``stepped`` as ``KVCache.begin_every_slot`` gives them."""
        device_slots = slots.to(self.device)
        self.positions.copy_(positions)
        self.stepped.copy_(stepped)
        self.tokens.index_copy_(0, device_slots, tokens)
        self.steps += 1
        if self._graph is None and self.captures and self.steps > EAGER_STEPS:
            self._capture()
        if self._graph is None:
            logits = self._step(self.tokens, self.positions, self.stepped)
        else:
            self._graph.replay()
            logits = self._logits
        return logits[device_slots]

    def _capture(self) -> None:
        """Record the step (running it: see the module's docstring); on failure, decode eagerly
        from now on, with one warning naming why."""
        try:
            side = torch.cuda.Stream(self.device)
            side.wait_stream(torch.cuda.current_stream(self.device))
            with torch.cuda.stream(side):
                for _ in range(2):
                    self._step(self.tokens, self.positions, self.stepped)
            torch.cuda.current_stream(self.device).wait_stream(side)
            graph = torch.cuda.CUDAGraph()
            # thread_local: the server's other threads may touch CUDA meanwhile.
            with torch.cuda.graph(graph, capture_error_mode="thread_local"):
                self._logits = self._step(self.tokens, self.positions, self.stepped)
            self._graph = graph
        except Exception as error:  # noqa: BLE001 - any capture failure leaves the eager step
            self.captures = False
            self._logits = None
            log.warning("decoding without a CUDA graph (its capture failed: %s); each step launches its "
                        "kernels one by one", error)
