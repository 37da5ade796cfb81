"""NCCL runs on real GPUs: the default group, DDP and FSDP through the worker path, and
ranks sharing a GPU. Skipped with "needs a CUDA GPU" where torch sees none."""

from __future__ import annotations

import json
import math

import pytest
import torch
import torch.distributed as dist

import meshyard
from meshyard.config.load import ConfigError
from meshyard.runtime.devices import process_group_backend
from meshyard.runtime.distributed import init_distributed, shutdown_distributed
from meshyard.runtime.parallel_dims import ParallelDims

pytestmark = pytest.mark.gpu

# Evaluation, the per-rank gather and the per-step agreement all issue CPU collectives.
EXERCISE_CPU_COLLECTIVES = ("--train.steps=6", "--train.eval_every=3", "--metrics.gather_every=2")


def test_default_group_takes_cpu_and_cuda_collectives():
    runtime = init_distributed(None, "cuda", threads_per_rank=1)
    try:
        assert runtime.device.type == "cuda"
        assert runtime.backend == process_group_backend("cuda") == "cpu:gloo,cuda:nccl"
        on_cpu, on_gpu = torch.ones(3), torch.ones(3, device=runtime.device)
        dist.all_reduce(on_cpu)
        dist.all_reduce(on_gpu)
        assert on_cpu.tolist() == on_gpu.tolist() == [1.0, 1.0, 1.0]
        box: list = [None]
        dist.all_gather_object(box, {"rank": 0})
        assert box == [{"rank": 0}]
        # Mesh groups inherit the device map: CPU tensors work on them too.
        mesh, dp_mesh = ParallelDims.resolve("fsdp", 1).build_mesh(runtime.device.type)
        for group in (dp_mesh.get_group(), mesh["tp"].get_group()):
            tensor = torch.full((2,), 2.0)
            dist.all_reduce(tensor, group=group)
            assert tensor.tolist() == [2.0, 2.0]
    finally:
        shutdown_distributed()


def _check_run(result: meshyard.RunResult, world_size: int, device_type: str = "cuda") -> list[dict]:
    facts = json.loads((result.run_dir / "run.json").read_text())
    assert facts["device"].startswith(device_type) and facts["world_size"] == world_size
    records = result.metrics()
    assert len(records) == 6 and all(math.isfinite(r["loss"]) for r in records)
    assert all(r["gpu_peak_allocated_bytes"] > 0 for r in records)
    assert [r["step"] for r in records if "eval_loss" in r] == [3, 6]
    assert [r["step"] for r in records if "ranks" in r] == [2, 4, 6]
    return records


@pytest.mark.parametrize("strategy", ["ddp", "fsdp"])
def test_one_gpu_through_the_worker(make_config, strategy):
    cfg = make_config("--run.device=cuda", f"--parallel.strategy={strategy}", *EXERCISE_CPU_COLLECTIVES)
    result = meshyard.run(cfg, nproc=1)
    _check_run(result, 1)
    assert json.loads((result.run_dir / "run.json").read_text())["backend"] == "cpu:gloo,cuda:nccl"


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two GPUs")
@pytest.mark.parametrize("strategy", ["ddp", "fsdp"])
def test_two_gpus_through_the_worker(make_config, strategy):
    cfg = make_config("--run.device=cuda", f"--parallel.strategy={strategy}", *EXERCISE_CPU_COLLECTIVES)
    records = _check_run(meshyard.run(cfg, nproc=2), 2)
    assert all(len(values) == 2 for values in records[1]["ranks"].values())


def test_more_ranks_than_gpus_need_the_opt_in(make_config):
    nproc = torch.cuda.device_count() + 1  # the last rank lands on GPU 0
    batch = f"--train.global_batch={4 * nproc}"
    with pytest.raises(ConfigError, match="ranks would share a GPU"):
        meshyard.run(make_config("--run.device=cuda", batch), nproc=nproc)
    cfg = make_config("--run.device=cuda", "--run.share_gpus=true", "--parallel.strategy=ddp", batch,
                      *EXERCISE_CPU_COLLECTIVES)
    result = meshyard.run(cfg, nproc=nproc)
    _check_run(result, nproc)
    assert json.loads((result.run_dir / "run.json").read_text())["backend"] == "gloo"  # NCCL refuses sharing
