"""A decoding step replayed from a CUDA graph.

A decoding step of a small model is a few milliseconds of GPU work behind hundreds of kernel
launches, each with its own host-side cost: the GPU waits on Python. A CUDA graph records
the launches of one step once and replays them in one call. It needs a step whose shapes and
tensors never change: the model's step over every slot of its KV cache
(``GPTDecoder.every_slot``), fed through fixed input buffers.

A capture records kernels without running them, so the step being captured is first run
eagerly, twice, on a side stream of the cache's device (which also settles the kernels'
workspaces), then recorded on that same stream, then replayed once: the step is idempotent
(a rerun writes the same keys and values where the first run did), so the replay must give
exactly the eager run's logits, and a graph that does not (one that recorded nothing, say)
counts as a failed capture. Everything happens with the cache's device current: the inference
thread never chooses a device, and a capture stream of another device would record nothing.

A capture costs a few steps' time, so a cache's first ``EAGER_STEPS`` steps run eagerly: a
short generation never pays for it. Off CUDA, or where a capture fails, the same step runs
eagerly (one warning per process says why).
"""

from __future__ import annotations

import logging
import weakref
from typing import Callable

import torch

from meshyard.models.kv_cache import KVCache

log = logging.getLogger(__name__)

EAGER_STEPS = 8

EverySlotStep = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, KVCache], torch.Tensor]
"""step(tokens, positions, stepped, cache) -> logits [slots, vocab], the first three [slots]
on the cache's device."""

# A failed capture is a property of the model, torch and the GPU, not of one cache: said once.
_failure_logged = False


class DecodeGraph:
    """Every slot's decoding step of one model and one cache, replayed from a CUDA graph."""

    def __init__(self, step: EverySlotStep, cache: KVCache) -> None:
        """``step`` must not hold ``cache``: the cache holds this object (``KVCache.step_graph``),
        so a strong reference back would be a cycle that keeps the cache, the graph's memory
        pool and the model's weights on the device until a garbage-collector pass."""
        self._step = step
        self._cache = weakref.ref(cache)
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
        if self._graph is not None:
            self._graph.replay()  # on its device's current stream, whichever device this thread has
            logits = self._logits
        elif self.captures and self.steps > EAGER_STEPS:
            logits = self._capture()
        else:
            logits = self._run_eagerly()
        return logits[device_slots]

    def _run_eagerly(self) -> torch.Tensor:
        cache = self._cache()
        assert cache is not None, "a decoding step of a cache that no longer exists"
        return self._step(self.tokens, self.positions, self.stepped, cache)

    def _capture(self) -> torch.Tensor:
        """This step's logits, computed while recording the graph (see the module's docstring);
        where the capture fails, computed eagerly, and every later step is eager too."""
        with torch.cuda.device(self.device):
            caller = torch.cuda.current_stream()
            try:
                graph, eager = self._record(caller)
            except Exception as error:  # noqa: BLE001 - any capture failure leaves the eager step
                # A capture that failed as it ended leaves its stream current on this thread.
                torch.cuda.set_stream(caller)
                return self._give_up(f"its capture failed: {error}")
            self._logits.fill_(float("nan"))  # a replay that writes nothing cannot pass for a right one
            graph.replay()
            if not torch.equal(self._logits, eager):
                return self._give_up("a replay of the captured step did not give the eager step's logits")
            self._graph = graph
            return self._logits

    def _record(self, caller: torch.cuda.Stream) -> tuple[torch.cuda.CUDAGraph, torch.Tensor]:
        """Run the step twice on a side stream, then record it there; the graph and the second
        run's logits (in ``self._logits``: the graph's own output)."""
        side = torch.cuda.Stream(self.device)
        side.wait_stream(caller)
        with torch.cuda.stream(side):
            for _ in range(2):
                eager = self._run_eagerly()
        caller.wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        # thread_local: the server's other threads may use CUDA while this one captures.
        with torch.cuda.graph(graph, stream=side, capture_error_mode="thread_local"):
            self._logits = self._run_eagerly()
        return graph, eager

    def _give_up(self, why: str) -> torch.Tensor:
        """Decode eagerly from now on; this step's logits, computed so (the step is idempotent)."""
        global _failure_logged
        self.captures = False
        self._logits = None
        if not _failure_logged:
            _failure_logged = True
            log.warning("decoding without a CUDA graph (%s); each step launches its kernels one by one", why)
        return self._run_eagerly()
