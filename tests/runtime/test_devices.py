"""Device decisions without a GPU: backend choice, process counts, GPU sharing, cuBLAS setting."""

from __future__ import annotations

import os
import socket
import threading

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch.distributed.distributed_c10d import BackendConfig

from meshyard.config.load import ConfigError
from meshyard.metrics.ranks import RankWindow
from meshyard.runtime.devices import (CUBLAS_WORKSPACE, default_nproc, local_launch_problem, process_group_backend,
                                      require_deterministic_cublas, shared_gpu_groups)
from meshyard.runtime.distributed import init_distributed, ranks_share_gpus, shutdown_distributed
from meshyard.runtime.environment import ClusterEnvironment
from meshyard.runtime.parallel_dims import ParallelDims


def test_cpu_tensors_go_to_gloo_whatever_the_device():
    # torch's own parser of backend strings, the one init_process_group uses.
    assert BackendConfig(dist.Backend(process_group_backend("cpu"))).get_device_backend_map()["cpu"] == "gloo"
    cuda = BackendConfig(dist.Backend(process_group_backend("cuda"))).get_device_backend_map()
    assert cuda == {"cpu": "gloo", "cuda": "nccl"}
    # Ranks sharing a GPU: NCCL refuses them, so gloo carries CUDA tensors too.
    shared = BackendConfig(dist.Backend(process_group_backend("cuda", shared_gpus=True))).get_device_backend_map()
    assert shared == {"cpu": "gloo", "cuda": "gloo"}


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _cpu_collectives(rank: int, world: int, port: int, queue: mp.Queue) -> None:
    """Every kind of CPU collective the trainer and metrics issue, on the group that
    ``init_distributed`` creates (not one a test helper made)."""
    env = ClusterEnvironment("slurm", rank, world, rank, world, "127.0.0.1", port)
    runtime = init_distributed(env, "cpu", threads_per_rank=1, timeout_s=60)
    try:
        flags = torch.tensor([float(rank + 1), 1.0], dtype=torch.float64)  # like the per-step agreement
        dist.all_reduce(flags)
        box = [f"from rank {rank}"]
        dist.broadcast_object_list(box, src=0)
        objects: list = [None] * world
        dist.all_gather_object(objects, rank * 10)
        window = RankWindow(every=1, straggler_factor=1.5)
        window.add({"busy_s": 1.0 + rank})
        gathered = window.gather()
        _, dp_mesh = ParallelDims.resolve("fsdp", world).build_mesh(runtime.device.type)
        on_mesh = torch.ones(2)
        dist.all_reduce(on_mesh, group=dp_mesh.get_group())
        queue.put((rank, runtime.backend, flags.tolist(), box[0], objects, gathered, on_mesh.tolist()))
    finally:
        shutdown_distributed()


def test_default_group_takes_every_cpu_collective_on_two_ranks():
    queue = mp.get_context("spawn").Queue()
    mp.spawn(_cpu_collectives, args=(2, _free_port(), queue), nprocs=2, join=True)
    results = dict((item[0], item[1:]) for item in (queue.get(timeout=30) for _ in range(2)))
    for rank, (backend, flags, box, objects, gathered, on_mesh) in results.items():
        assert backend == process_group_backend("cpu")
        assert flags == [3.0, 2.0] and box == "from rank 0" and objects == [0, 10] and on_mesh == [2.0, 2.0]
        assert (gathered is None) == (rank != 0)
    assert results[0][4]["ranks"]["busy_s"] == [1.0, 2.0]


@pytest.mark.parametrize("request_, gpus, expected", [("auto", 4, 4), ("cuda", 2, 2), ("auto", 0, 2), ("cpu", 8, 2)])
def test_default_process_count_is_one_per_gpu_on_cuda(request_, gpus, expected):
    assert default_nproc(request_, gpus) == expected


def test_more_local_ranks_than_gpus_is_refused_unless_shared():
    problem = local_launch_problem(2, "auto", 1, share_gpus=False)
    assert problem and "--nproc 1" in problem and "run.share_gpus = true" in problem
    assert local_launch_problem(2, "auto", 1, share_gpus=True) is None
    assert local_launch_problem(2, "auto", 2, share_gpus=False) is None
    assert local_launch_problem(4, "cpu", 1, share_gpus=False) is None  # CPU ranks share nothing
    assert local_launch_problem(4, "auto", 0, share_gpus=False) is None
    assert "no CUDA device is visible" in local_launch_problem(1, "cuda", 0, share_gpus=False)


def test_ranks_on_one_gpu_are_found_by_uuid():
    assert shared_gpu_groups(["GPU-a", "GPU-b", "GPU-a", "GPU-c", "GPU-b"]) == [[0, 2], [1, 4]]
    assert shared_gpu_groups(["GPU-a", "GPU-b"]) == []


