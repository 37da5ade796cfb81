"""Meta-device initialisation: sharded and pipelined models start from exactly the
weights of a one-process build, and no rank ever holds the whole model."""

from __future__ import annotations

import json
import math
import os

import pytest
import torch
from torch import nn

import meshyard
from meshyard.models.deferred_init import DeferredInitError, record_build
from meshyard.models.gpt import GPT, GPTShape
from meshyard.models.mlp import MLP
from meshyard.config.sections import ParallelConfig
from meshyard.parallel.layout import Layout
from meshyard.parallel.materialize import build_model_deferred, materialize
from tests.conftest import tiny_config
from tests.parallel.meta_scenarios import LARGE, LAYOUTS, SEED, SHAPE, build_peaks, held_values
from tests.ranks import run_on_ranks
from tests.train.test_parity import DATA, assert_close

CPU = torch.device("cpu")


def full_build(build) -> tuple[nn.Module, torch.Tensor]:
    """``build()`` on the CPU as before meta initialisation, and the generator state after it."""
    torch.manual_seed(SEED)
    model = build()
    return model, torch.get_rng_state()


def assert_same_tensors(actual: nn.Module, expected: nn.Module) -> None:
    named = dict(expected.named_parameters(remove_duplicate=False)) | dict(expected.named_buffers())
    got = dict(actual.named_parameters(remove_duplicate=False)) | dict(actual.named_buffers())
    assert got.keys() == named.keys()
    for name, tensor in named.items():
        assert got[name].device == tensor.device and torch.equal(got[name], tensor), name


class WithBuffers(nn.Module):
    """A model meshyard did not write: values given at construction, a computed causal
    mask, torch.nn.init functions that skip meta tensors, an in-place step after one."""

    def __init__(self, vocab_size: int = 32, width: int = 16) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab_size, width)
        self.scale = nn.Parameter(torch.ones(width))
        self.proj = nn.Linear(width, width)
        self.register_buffer("mask", torch.tril(torch.ones(8, 8)), persistent=False)
        # Rejection sampling: how many numbers it draws depends on the values drawn.
        nn.init.trunc_normal_(self.proj.weight, std=0.5, a=-0.3, b=0.3)
        self.rotate = nn.Linear(width, width, bias=False)
        nn.init.orthogonal_(self.rotate.weight)  # does nothing at all on a meta tensor
        with torch.no_grad():
            self.rotate.weight.mul_(2.0)


@pytest.mark.parametrize("build", [
    lambda: GPT(SHAPE),
    lambda: GPT(GPTShape(**{**SHAPE.__dict__, "tie_embeddings": False})),
    lambda: MLP(vocab_size=32, d_model=16, n_layer=3),
    WithBuffers,
], ids=["gpt-tied", "gpt-untied", "mlp", "own-model"])
def test_materialized_build_equals_the_full_build(build):
    expected, rng_expected = full_build(build)
    torch.manual_seed(SEED)
    model, record = record_build(build, CPU)
    assert torch.equal(torch.get_rng_state(), rng_expected), "the build must draw as many random numbers"
    # Every parameter is on the meta device but a value given at construction (torch.ones).
    built = [name for name, p in model.named_parameters() if not p.is_meta]
    assert built == (["scale"] if build is WithBuffers else [])
    assert sum(p.numel() for p in model.parameters()) == sum(p.numel() for p in expected.parameters())
    torch.randn(5)  # whatever runs in between, materialising leaves the generator as the full build did
    materialize(model, record)
    assert_same_tensors(model, expected)
    assert torch.equal(torch.get_rng_state(), rng_expected)
    if isinstance(model, GPT) and model.shape.tie_embeddings:
        assert model.lm_head.weight is model.tok_emb.weight


def test_ties_survive_conversions_that_replace_parameters():
    """With this switch on, ``to_empty`` makes new parameter objects one by one."""
    torch.manual_seed(SEED)
    model, record = record_build(lambda: GPT(SHAPE), CPU)
    torch.__future__.set_overwrite_module_params_on_conversion(True)
    try:
        materialize(model, record)
    finally:
        torch.__future__.set_overwrite_module_params_on_conversion(False)
    assert model.lm_head.weight is model.tok_emb.weight
    assert_same_tensors(model, full_build(lambda: GPT(SHAPE))[0])


def _padding_row() -> nn.Module:
    return nn.Embedding(16, 8, padding_idx=0)


def _copied() -> nn.Module:
    layers = nn.Sequential(nn.Linear(8, 8), nn.Linear(8, 8))
    with torch.no_grad():
        layers[1].weight.copy_(layers[0].weight)
    return layers


def _own_generator() -> nn.Module:
    layer = nn.Linear(8, 8)
    nn.init.normal_(layer.weight, generator=torch.Generator().manual_seed(1))
    return layer


def _random_like() -> nn.Module:
    layer = nn.Linear(8, 8)
    layer.noise = nn.Parameter(torch.randn_like(layer.weight))
    return layer


