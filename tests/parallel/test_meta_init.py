"""Meta-device initialisation: sharded and pipelined models start from exactly the
weights of a one-process build, and no rank ever holds the whole model."""

from __future__ import annotations

import math
import os
from pathlib import Path

import pytest
import torch
from torch import nn

from meshyard.models.deferred_init import DeferredInitError, record_build
from meshyard.models.gpt import GPT, GPTShape
from meshyard.models.mlp import MLP
from meshyard.config.sections import Config, ParallelConfig
from meshyard.parallel.layout import Layout
from meshyard.parallel.materialize import build_model_deferred, materialize
from meshyard.validate import validate
from tests import shared_spawn
from tests.conftest import tiny_config
from tests.inprocess import fit_each_with_facts, records_and_facts
from tests.parallel.meta_scenarios import LARGE, LAYOUTS, SEED, SHAPE, build_peaks, held_values
from tests.train.test_parity import DATA, STEPS, assert_close, losses_of, single_process_run

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


RUN_LAYOUTS = {
    "fsdp": ["--parallel.strategy=fsdp"],
    "pp2-1f1b": ["--parallel.strategy=none", "--parallel.pp=2", "--parallel.pp_schedule=1f1b"],
}
PEAK_LAYOUTS = ["fsdp", "pp2"]
MEASURES_PEAKS = os.access("/proc/self/clear_refs", os.W_OK)  # Linux's resettable VmHWM


def run_config(folder: Path, *overrides: str) -> Config:
    """A run of tests/train/test_parity.py's length on its real text."""
    return tiny_config(folder, *DATA, f"--train.steps={STEPS}", *overrides)


def _layouts_of(world_size: int) -> list[str]:
    return [layout for layout, (nproc, _, _) in LAYOUTS.items() if nproc == world_size]


def _held_under_each(rank: int, world_size: int, layouts: list[str]) -> dict[str, dict]:
    return {layout: held_values(rank, world_size, layout) for layout in layouts}


def _two_rank_checks(rank: int, world_size: int, peak_layouts: list[str], configs: list[Config]) -> dict:
    """Everything checked on two ranks, in one spawn: the build peaks first (before this
    process has built anything large), the values held under each 2-rank layout, then
    each run of ``configs`` (built and fitted as a worker does) with its facts."""
    return {"peaks": {layout: build_peaks(rank, world_size, layout) for layout in peak_layouts},
            "held": _held_under_each(rank, world_size, _layouts_of(world_size)),
            "runs": fit_each_with_facts(rank, world_size, configs)}


def _run_configs(folder: Path) -> list[Config]:
    return [run_config(folder / name, *overrides) for name, overrides in RUN_LAYOUTS.items()]


def _two_rank_job(request: pytest.FixtureRequest, folder: Path) -> tuple:
    configs = _run_configs(folder)
    for cfg in configs:
        validate(cfg, 2)
    return _two_rank_checks, (PEAK_LAYOUTS if MEASURES_PEAKS else [], configs)


# First in the session's spawns, so that the peaks are measured before the ranks build anything else.
shared_spawn.register(2, "meta_init: checks", __name__, _two_rank_job, first=True)
shared_spawn.register(4, "meta_init: values held", __name__,
                      lambda request, folder: (_held_under_each, (_layouts_of(4),)))


@pytest.fixture(scope="module")
def two_ranks(request) -> dict:
    """Per rank, the results of ``_two_rank_checks``; "runs" holds, per RUN_LAYOUTS entry,
    rank 0's step records and its trainer's facts (what run.json records)."""
    folder, per_rank = shared_spawn.result(request, 2, "meta_init: checks")
    runs = dict(zip(RUN_LAYOUTS, records_and_facts(_run_configs(folder), per_rank[0]["runs"])))
    return {"per_rank": per_rank, "runs": runs}


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_each_rank_holds_its_part_of_the_full_builds_values(request, layout):
    """Shards (FSDP, FSDP x TP with strided shards) and stages hold exactly the values of
    a one-process build; no rank holds more than its part."""
    expected, rng_expected = full_build(lambda: GPT(SHAPE))
    full = dict(expected.named_parameters(remove_duplicate=False))
    full_bytes = sum(p.numel() * p.element_size() for p in expected.parameters())
    world_size = LAYOUTS[layout][0]
    if world_size == 2:
        per_rank = [checks["held"][layout] for checks in request.getfixturevalue("two_ranks")["per_rank"]]
    else:
        _, held_per_rank = shared_spawn.result(request, 4, "meta_init: values held")
        per_rank = [layouts_held[layout] for layouts_held in held_per_rank]
    seen: set[str] = set()
    for rank, held in enumerate(per_rank):
        assert held["on_meta"] == [], f"rank {rank} left tensors on the meta device"
        assert torch.equal(held["rng_after"], rng_expected)
        for name, value in held["values"].items():
            assert torch.equal(value, full[name].detach()), f"rank {rank}: {name}"
        seen.update(held["values"])
        assert held["local_bytes"] < 0.75 * full_bytes, f"rank {rank} holds {held['local_bytes']} of {full_bytes}"
        assert held["tied"] == (layout.startswith("fsdp"))
    assert seen | {"lm_head.weight"} == set(full)


@pytest.mark.skipif(not MEASURES_PEAKS, reason="needs Linux's resettable VmHWM")
@pytest.mark.parametrize("layout", PEAK_LAYOUTS)
def test_no_rank_ever_holds_the_whole_model(two_ranks, layout):
    """Peak resident memory while building: the whole model's size on the device, about
    half of it (this rank's part plus one tensor at a time) on meta."""
    full_kib = sum(p.numel() * p.element_size() for p in GPT(LARGE).parameters()) / 1024
    for rank, checks in enumerate(two_ranks["per_rank"]):
        peaks = checks["peaks"][layout]
        assert peaks["device"] >= 0.95 * full_kib, f"rank {rank}: the measure must see a full build ({peaks})"
        assert peaks["meta"] <= 0.8 * full_kib, f"rank {rank}: {peaks} of {math.ceil(full_kib)} KiB"


@pytest.fixture(scope="module")
def one_process(request) -> list[tuple[float, float]]:
    """The one-process run of tests/train/test_parity.py (launched as a user launches it,
    trained once per session): its model was built on the device."""
    values, facts = single_process_run(request)
    assert facts["model_init"] == "device"
    return values


@pytest.mark.parametrize("layout", list(RUN_LAYOUTS))
def test_runs_initialise_on_meta_with_unchanged_losses(two_ranks, one_process, layout):
    records, facts = two_ranks["runs"][layout]
    assert facts["model_init"] == "meta"  # the fact a launched run writes to run.json
    assert_close(losses_of(records), one_process)
