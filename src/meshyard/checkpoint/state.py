"""What a checkpoint holds and how it is put back.

Tensors go through DCP, which shards and reshards them: the model and optimizer under
their unwrapped parameter names (``torch.distributed.checkpoint.state_dict``), so a
checkpoint written under DDP loads under FSDP or another world size, and each rank's
RNG states under a per-rank key. Small identical-on-every-rank values (scheduler,
scaler, counters, data position) travel as JSON written by rank 0.

Nothing here unpickles: RNG states are JSON, and the non-tensor entries DCP stores
(hyperparameters, counters) are read with ``torch.load(weights_only=True)``, which builds
only plain values and tensors. DCP's own ``.metadata`` file is still a pickle, so a
checkpoint from an untrusted source must be treated as code.
"""

from __future__ import annotations

import base64
import io
import json
import random
import warnings
from typing import Any, Protocol

import numpy as np
import torch
from torch import nn
from torch.distributed.checkpoint import DefaultLoadPlanner
from torch.distributed.checkpoint._traverse import set_element
from torch.distributed.checkpoint.planner import ReadItem
from torch.distributed.checkpoint.state_dict import (StateDictOptions, _flatten_optim_state_dict,
                                                     _init_optim_state, get_model_state_dict, get_state_dict,
                                                     set_model_state_dict, set_state_dict)
from torch.distributed.optim import ZeroRedundancyOptimizer

from meshyard.parallel.data_parallel import unwrap


class Stateful(Protocol):
    def state_dict(self) -> dict[str, Any]: ...
    def load_state_dict(self, state: dict[str, Any]) -> None: ...


# Optimizer state is saved flat, one key per parameter name and entry
# ("state.blocks.0.mlp.fc.weight.exp_avg", "param_groups.blocks.0.mlp.fc.weight.lr"): a
# rank then contributes exactly the entries of the parameters it holds, which is what
# lets pipeline stages (each holding other parameters) and ZeRO-1 partitions (each
# holding the state of a share) write one checkpoint that loads under any layout.
FLAT = StateDictOptions(flatten_optimizer_state_dict=True)


def _zero_optimizer_state(model: nn.Module, zero: ZeroRedundancyOptimizer) -> dict[str, Any]:
    """ZeRO-1's state in the flat layout above, for the parameters of this rank's
    partition (kept by an inner optimizer). The state tensors are the optimizer's own,
    so a DCP load fills them in place."""
    names = {param: name for name, param in unwrap(model).named_parameters()}  # first name of tied params
    _init_optim_state(zero.optim)
    state = {names[p]: zero.optim.state[p] for group in zero.optim.param_groups for p in group["params"]
             if p in zero.optim.state}
    groups = [{**{k: v for k, v in group.items() if k != "params"}, "params": [names[p] for p in group["params"]]}
              for group in zero.optim.param_groups if group["params"]]
    return _flatten_optim_state_dict({"state": state, "param_groups": groups})


def rng_key(rank: int) -> str:
    return f"rng.rank{rank}"


# Generator states as JSON vary in length, but DCP loads into a tensor of the saved shape,
# so the blob has a fixed size: an 8-byte length, the UTF-8 JSON, zero padding (about 22
# KB are used: 625 + 624 integers of the Mersenne twisters, 5 KB of torch state in base64).
RNG_BLOB_BYTES = 64 * 1024
RNG_FORMAT = "meshyard-rng-json-1"


def _rng_states() -> dict[str, Any]:
    """This process's generator states as JSON values (JSON floats round-trip exactly)."""
    version, internal, gauss_next = random.getstate()
    _, keys, pos, has_gauss, cached = np.random.get_state()
    cuda = torch.cuda.get_rng_state_all() if torch.cuda.is_available() else []
    return {
        "format": RNG_FORMAT,
        "python": {"version": version, "internal": list(internal), "gauss_next": gauss_next},
        "numpy": {"keys": keys.tolist(), "pos": int(pos), "has_gauss": int(has_gauss), "cached": float(cached)},
        "torch": _b64(torch.get_rng_state()),
        "cuda": [_b64(state) for state in cuda],
    }


def _b64(state: torch.Tensor) -> str:
    return base64.b64encode(state.numpy().tobytes()).decode()


def _from_b64(text: str) -> torch.Tensor:
    return torch.frombuffer(bytearray(base64.b64decode(text)), dtype=torch.uint8)


def new_rng_blob() -> torch.Tensor:
    """An empty slot for ``capture_rng``."""
    return torch.zeros(RNG_BLOB_BYTES, dtype=torch.uint8)


def capture_rng(into: torch.Tensor | None = None) -> torch.Tensor:
    """Python, NumPy, torch and CUDA generator states of this process as a byte tensor:
    ``into`` (a ``new_rng_blob``), filled and returned, or a new blob. A blob kept from
    one save to the next keeps its storage, and with it the host buffer an async save
    stages it into (a new tensor per save would have its buffer allocated and pinned anew)."""
    payload = json.dumps(_rng_states()).encode()
    if len(payload) + 8 > RNG_BLOB_BYTES:
        raise ValueError(f"RNG state of {len(payload)} bytes exceeds the {RNG_BLOB_BYTES}-byte slot")
    blob = new_rng_blob() if into is None else into
    blob[:8] = torch.frombuffer(bytearray(len(payload).to_bytes(8, "little")), dtype=torch.uint8)
    blob[8 : 8 + len(payload)] = torch.frombuffer(bytearray(payload), dtype=torch.uint8)
    blob[8 + len(payload):] = 0
    return blob


