"""PowerSGD through PyTorch's own ``powerSGD_hook``, made countable and checkpointable.

PyTorch's ``PowerSGDState`` keeps its memory per DDP *bucket index*: the error-feedback
residual (one flat tensor per bucket) and the warm-started Q factors (concatenated per
bucket, in order of tensor shape). Bucket composition is not stable: DDP regroups its
buckets after the first step of every new DDP module, so a state saved by one process
does not fit the buckets of a restarted one. This wrapper therefore saves the state
*per parameter name* and, whenever a bucket's composition differs from what the state
was built for, cuts the old bucket memory into per-parameter pieces and reassembles it
for the new composition before PyTorch's hook runs. All PowerSGD arithmetic is
per-tensor (P = MQ, orthogonalisation, Q = M^T P), so the regrouped state gives the
same gradients as the original. (``batched_powerSGD_hook`` is not used: it asserts on
2-D tensors.)
"""

from __future__ import annotations

from typing import Callable, Any

import torch
import torch.distributed as dist
from torch.distributed.algorithms.ddp_comm_hooks.powerSGD_hook import PowerSGDState, powerSGD_hook
from torch.nn.parallel import DistributedDataParallel

from meshyard.comm.hooks import GradientCompression


class PowerSGDCompression(GradientCompression):
    """Rank-``rank`` PowerSGD with error feedback and warm start (PyTorch's hook)."""

    method = "powersgd"

    def __init__(self, rank: int = 4, error_feedback: bool = True, process_group: dist.ProcessGroup | None = None,
                 warmup_steps: int = 10, min_compression_rate: float = 2.0, seed: int = 0) -> None:
        super().__init__(process_group, warmup_steps)
        self.state = PowerSGDState(
            process_group=process_group, matrix_approximation_rank=rank, start_powerSGD_iter=warmup_steps,
            min_compression_rate=min_compression_rate, use_error_feedback=error_feedback, warm_start=True,
            random_seed=seed, compression_stats_logging_frequency=2**62,
        )
        self._layouts: dict[int, list[str]] = {}  # bucket index -> parameter names the state is built for
        self._pending: dict[str, dict[str, torch.Tensor]] = {"error": {}, "q": {}}
        # PyTorch's hook issues its P and Q all-reduces from future callbacks. On gloo
        # those run on another thread, racing the next bucket's all-reduce from the
        # backward thread, and ranks that order them differently deadlock. One bucket
        # at a time keeps the order fixed (NCCL orders by stream and needs no wait).
        self._serialize = False
        self._in_flight: torch.futures.Future | None = None

    def register(self, ddp: DistributedDataParallel, wrap: Callable[[Callable], Callable] | None = None) -> None:
        super().register(ddp, wrap)
        self._serialize = dist.get_backend(self.group()) == "gloo"

    @property
    def iteration(self) -> int:
        # PyTorch's state counts syncs and decides warm-up itself; mirror it.
        return self.state.iter

    def _set_iteration(self, value: int) -> None:
        self.state.iter = value

    def hook(self, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
        index, names = bucket.index(), self.bucket_names(bucket)
        if self._layouts.get(index) != names:
            # DDP launches buckets in index order, so buckets from ``index`` on are not in
            # flight and their memory (from the last step) can be cut up safely.
            for old in [i for i in self._layouts if i >= index]:
                self._detach_bucket(old)
            self._attach_bucket(index, names, bucket.buffer())
        self._count(bucket, names)
        if self._serialize and self._in_flight is not None:
            self._in_flight.wait()
        future = powerSGD_hook(self.state, bucket)
        self._in_flight = None if bucket.is_last() else future
        return future

    # -- accounting -----------------------------------------------------------------

    def _factor_shapes(self, names: list[str]) -> list[tuple[str, int, int, int]]:
        """(name, n, m, r) of each tensor PyTorch compresses, in the order of its P/Q
        memory: grouped by matrix shape, first-seen shape first."""
        groups: dict[tuple[int, int], list[tuple[str, int, int, int]]] = {}
        for name in names:
            shape = self._shapes[name]
            n = shape[0]
            m = shape.numel() // n
            r = min(n, m, self.state.matrix_approximation_rank)
            if (n + m) * r * self.state.min_compression_rate < n * m:  # PyTorch's _should_compress rule
                groups.setdefault((n, m), []).append((name, n, m, r))
        return [entry for group in groups.values() for entry in group]

    def _count(self, bucket: dist.GradBucket, names: list[str]) -> None:
        buffer = bucket.buffer()
        item, total = buffer.element_size(), buffer.numel()
        if self.state.iter < self.state.start_powerSGD_iter:
            self.counter.add("all_reduce", total * item, total * item)
            return
        factors = self._factor_shapes(names)
        low_rank = sum((n + m) * r for _, n, m, r in factors)
        kept = total - sum(n * m for _, n, m, _ in factors)
        # Three all-reduces: the uncompressed tensors, then all Ps, then all Qs.
        self.counter.add("all_reduce", (kept + low_rank) * item, total * item)

    # -- state by parameter name ------------------------------------------------------

    def _detach_bucket(self, index: int) -> None:
        """Move bucket ``index``'s memory into the per-parameter store."""
        names = self._layouts.pop(index)
        error = self.state.error_dict.pop(index, None)
        q_memory = self.state.q_memory_dict.pop(index, None)
        self.state.p_memory_dict.pop(index, None)
        self._pending["error"].update(self._split_error(names, error))
        self._pending["q"].update(self._split_q(names, q_memory))

    # The pieces are views: of memory taken out of PyTorch's state (which no hook changes
    # any more), or copied into kept tensors at once (state_dict).
    def _split_error(self, names: list[str], error: torch.Tensor | None) -> dict[str, torch.Tensor]:
        if error is None:
            return {}
        pieces, offset = {}, 0
        for name in names:
            numel = self._shapes[name].numel()
            pieces[name] = error[offset:offset + numel]
            offset += numel
        return pieces

    def _split_q(self, names: list[str], q_memory: torch.Tensor | None) -> dict[str, torch.Tensor]:
        if q_memory is None:
            return {}
        pieces, offset = {}, 0
        for name, _, m, r in self._factor_shapes(names):
            pieces[name] = q_memory[offset:offset + m * r]
            offset += m * r
        return pieces

    def _attach_bucket(self, index: int, names: list[str], like: torch.Tensor) -> None:
        """Build bucket ``index``'s memory from the per-parameter store, where it has it
        (on the device and in the dtype of the bucket ``like``)."""
        self._layouts[index] = names
        errors = self._pending["error"]
        if any(name in errors for name in names):
            pieces = [errors.pop(name, None) for name in names]
            self.state.error_dict[index] = torch.cat([
                piece.to(like) if piece is not None else like.new_zeros(self._shapes[name].numel())
                for name, piece in zip(names, pieces)
            ])
        factors = self._factor_shapes(names)
        qs = self._pending["q"]
        if factors and all(name in qs for name, *_ in factors):
            self.state.q_memory_dict[index] = torch.cat([qs.pop(name).to(like) for name, *_ in factors])
            # P is recomputed from Q before it is read; only its size matters.
            self.state.p_memory_dict[index] = like.new_empty(sum(n * r for _, n, _, r in factors))

    def state_dict(self) -> dict[str, Any]:
        errors, qs = dict(self._pending["error"]), dict(self._pending["q"])
        for index, names in self._layouts.items():
            errors.update(self._split_error(names, self.state.error_dict.get(index)))
            qs.update(self._split_q(names, self.state.q_memory_dict.get(index)))
        # Fixed layout: every compressed parameter's Q and every parameter's error, with
        # zeros (and q_valid = 0) before the first compressed step has made them.
        factors = self._factor_shapes(list(self._params))
        q_valid = bool(factors) and all(name in qs for name, *_ in factors)
        _, keys, pos, has_gauss, cached = self.state.rng.get_state()
        state = {
            **super().state_dict(),
            "q_valid": int(q_valid),
            # Copies into tensors kept from save to save (``_kept_buffer``).
            "q": {name: self._kept_copy(f"q.{name}", qs[name]) if q_valid
                  else self._kept_buffer(f"q.{name}", m * r, self._params[name]).zero_()
                  for name, _, m, r in factors},
            "rng": {"keys": self._kept_copy("rng.keys", torch.from_numpy(keys.astype("int64"))), "pos": int(pos),
                    "has_gauss": int(has_gauss), "cached_gaussian": float(cached)},
        }
        if self.state.use_error_feedback:
            state["error"] = {name: self._kept_copy(f"error.{name}", errors[name]) if name in errors
                              else self._kept_buffer(f"error.{name}", param.numel(), param).zero_()
                              for name, param in self._params.items()}
        return state

    def load_state_dict(self, state: dict[str, Any]) -> None:
        super().load_state_dict(state)
        rng = state["rng"]
        self.state.rng.set_state(("MT19937", rng["keys"].cpu().numpy().astype("uint32"), int(rng["pos"]),
                                   int(rng["has_gauss"]), float(rng["cached_gaussian"])))
        for memory in (self.state.error_dict, self.state.p_memory_dict, self.state.q_memory_dict):
            memory.clear()
        self._layouts.clear()
        qs = state.get("q", {}) if state.get("q_valid") else {}
        self._pending = {"error": {n: t.detach().clone() for n, t in state.get("error", {}).items()},
                         "q": {n: t.detach().clone() for n, t in qs.items()}}
