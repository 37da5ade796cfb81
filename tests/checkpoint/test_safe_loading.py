"""Loading a checkpoint runs none of its pickles: RNG states are JSON and non-tensor
entries are read with ``weights_only=True``."""

from __future__ import annotations

import pickle
import random
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemWriter

from meshyard.checkpoint.checkpointer import Checkpointer, TrainingState
from meshyard.checkpoint.manager import NullCheckpointManager
from meshyard.checkpoint.resume import ResumePoint
from meshyard.checkpoint.state import RNG_BLOB_BYTES, capture_rng, restore_rng, rng_key, tensor_state
from meshyard.checkpoint.tools import model_state, read_full_state, resolve
from meshyard.config.load import load_config


class Planted:
    """Unpickling this creates ``path``: proof that a pickle from the checkpoint ran."""

    def __init__(self, path: Path) -> None:
        self.path = str(path)

    def __reduce__(self):
        return open, (self.path, "w")


@pytest.fixture
def one_rank():
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    yield
    dist.destroy_process_group()


def fresh_state() -> TrainingState:
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 3)
    optimizer = torch.optim.AdamW(model.parameters())
    model(torch.randn(2, 4)).sum().backward()
    optimizer.step()
    return TrainingState(model, optimizer)


def fresh_checkpointer() -> Checkpointer:
    return Checkpointer(NullCheckpointManager(), fresh_state(), rank=0, cfg=load_config(None, []).checkpoint)


def write_checkpoint(root: Path, tamper) -> ResumePoint:
    """A checkpoint of a small model whose DCP state was changed by ``tamper`` first."""
    parts = fresh_state()
    state = tensor_state(parts.model, parts.optimizer, rank=0)
    tamper(state)
    directory = root / "step-00000001"
    dcp.save(state, storage_writer=FileSystemWriter(str(directory)))
    (directory / "trainer_state.json").write_text("{}")
    (directory / "manifest.json").write_text("{}")
    return ResumePoint(str(root), directory.name, {})


def pickled_blob(obj) -> torch.Tensor:
    """The RNG slot as older checkpoints filled it: a length, then a pickle."""
    payload = pickle.dumps(obj)
    blob = torch.zeros(RNG_BLOB_BYTES, dtype=torch.uint8)
    blob[:8] = torch.frombuffer(bytearray(len(payload).to_bytes(8, "little")), dtype=torch.uint8)
    blob[8 : 8 + len(payload)] = torch.frombuffer(bytearray(payload), dtype=torch.uint8)
    return blob


def test_a_pickle_in_the_rng_slot_is_never_run(one_rank, tmp_path):
    marker = tmp_path / "ran"
    point = write_checkpoint(tmp_path, lambda state: state.update({rng_key(0): pickled_blob(Planted(marker))}))
    with pytest.warns(UserWarning, match="RNG state is not in"):
        restored = fresh_checkpointer().load(point)
    assert not marker.exists()
    assert restored is False  # the caller reseeds


def test_a_pickle_in_a_hyperparameter_is_never_run(one_rank, tmp_path):
    marker = tmp_path / "ran"

    def plant(state):
        key = next(k for k in state["optim"] if k.startswith("param_groups.") and k.endswith(".lr"))
        state["optim"][key] = Planted(marker)

    point = write_checkpoint(tmp_path, plant)
    with pytest.raises(BaseException, match="weights_only|Unsupported global"):
        fresh_checkpointer().load(point)
    with pytest.raises(BaseException, match="weights_only|Unsupported global"):
        read_full_state(resolve(point.location, {}))  # the offline tools read the same way
    assert model_state(resolve(point.location, {}))  # the model alone never reads the optimizer's entries
    assert not marker.exists()


def test_rng_state_round_trips_exactly():
    random.seed(1), np.random.seed(2), torch.manual_seed(3)
    random.gauss(0, 1)  # a cached Gaussian in Python's generator
    np.random.standard_normal()  # and in NumPy's
    blob = capture_rng()
    expected = (random.random(), random.gauss(0, 1), np.random.standard_normal(4), torch.rand(4))
    random.seed(9), np.random.seed(9), torch.manual_seed(9)
    assert restore_rng(blob.clone())
    again = (random.random(), random.gauss(0, 1), np.random.standard_normal(4), torch.rand(4))
    assert expected[:2] == again[:2]
    assert np.array_equal(expected[2], again[2]) and torch.equal(expected[3], again[3])
    assert bytes(blob[8:9].tolist()) == b"{"  # JSON, not a pickle
