from __future__ import annotations

import copy
import math

import pytest
import torch

from meshyard.config.load import load_config
from meshyard.models.gpt import GPT, GPTShape
from meshyard.train.optim import (build_optimizer, build_scheduler, built_step, lr_multiplier, parameter_groups,
                                  scaled_peak_lr, step_implementation)


def test_warmup_then_cosine_to_floor():
    values = [lr_multiplier(s, warmup_steps=10, total_steps=110, schedule="cosine", min_lr_ratio=0.1)
              for s in range(110)]
    assert values[0] == pytest.approx(0.1) and values[9] == pytest.approx(1.0)
    assert all(a < b for a, b in zip(values[:10], values[1:10]))  # rising warmup
    assert values[10] == pytest.approx(1.0)
    assert values[-1] == pytest.approx(0.1)  # floor reached at the last step
    assert all(a >= b for a, b in zip(values[10:], values[11:]))  # monotone decay
    mid = 10 + 99 // 2
    assert values[mid] == pytest.approx(0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * (mid - 10) / 99)))


def test_constant_schedule_and_no_warmup():
    assert [lr_multiplier(s, 0, 50, "constant", 0.1) for s in (0, 25, 49)] == [1.0, 1.0, 1.0]


@pytest.mark.parametrize("rule, expected", [("none", 1e-3), ("linear", 4e-3), ("sqrt", 2e-3)])
def test_lr_scaling(rule, expected):
    cfg = load_config(None, ["--optim.lr=1e-3", f"--optim.lr_scaling={rule}", "--optim.reference_batch=64"])
    assert scaled_peak_lr(cfg.optim, global_batch=256) == pytest.approx(expected)


def test_scheduler_drives_optimizer_lr():
    model = torch.nn.Linear(4, 4)
    cfg = load_config(None, ["--optim.warmup_steps=2", "--optim.schedule=constant"]).optim
    opt = build_optimizer(model, cfg, peak_lr=0.5)
    sched = build_scheduler(opt, cfg, total_steps=10)
    seen = []
    for _ in range(4):
        seen.append(opt.param_groups[0]["lr"])
        opt.step()
        sched.step()
    assert seen == pytest.approx([0.25, 0.5, 0.5, 0.5])


def test_no_weight_decay_on_biases_and_norms():
    model = GPT(GPTShape(vocab_size=16, context_length=8, n_layer=1, n_head=2, d_model=8))
    decay, no_decay = parameter_groups(model, 0.1)
    assert all(p.dim() >= 2 for p in decay["params"]) and all(p.dim() < 2 for p in no_decay["params"])
    assert no_decay["weight_decay"] == 0.0
    assert len(decay["params"]) + len(no_decay["params"]) == len(list(model.parameters()))


def test_sgd():
    cfg = load_config(None, ["--optim.name=sgd", "--optim.momentum=0.5"]).optim
    opt = build_optimizer(torch.nn.Linear(2, 2), cfg, peak_lr=0.1)
    assert isinstance(opt, torch.optim.SGD) and opt.param_groups[0]["momentum"] == 0.5


def test_the_step_is_fused_on_one_device_type_of_floats_and_pytorchs_default_otherwise():
    class OnDevice(torch.Tensor):
        """A parameter that reports another device type (no accelerator here)."""

        device_type = "cuda"

        @property
        def device(self):
            return torch.device(self.device_type)

    def on(device_type: str, dtype: torch.dtype = torch.float32):
        param = torch.zeros(2, dtype=dtype).as_subclass(OnDevice)
        param.device_type = device_type
        return param

    assert step_implementation([on("cuda"), on("cuda", torch.bfloat16)]) == "fused"
    assert step_implementation([on("cuda"), on("cuda", torch.int64)]) == "foreach"  # fused needs floats
    assert step_implementation([on("cuda"), on("cpu")]) == "for-loop"  # mixed devices
    assert step_implementation([on("cpu"), on("cpu", torch.bfloat16)]) == "fused"
    assert step_implementation([on("cpu"), on("cpu", torch.int64)]) == "for-loop"
    assert step_implementation([on("meta")]) == "for-loop"
    # fp16's sharded loss scaler hands the step a one-element inf flag the fused step refuses.
    assert step_implementation([on("cuda")], sharded_loss_scaling=True) == "foreach"
    assert step_implementation([on("cpu")], sharded_loss_scaling=True) == "for-loop"
    for name in ("adamw", "sgd"):
        cpu_optimizer = build_optimizer(torch.nn.Linear(2, 2), load_config(None, [f"--optim.name={name}"]).optim, 0.1)
        assert cpu_optimizer.defaults["fused"] and built_step(cpu_optimizer) == "fused"  # what run.json records


@pytest.mark.parametrize("name", ["adamw", "sgd"])
def test_the_fused_cpu_step_matches_pytorchs_default_loop(name):
    """The fused step on CPU is the same update as the loop it replaces, to rounding."""
    cfg = load_config(None, [f"--optim.name={name}", "--optim.weight_decay=0.1"]).optim
    torch.manual_seed(0)
    fused_model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.GELU(), torch.nn.Linear(16, 4))
    loop_model = copy.deepcopy(fused_model)
    fused = build_optimizer(fused_model, cfg, 1e-2)
    loop = torch.optim.AdamW if name == "adamw" else torch.optim.SGD
    kwargs = {"betas": tuple(cfg.betas), "eps": cfg.eps} if name == "adamw" else {"momentum": cfg.momentum}
    loop_optimizer = loop(parameter_groups(loop_model, cfg.weight_decay), lr=1e-2, foreach=False, **kwargs)
    for _ in range(5):
        batch = torch.randn(32, 8)
        for model, optimizer in ((fused_model, fused), (loop_model, loop_optimizer)):
            model(batch).square().mean().backward()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
    for a, b in zip(fused_model.parameters(), loop_model.parameters()):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


def test_a_mix_of_plain_tensors_and_dtensors_steps_in_a_loop():
    """Tensor parallelism without sequence parallelism shards the matrices and leaves the
    norms plain: the fused step (one call over a list) refuses that mix, the loop takes it."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, distribute_tensor

    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    mesh = init_device_mesh("cpu", (1,))
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.LayerNorm(4))
    model[0].weight = torch.nn.Parameter(distribute_tensor(model[0].weight.detach(), mesh, [Replicate()]))
    model[0].bias = torch.nn.Parameter(distribute_tensor(model[0].bias.detach(), mesh, [Replicate()]))
    parameters = list(model.parameters())
    assert step_implementation(parameters) == "for-loop"
    assert step_implementation(parameters[:2]) == "fused"  # all DTensor
    assert step_implementation(parameters[:2], optimizer="sgd") == "for-loop"  # no DTensor rule for fused SGD
    optimizer = build_optimizer(model, load_config(None, []).optim, 0.1)
    for param in parameters:
        param.grad = torch.ones_like(param)
    optimizer.step()  # the fused step would raise on the mix
    assert not optimizer.defaults["fused"] and optimizer.defaults["foreach"] is False
    assert built_step(optimizer) == "for-loop"