def _exchange(uuids: list[str], allowed: bool) -> list:
    """Every rank's verdict of ``ranks_share_gpus`` over one real store (one thread per rank)."""
    store, verdicts = dist.HashStore(), [None] * len(uuids)

    def rank_main(rank: int) -> None:
        try:
            verdicts[rank] = ranks_share_gpus(store, rank, len(uuids), uuids[rank], allowed)
        except ConfigError as exc:
            verdicts[rank] = exc

    threads = [threading.Thread(target=rank_main, args=(rank,)) for rank in range(len(uuids))]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=30)
    return verdicts


def test_every_rank_refuses_a_shared_gpu_unless_allowed():
    # Per-task binding: every rank sees its GPU as CUDA device 0, yet the GPUs differ.
    assert _exchange(["GPU-a", "GPU-b", "GPU-c"], allowed=False) == [False, False, False]
    refused = _exchange(["GPU-a", "GPU-b", "GPU-a"], allowed=False)
    assert all(isinstance(v, ConfigError) and "ranks 0, 2 on one GPU" in str(v) for v in refused)
    assert "run.share_gpus = true" in str(refused[0])
    assert _exchange(["GPU-a", "GPU-b", "GPU-a"], allowed=True) == [True, True, True]


def test_cuda_run_on_a_machine_without_gpu_exits_2_with_message(tmp_path, capsys):
    from meshyard.cli import main

    assert main(["run", "--run.device=cuda", "--nproc=1", f"--run.dir={tmp_path}"]) == 2
    err = capsys.readouterr().err
    assert "run.device = 'cuda' but no CUDA device is visible" in err and "Traceback" not in err


def test_local_launch_with_more_ranks_than_gpus_is_refused_before_starting(make_config, monkeypatch, tmp_path):
    import meshyard

    monkeypatch.setattr("meshyard.validate.visible_gpu_count", lambda: 1)
    with pytest.raises(ConfigError, match="ranks would share a GPU"):
        meshyard.run(make_config(), nproc=2)
    assert not (tmp_path / "run").exists()  # nothing started, no run directory


def test_deterministic_cublas_setting():
    environ: dict[str, str] = {}
    require_deterministic_cublas(True, "auto", environ)
    assert environ == {"CUBLAS_WORKSPACE_CONFIG": CUBLAS_WORKSPACE}
    mine = {"CUBLAS_WORKSPACE_CONFIG": ":16:8"}
    require_deterministic_cublas(True, "cuda", mine)
    assert mine == {"CUBLAS_WORKSPACE_CONFIG": ":16:8"}  # the user's choice stays
    for deterministic, device in ((False, "cuda"), (True, "cpu")):
        untouched: dict[str, str] = {}
        require_deterministic_cublas(deterministic, device, untouched)
        assert untouched == {}


class _DeviceChosen(Exception):
    pass


def test_worker_sets_cublas_before_choosing_the_device(make_config, monkeypatch):
    from meshyard.config.dump import config_to_dict
    from meshyard.fault.failure import RankFailed
    from meshyard.worker import run_worker

    monkeypatch.setenv("CUBLAS_WORKSPACE_CONFIG", "unset")  # restored after the test
    monkeypatch.delenv("CUBLAS_WORKSPACE_CONFIG")
    seen = []

    def choose_device(requested: str, local_rank: int) -> torch.device:
        seen.append(os.environ.get("CUBLAS_WORKSPACE_CONFIG"))
        raise _DeviceChosen

    monkeypatch.setattr("meshyard.runtime.distributed.choose_device", choose_device)
    with pytest.raises(RankFailed) as failed:  # a worker's exception, as one paragraph with its cause
        run_worker(config_to_dict(make_config("--train.deterministic=true", "--run.nproc=1")))
    assert isinstance(failed.value.__cause__, _DeviceChosen)
    assert seen == [CUBLAS_WORKSPACE]


def test_launched_workers_inherit_the_cublas_setting(make_config, monkeypatch):
    import meshyard

    monkeypatch.setenv("CUBLAS_WORKSPACE_CONFIG", "unset")
    monkeypatch.delenv("CUBLAS_WORKSPACE_CONFIG")
    inherited = []

    def launch_local(entrypoint, args, nproc, *rest):
        inherited.append(os.environ.get("CUBLAS_WORKSPACE_CONFIG"))  # what spawned workers start with
        return {0: {"steps": 0}}

    monkeypatch.setattr("meshyard.api.launch_local", launch_local)
    meshyard.run(make_config("--train.deterministic=true"), nproc=2)
    assert inherited == [CUBLAS_WORKSPACE]
