"""FSDP of expert weights: their gradients are divided by the whole data-parallel degree once,
whatever the precision, also where their own mesh's shard dimension has a single rank."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh

from meshyard.models.moe import MoEFeedForward, MoEShape
from meshyard.parallel.data_parallel import apply_fsdp

D, HIDDEN, DATA_PARALLEL = 8, 16, 4.0


@pytest.mark.parametrize("param_dtype, reduce_dtype", [
    (torch.float16, None),  # fp16 gradients: torch splits the divide factor around the reduction
    (torch.float16, torch.float32),
    (None, None),
])
def test_expert_gradients_are_divided_once_on_a_shard_dimension_of_one_rank(param_dtype, reduce_dtype):
    """dp_shard = ep puts the expert weights on a shard dimension of one rank (here the
    one-process mesh), where FSDP only copies the gradient: it must come out as the gradient
    of the same computation divided by the data-parallel degree (4), not by its square."""
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    mesh = init_device_mesh("cpu", (1,))
    torch.manual_seed(0)
    model = MoEFeedForward(MoEShape(4, 2), D, HIDDEN)
    model.experts.reset_parameters(std=0.5, residual_std=0.5)
    # The same computation without FSDP: a copy of the weights in the compute precision.
    reference = copy.deepcopy(model).to(param_dtype or torch.float32)
    apply_fsdp(model, mesh, param_dtype=param_dtype, reduce_dtype=reduce_dtype, expert_mesh=mesh,
               expert_divide_factor=DATA_PARALLEL)
    x = torch.randn(2, 6, D)
    model(x).float().square().sum().backward()
    reference(x.to(param_dtype or torch.float32)).float().square().sum().backward()
    for name in ("w_in", "w_out"):
        got = getattr(model.experts, name).grad.to_local()
        want = getattr(reference.experts, name).grad.float() / DATA_PARALLEL
        torch.testing.assert_close(got, want, rtol=1e-3, atol=1e-5)
