"""Trainer mechanics in one process: no gradient sync on accumulation micro-steps, clipping."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

from meshyard.train.trainer import clip_grad_norm


@pytest.fixture
def one_rank_group():
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    yield
    dist.destroy_process_group()


def test_ddp_syncs_only_on_last_micro_step(one_rank_group, make_config):
    from meshyard.parallel.data_parallel import set_gradient_sync

    model = DistributedDataParallel(torch.nn.Linear(8, 8))
    calls = []

    def counting_hook(state, bucket):
        calls.append(bucket.index())
        fut = torch.futures.Future()
        fut.set_result(bucket.buffer())
        return fut

    model.register_comm_hook(None, counting_hook)
    synced_per_micro_step = []
    for index in range(4):
        set_gradient_sync(model, index == 3)
        before = len(calls)
        model(torch.randn(2, 8)).sum().backward()
        synced_per_micro_step.append(len(calls) - before)
    assert synced_per_micro_step[:3] == [0, 0, 0] and synced_per_micro_step[3] > 0


def test_clip_grad_norm_reports_global_norm_and_clips():
    params = [torch.nn.Parameter(torch.zeros(3)), torch.nn.Parameter(torch.zeros(4))]
    params[0].grad = torch.tensor([3.0, 0.0, 0.0])
    params[1].grad = torch.tensor([0.0, 4.0, 0.0, 0.0])
    norm = clip_grad_norm(params, max_norm=1.0)
    assert norm.item() == pytest.approx(5.0)
    total = torch.cat([p.grad for p in params]).norm()
    assert total.item() == pytest.approx(1.0, rel=1e-5)
    unclipped = clip_grad_norm(params, max_norm=0.0)
    assert unclipped.item() == pytest.approx(1.0, rel=1e-5)