def _reads_values() -> nn.Module:
    layer = nn.Linear(8, 8)
    if bool(layer.weight.abs().max() > 10):  # meta tensors have no values to compare
        raise AssertionError("unreachable")
    return layer


@pytest.mark.parametrize("build, reason", [
    (_padding_row, "through a view"),
    (_copied, "from other tensors on the meta device"),
    (_own_generator, "its own torch.Generator"),
    (_random_like, "random numbers shaped after a tensor on the meta device"),
    (_reads_values, "failed on the meta device"),
])
def test_builders_that_cannot_be_replayed_build_on_the_device(build, reason):
    torch.manual_seed(SEED)
    with pytest.raises(DeferredInitError, match=reason):
        record_build(build, CPU)
    warnings: list[str] = []
    torch.manual_seed(SEED)
    model, record = build_model_deferred(build, CPU, True, log=lambda message: None, warn=warnings.append)
    assert record is None and len(warnings) == 1 and reason in warnings[0]
    # The failed attempt drew nothing: the device build makes the usual weights.
    torch.manual_seed(SEED)
    expected = build()
    for (name, value), (_, wanted) in zip(model.named_parameters(), expected.named_parameters()):
        assert not value.is_meta and torch.equal(value, wanted), name


def _meta_init(strategy: str, pp: int) -> bool:
    return Layout.resolve(ParallelConfig(strategy=strategy, pp=pp), 2 if strategy != "none" or pp > 1 else 1).meta_init


def test_meta_initialisation_is_for_layouts_without_a_full_replica():
    assert _meta_init("fsdp", 1) and _meta_init("none", 2) and _meta_init("ddp", 2)
    assert not _meta_init("ddp", 1) and not _meta_init("zero1", 1) and not _meta_init("none", 1)


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_each_rank_holds_its_part_of_the_full_builds_values(layout):
    """Shards (FSDP, FSDP x TP with strided shards) and stages hold exactly the values of
    a one-process build; no rank holds more than its part."""
    expected, rng_expected = full_build(lambda: GPT(SHAPE))
    full = dict(expected.named_parameters(remove_duplicate=False))
    full_bytes = sum(p.numel() * p.element_size() for p in expected.parameters())
    world_size = LAYOUTS[layout][0]
    seen: set[str] = set()
    for rank, held in enumerate(run_on_ranks(held_values, layout, world_size=world_size)):
        assert held["on_meta"] == [], f"rank {rank} left tensors on the meta device"
        assert torch.equal(held["rng_after"], rng_expected)
        for name, value in held["values"].items():
            assert torch.equal(value, full[name].detach()), f"rank {rank}: {name}"
        seen.update(held["values"])
        assert held["local_bytes"] < 0.75 * full_bytes, f"rank {rank} holds {held['local_bytes']} of {full_bytes}"
        assert held["tied"] == (layout.startswith("fsdp"))
    assert seen | {"lm_head.weight"} == set(full)


@pytest.mark.skipif(not os.access("/proc/self/clear_refs", os.W_OK), reason="needs Linux's resettable VmHWM")
@pytest.mark.parametrize("layout", ["fsdp", "pp2"])
def test_no_rank_ever_holds_the_whole_model(layout):
    """Peak resident memory while building: the whole model's size on the device, about
    half of it (this rank's part plus one tensor at a time) on meta."""
    full_kib = sum(p.numel() * p.element_size() for p in GPT(LARGE).parameters()) / 1024
    for rank, peaks in enumerate(run_on_ranks(build_peaks, layout, world_size=2)):
        assert peaks["device"] >= 0.95 * full_kib, f"rank {rank}: the measure must see a full build ({peaks})"
        assert peaks["meta"] <= 0.8 * full_kib, f"rank {rank}: {peaks} of {math.ceil(full_kib)} KiB"


RUN_LAYOUTS = {
    "fsdp": ["--parallel.strategy=fsdp"],
    "pp2-1f1b": ["--parallel.strategy=none", "--parallel.pp=2", "--parallel.pp_schedule=1f1b"],
}


def run(tmp_path, nproc: int, *overrides: str) -> tuple[list[tuple[float, float]], str]:
    """Per-step (loss, grad norm) of a 4-step run, and how its model was initialised."""
    result = meshyard.run(tiny_config(tmp_path, *DATA, "--train.steps=4", *overrides), nproc=nproc)
    facts = json.loads((result.run_dir / "run.json").read_text())
    return [(r["loss"], r["grad_norm"]) for r in result.metrics()], facts["model_init"]


@pytest.fixture(scope="module")
def one_process(tmp_path_factory) -> list[tuple[float, float]]:
    losses, init = run(tmp_path_factory.mktemp("one"), 1, "--parallel.strategy=none")
    assert init == "device"
    return losses


@pytest.mark.parametrize("layout", list(RUN_LAYOUTS))
def test_runs_initialise_on_meta_with_unchanged_losses(tmp_path, one_process, layout):
    losses, init = run(tmp_path, 2, *RUN_LAYOUTS[layout])
    assert init == "meta"
    assert_close(losses, one_process)
