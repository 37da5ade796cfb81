"""Device decisions made before a process group exists: how many local processes, which
backend carries collectives, whether ranks may share a GPU, and the CUDA settings that
must be in place before CUDA starts.

Each decision is a function of plain values (a GPU count, a device type) so it can be
checked without a GPU; the callers read the machine.
"""

from __future__ import annotations

from collections import defaultdict
from typing import MutableMapping, Sequence

import torch

CUBLAS_WORKSPACE = ":4096:8"
"""cuBLAS workspace setting that makes its kernels deterministic (CUDA >= 10.2)."""

CPU_DEFAULT_NPROC = 2

SHARE_OPT_IN = (
    "set run.share_gpus = true to let ranks share a GPU (their collectives then go through gloo, because "
    "NCCL refuses two ranks on one GPU: slow, for trying a layout only)"
)


def visible_gpu_count() -> int:
    """CUDA devices this process can see (after CUDA_VISIBLE_DEVICES or a scheduler's binding)."""
    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def uses_cuda(device_request: str, gpu_count: int) -> bool:
    """Whether ``run.device`` resolves to CUDA on a machine with ``gpu_count`` visible GPUs."""
    return device_request == "cuda" or (device_request == "auto" and gpu_count > 0)


def default_nproc(device_request: str, gpu_count: int) -> int:
    """Local processes when ``run.nproc`` is 0: one per visible GPU where the run uses CUDA,
    else two CPU workers (the smallest job that exercises every collective)."""
    if uses_cuda(device_request, gpu_count) and gpu_count > 0:
        return gpu_count
    return CPU_DEFAULT_NPROC


def local_launch_problem(nproc: int, device_request: str, gpu_count: int, share_gpus: bool) -> str | None:
    """What is wrong with starting ``nproc`` workers on this machine, or None.

    All local workers see the same GPUs, so more workers than GPUs means two ranks on
    one GPU; that is refused unless ``run.share_gpus`` allows it.
    """
    if device_request == "cuda" and gpu_count == 0:
        return "run.device = 'cuda' but no CUDA device is visible; use run.device = 'auto' or 'cpu'"
    if uses_cuda(device_request, gpu_count) and nproc > gpu_count and not share_gpus:
        return (f"run.nproc = {nproc} starts {nproc} ranks on this machine's {gpu_count} visible GPU(s), so "
                f"ranks would share a GPU; use --nproc {gpu_count} (one rank per GPU), or run.device = 'cpu', "
                f"or {SHARE_OPT_IN}")
    return None


def shared_gpu_groups(gpu_ids: Sequence[str]) -> list[list[int]]:
    """Groups of ranks that compute on the same GPU, given each rank's GPU UUID
    (indexed by rank; UUIDs name a GPU uniquely across hosts)."""
    ranks_by_gpu: dict[str, list[int]] = defaultdict(list)
    for rank, gpu_id in enumerate(gpu_ids):
        ranks_by_gpu[gpu_id].append(rank)
    return [ranks for ranks in ranks_by_gpu.values() if len(ranks) > 1]


def sharing_message(groups: list[list[int]]) -> str:
    """The refusal for ranks that landed on one GPU, naming them and the fix."""
    where = "; ".join(f"ranks {', '.join(map(str, ranks))} on one GPU" for ranks in groups)
    return (f"two or more ranks of this job would compute on the same GPU ({where}); start one process per "
            f"GPU (torchrun --nproc-per-node = GPUs per node, Slurm --gpus-per-task=1), or {SHARE_OPT_IN}")


def process_group_backend(device_type: str, shared_gpus: bool = False) -> str:
    """The backend string of the default process group.

    CPU tensors always go through gloo: the trainer's per-step agreement, evaluation
    means, the per-rank metric gathers and every object collective work on CPU tensors,
    and NCCL has no CPU backend, so a plain "nccl" group would fail at the first step.
    On CUDA a device map sends CUDA tensors to NCCL and CPU tensors to gloo. When ranks
    share a GPU, NCCL refuses to start, so gloo carries CUDA tensors as well.
    """
    if device_type != "cuda" or shared_gpus:
        return "gloo"
    return "cpu:gloo,cuda:nccl"


def require_deterministic_cublas(deterministic: bool, device_request: str,
                                 environ: MutableMapping[str, str]) -> None:
    """Set ``CUBLAS_WORKSPACE_CONFIG`` for ``train.deterministic`` runs that may use CUDA,
    keeping a value the user chose.

    cuBLAS reads it when CUDA starts in the process, and PyTorch refuses cuBLAS calls in
    deterministic mode without it, so this must run before any CUDA call (and before
    workers are started, which inherit ``environ``).
    """
    if deterministic and device_request != "cpu":
        environ.setdefault("CUBLAS_WORKSPACE_CONFIG", CUBLAS_WORKSPACE)