def restore_rng(blob: torch.Tensor) -> bool:
    """Set this process's generators from ``capture_rng``'s blob. A blob in another format
    (an older checkpoint held a pickle here) is never unpickled: it is reported and
    False is returned, so the caller reseeds instead."""
    raw = blob.numpy().tobytes()
    try:
        states = json.loads(raw[8 : 8 + int.from_bytes(raw[:8], "little")].decode())
        if not isinstance(states, dict) or states.get("format") != RNG_FORMAT:
            raise ValueError(f"format {states.get('format') if isinstance(states, dict) else None!r}")
    except (ValueError, UnicodeDecodeError) as exc:
        warnings.warn(f"the checkpoint's RNG state is not in {RNG_FORMAT} format ({exc}); it was not "
                      "loaded and the random generators are reseeded", stacklevel=2)
        return False
    python = states["python"]
    random.setstate((python["version"], tuple(python["internal"]), python["gauss_next"]))
    numpy = states["numpy"]
    np.random.set_state(("MT19937", np.array(numpy["keys"], dtype=np.uint32), numpy["pos"], numpy["has_gauss"],
                         numpy["cached"]))
    torch.set_rng_state(_from_b64(states["torch"]))
    if states["cuda"] and torch.cuda.is_available():
        torch.cuda.set_rng_state_all([_from_b64(state) for state in states["cuda"]])
    return True


class SafeBytesMixin:
    """For DCP load planners: read non-tensor entries with ``weights_only=True`` (DCP's
    default unpickles them with ``weights_only=False``, which can run code). Meshyard's
    non-tensor entries are numbers, strings, booleans and containers of them."""

    def load_bytes(self, read_item: ReadItem, value: io.BytesIO) -> None:
        loaded = torch.load(value, weights_only=True)
        planner: Any = self  # a DefaultLoadPlanner by the class this is mixed into
        if planner.flatten_state_dict:
            set_element(planner.original_state_dict, planner.mappings[read_item.dest_index.fqn], loaded)
        else:
            planner.state_dict[read_item.dest_index.fqn] = loaded


class SafeLoadPlanner(SafeBytesMixin, DefaultLoadPlanner):
    """DCP's default load planner without unpickling of non-tensor entries."""


def optimizer_holds_state(optimizer: torch.optim.Optimizer, zero1: bool = False) -> bool:
    """Whether the optimizer has its state (a stateful one has none before its first step;
    ``tensor_state`` then builds it by stepping the optimizer with a zero learning rate,
    which counts a step)."""
    inner = optimizer.optim if zero1 else optimizer  # ZeRO-1 keeps its state in an inner optimizer
    return bool(inner.state)


def tensor_state(model: nn.Module, optimizer: torch.optim.Optimizer, rank: int,
                 extra: dict[str, Stateful] | None = None, zero1: bool = False,
                 rng_blob: torch.Tensor | None = None, with_optimizer: bool = True) -> dict[str, Any]:
    """The DCP state of this rank: model, optimizer, RNG, and any extra stateful objects
    (for example gradient-compression state), each under its own key. ``zero1``: the
    optimizer is a ``ZeroRedundancyOptimizer`` holding this rank's partition of the state
    (``Layout.zero1``). ``rng_blob``: the tensor the RNG states go into (``capture_rng``).
    Without ``with_optimizer`` the optimizer's entry is left out (and nothing builds it)."""
    if not with_optimizer:
        model_state, optim_state = get_model_state_dict(model), None
    elif zero1:
        model_state, optim_state = get_model_state_dict(model), _zero_optimizer_state(model, optimizer)
    else:
        model_state, optim_state = get_state_dict(model, optimizer, options=FLAT)
    state: dict[str, Any] = {"model": model_state}
    if optim_state is not None:
        state["optim"] = optim_state
    state[rng_key(rank)] = capture_rng(rng_blob)
    for name, obj in (extra or {}).items():
        state[f"{name}.rank{rank}"] = obj.state_dict()
    return state


def load_tensor_state(
    load: Any, model: nn.Module, optimizer: torch.optim.Optimizer, rank: int,
    saved_keys: set[str], extra: dict[str, Stateful] | None = None, zero1: bool = False,
    rng_blob: torch.Tensor | None = None,
) -> bool:
    """Fill ``model`` and ``optimizer`` from a checkpoint through ``load`` (a DCP load
    bound to the checkpoint). Returns True when this rank's RNG state was restored, which
    happens only when the checkpoint was written with a rank of the same number.
    ``rng_blob``: the tensor the saved RNG states are read into (as in ``tensor_state``)."""
    state = tensor_state(model, optimizer, rank, extra, zero1, rng_blob)
    own_keys = [k for k in state if k.startswith(("rng.", *(f"{n}." for n in (extra or {}))))]
    for key in own_keys:
        if not any(saved == key or saved.startswith(key + ".") for saved in saved_keys):
            del state[key]
    if zero1:
        # Hyperparameters come from the config and lr from the scheduler; only the state
        # tensors are read, in place.
        state["optim"] = {k: v for k, v in state["optim"].items() if k.startswith("state.")}
        load(state)
        set_model_state_dict(model, state["model"])
    else:
        load(state)
        set_state_dict(model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"],
                       options=FLAT)
    for name, obj in (extra or {}).items():
        if f"{name}.rank{rank}" in state:
            obj.load_state_dict(state[f"{name}.rank{rank}"])
    return rng_key(rank) in state and restore_rng(state[rng_key(rank)])
