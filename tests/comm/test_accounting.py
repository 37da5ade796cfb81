"""Byte accounting and the compression objects' contract, on one in-process rank."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from meshyard.comm import NoCompression, attach_compression, build_compression
from meshyard.comm.accounting import BUS_FACTORS, ByteCounter, wire_bytes
from meshyard.config.sections import CommConfig
from tests.comm.scenarios import loss_of, tiny_gpt


@pytest.fixture
def one_rank():
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)


def test_counter_reports_ratio_and_resets():
    counter = ByteCounter(world_size=4)
    counter.add("all_reduce", 100, 400)
    counter.add("all_gather", 10, 0)
    stats = counter.take()
    assert stats == {"comm_bytes": 110, "comm_bytes_uncompressed": 400, "compression_ratio": 400 / 110,
                     "comm_wire_bytes": round(2 * 3 / 4 * 100 + 3 * 10)}
    assert counter.take() == {"comm_bytes": 0, "comm_bytes_uncompressed": 0, "compression_ratio": 1.0,
                              "comm_wire_bytes": 0}


def test_wire_bytes_and_bus_factors_follow_ring_algorithms():
    assert wire_bytes({"all_reduce": 1000}, 1) == 0
    assert wire_bytes({"all_reduce": 1000}, 2) == 1000
    assert wire_bytes({"all_gather": 10}, 8) == 70  # top-k traffic grows with the ranks
    assert [BUS_FACTORS[k](4) for k in ("all_reduce", "all_gather", "reduce_scatter", "broadcast")] == [
        1.5, 0.75, 0.75, 1.0]


@pytest.mark.parametrize("method, expected_ratio", [("fp16", 2.0), ("bf16", 2.0), ("powersgd", None),
                                                    ("topk", None), ("none", 1.0)])
def test_each_method_counts_one_step(one_rank, method, expected_ratio):
    model = DistributedDataParallel(tiny_gpt())
    compression = build_compression(CommConfig(compression=method, warmup_steps=2, powersgd_rank=1))
    compression.register(model)
    numel = sum(p.numel() for p in model.parameters())
    ratios = []
    for step in range(3):
        loss_of(model, step, 0).backward()
        stats = compression.take_step_stats()
        assert stats["comm_bytes_uncompressed"] == 4 * numel
        assert stats["comm_wire_bytes"] == 0  # one rank sends nothing
        ratios.append(stats["compression_ratio"])
    assert ratios[:2] == [1.0, 1.0]  # warm-up syncs uncompressed
    if expected_ratio is not None:
        assert ratios[2] == expected_ratio
    else:
        assert ratios[2] > 5
    assert compression.iteration == 3


def test_plain_ddp_keeps_its_builtin_allreduce_and_is_counted(one_rank):
    model = DistributedDataParallel(nn.Linear(10, 3))
    compression = attach_compression(model, CommConfig())
    assert isinstance(compression, NoCompression)
    assert model._get_ddp_logging_data().get("comm_hook") is None  # no Python hook installed
    assert compression.take_step_stats()["comm_bytes"] == 4 * (30 + 3)


def test_no_ddp_means_no_bytes_or_no_figures(one_rank):
    assert attach_compression(nn.Linear(2, 2), CommConfig(compression="topk")).take_step_stats()["comm_bytes"] == 0
    assert NoCompression(None).take_step_stats() == {}
    assert NoCompression(None).state_dict() == {"method": "none", "iteration": 0}


def test_loading_another_methods_state_is_refused(one_rank):
    topk = build_compression(CommConfig(compression="topk"))
    with pytest.raises(ValueError, match="saved by method 'powersgd'"):
        topk.load_state_dict({"method": "powersgd", "iteration": 3})


def test_powersgd_state_survives_torch_save(one_rank, tmp_path):
    model = DistributedDataParallel(tiny_gpt())
    compression = build_compression(CommConfig(compression="powersgd", warmup_steps=2))
    compression.register(model)
    for step in range(3):
        loss_of(model, step, 0).backward()
    torch.save(compression.state_dict(), tmp_path / "comm.pt")
    state = torch.load(tmp_path / "comm.pt", weights_only=True)  # plain tensors and numbers only
    fresh = build_compression(CommConfig(compression="powersgd", warmup_steps=2))
    fresh.load_state_dict(state)
    assert fresh.iteration == 3 and set(state["q"]) == set(compression.state_dict()["q"])


@pytest.mark.parametrize("method", ["topk", "powersgd", "fp16"])
def test_state_layout_is_fixed_from_registration(one_rank, method):
    """A fresh object's state_dict() is a template with the keys and shapes a trained one
    has, which is what torch.distributed.checkpoint needs to load in place."""
    def layout(state):
        return {k: layout(v) if isinstance(v, dict) else (tuple(v.shape) if isinstance(v, torch.Tensor) else type(v))
                for k, v in state.items()}

    cfg = CommConfig(compression=method, warmup_steps=2)
    fresh = build_compression(cfg)
    fresh.register(DistributedDataParallel(tiny_gpt()))
    model = DistributedDataParallel(tiny_gpt())
    trained = build_compression(cfg)
    trained.register(model)
    for step in range(4):
        loss_of(model, step, 0).backward()
    assert layout(fresh.state_dict()) == layout(trained.state_dict())
    if method == "powersgd":
        assert fresh.state_dict()["q_valid"] == 0 and trained.state_dict()["q_valid"] == 1
