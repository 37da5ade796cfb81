"""Trainer mechanics in one process: no gradient sync on accumulation micro-steps, clipping."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

from meshyard.train.trainer import clip_grad_norm
from tests import shared_spawn


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


def _clip_dtensor_gradients(rank: int, world_size: int) -> list[list[float]]:
    """Two ranks' gradients of each placement tensor parallelism leaves, clipped to norm 1:
    a partial sum ([1, 0] + [2, 0]), a shard of [0, 4, 0, 0] and a replicated [0, 0, 12]
    (the whole norm 13); returns each gradient's full tensor after clipping and the norm."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Partial, Replicate, Shard

    mesh = init_device_mesh("cpu", (world_size,))
    pieces = [([1.0, 0.0], [2.0, 0.0]), ([0.0, 4.0], [0.0, 0.0]), ([0.0, 0.0, 12.0],) * 2]
    params = []
    for local, placement in zip(pieces, [Partial(), Shard(0), Replicate()]):
        value = torch.tensor(local[rank])
        param = torch.nn.Parameter(DTensor.from_local(torch.zeros_like(value), mesh, [placement]))
        param.grad = DTensor.from_local(value, mesh, [placement])
        params.append(param)
    norm = clip_grad_norm(params, max_norm=1.0)
    return [p.grad.full_tensor().tolist() for p in params] + [[norm.item()]]


shared_spawn.register(2, "trainer: clipped dtensor gradients", __name__,
                      lambda request, folder: (_clip_dtensor_gradients, ()))


def test_clip_grad_norm_scales_dtensor_gradients_of_every_placement(request):
    """Tensor parallelism leaves partial-sum gradients (its layer norms) beside sharded and
    replicated ones: every rank sees each scaled by the same coefficient (torch 2.10-2.11
    dropped the foreach multiply of a partial one on two ranks or more, leaving it unclipped)."""
    _, per_rank = shared_spawn.result(request, 2, "trainer: clipped dtensor gradients")
    scale = 1.0 / (13.0 + 1e-6)
    expected = [[3.0 * scale, 0.0], [0.0, 4.0 * scale, 0.0, 0.0], [0.0, 0.0, 12.0 * scale], [13.0]]
    for grads in per_rank:
        for got, want in zip(grads, expected):
            assert got == pytest.approx(want, rel=1e-5)


def test_async_saves_record_the_wait_for_their_copy_on_the_step_after(make_config):
    """The loop's cost of an async save is the save call plus the next step's wait for the
    copy of the state; on the CPU that copy of a tiny model is done long before it is needed."""
    import meshyard

    cfg = make_config("--parallel.strategy=none", "--train.steps=5", "--checkpoint.enabled=true",
                      "--checkpoint.interval=2", "--checkpoint.async_save=true", "--checkpoint.save_final=false")
    records = meshyard.run(cfg, nproc=1).metrics()
    after_save = [r for r in records if "checkpoint_stall_s" in r]
    assert [r["step"] for r in after_save] == [3, 5]
    for record in after_save:
        assert 0.0 <= record["checkpoint_staging_wait_s"] < 0.5, record
        assert 0.0 <= record["checkpoint_previous_wait_s"] <= record["checkpoint_stall_s"], record
    assert not any("checkpoint_staging_wait_s" in r for r in records if "checkpoint_stall_s" not in r)


def test_a_run_freezes_what_set_up_and_the_first_step_made_and_thaws_it_after(make_config, monkeypatch):
    """Set-up's objects and the first step's (a compile's) are frozen out of the collector's
    reach during the run (runtime/collector.py), the collector's time is in the records, and
    a run in this process gives everything back to the collector when it ends."""
    import gc

    import meshyard
    from meshyard.runtime import collector

    frozen_counts = []

    freeze = collector.freeze_long_lived

    def freezing():
        freeze()
        frozen_counts.append(gc.get_freeze_count())

    monkeypatch.setattr(collector, "freeze_long_lived", freezing)
    callbacks = list(gc.callbacks)
    records = meshyard.run(make_config("--parallel.strategy=none", "--train.steps=4"), nproc=1).metrics()
    assert len(frozen_counts) == 2 and frozen_counts[0] > 0 and frozen_counts[1] >= frozen_counts[0]
    assert gc.get_freeze_count() == 0
    assert gc.callbacks == callbacks
    # The freeze after step 1 is a full collection, counted in step 2's record.
    assert records[1]["gc_s"] > 0
    assert all(r["gc_s"] > 0 for r in records if "gc_s" in r)
