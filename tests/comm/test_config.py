"""The comm section and the DDP/FSDP communication options: documented, round-tripped, checked."""

from __future__ import annotations

import pytest

from meshyard.cli import main
from meshyard.config.dump import config_to_toml
from meshyard.config.load import ConfigError, load_config
from meshyard.validate import validate


def problems_of(*overrides: str, world_size: int = 2) -> list[str]:
    try:
        validate(load_config(None, overrides), world_size)
    except ConfigError as exc:
        return exc.problems
    return []


def test_comm_section_round_trips_and_is_documented(tmp_path, capsys):
    cfg = load_config(None, ["--comm.compression=topk", "--comm.topk_ratio=0.05", "--parallel.static_graph=true",
                             "--parallel.forward_prefetch=2", "--parallel.gradient_as_bucket_view=false"])
    path = tmp_path / "c.toml"
    path.write_text(config_to_toml(cfg, with_docs=True))
    assert load_config(path) == cfg
    assert main(["config", "show"]) == 0
    out = capsys.readouterr().out
    assert "[comm]" in out and "compression = \"none\"" in out and "largest entries" in out


@pytest.mark.parametrize("method", ["fp16", "bf16", "powersgd", "topk"])
def test_compression_under_ddp_and_zero1_is_valid(method):
    for strategy in ("ddp", "zero1"):
        assert problems_of(f"--comm.compression={method}", f"--parallel.strategy={strategy}") == []


def test_compression_with_fsdp_is_rejected_with_reason_and_alternative():
    (problem,) = problems_of("--comm.compression=powersgd", "--parallel.strategy=fsdp")
    assert "does not apply to parallel.strategy = 'fsdp'" in problem
    assert "reduce-scatter" in problem and "'ddp' or 'zero1'" in problem
    assert problems_of("--comm.compression=none", "--parallel.strategy=fsdp") == []


def test_compression_with_ddp_and_tensor_parallel_is_rejected_with_reason():
    """'ddp' replicates a tensor-parallel model with FSDP2, where no DDP hook can attach."""
    (problem,) = problems_of("--comm.compression=bf16", "--parallel.strategy=ddp", "--parallel.tp=2", world_size=4)
    assert "does not combine with parallel.tp = 2" in problem and "comm.compression = 'none'" in problem
    assert problems_of("--comm.compression=none", "--parallel.strategy=ddp", "--parallel.tp=2", world_size=4) == []


@pytest.mark.parametrize("override, fragment", [
    ("--comm.topk_ratio=0", "comm.topk_ratio = 0.0 must be in (0, 1]"),
    ("--comm.topk_ratio=1.5", "must be in (0, 1]"),
    ("--comm.powersgd_rank=0", "comm.powersgd_rank = 0 must be at least 1"),
    ("--comm.warmup_steps=-1", "comm.warmup_steps = -1 must not be negative"),
    ("--parallel.forward_prefetch=-2", "parallel.forward_prefetch = -2 must not be negative"),
    ("--comm.compression=gzip", "is not one of 'none', 'fp16', 'bf16', 'powersgd', 'topk'"),
])
def test_bad_values_are_named(override, fragment):
    assert any(fragment in p for p in problems_of(override))


def test_powersgd_needs_two_warmup_steps():
    (problem,) = problems_of("--comm.compression=powersgd", "--comm.warmup_steps=1")
    assert "at least 2 uncompressed steps" in problem
    assert problems_of("--comm.compression=powersgd", "--comm.warmup_steps=2") == []
