"""Sizes on the command line and the hardware catalog."""

from __future__ import annotations

import pytest

from meshyard.hardware import GPUS, LINKS, CatalogError, gpu_spec, link_spec
from meshyard.plan.hardware import make_cluster
from meshyard.plan.units import fmt_bytes, parse_size


@pytest.mark.parametrize("text, expected", [
    ("80GB", 80e9), ("80 GB", 80e9), ("80gb", 80e9), ("80GiB", 80 * 2**30), ("80", 80e9), ("1.5TB", 1.5e12),
    ("24576MiB", 24576 * 2**20), ("80G", 80e9), ("512MB", 512e6),
])
def test_parse_size(text, expected):
    assert parse_size(text) == pytest.approx(expected)


@pytest.mark.parametrize("text", ["80XB", "", "GB", "-5GB", "0GB", "80 GB GB", "iB"])
def test_parse_size_rejects_nonsense(text):
    with pytest.raises(ValueError, match="size"):
        parse_size(text)


def test_fmt_bytes():
    assert fmt_bytes(80e9) == "80 GB" and fmt_bytes(1.234e6) == "1.23 MB" and fmt_bytes(12) == "12 B"


def test_catalog_lookups_are_forgiving_and_unknown_names_list_the_known():
    assert gpu_spec("H100-SXM") is GPUS["h100"]
    assert link_spec("ib-ndr-8x").bandwidth == 400e9
    with pytest.raises(CatalogError, match="did you mean 'h100'.*known: v100"):
        gpu_spec("h1000")
    with pytest.raises(CatalogError, match="unknown interconnect 'infiniband'"):
        link_spec("infiniband")


def test_every_gpu_has_fp32_and_a_known_link():
    for gpu in GPUS.values():
        assert gpu.peak_flops["fp32"] > 0 and gpu.intra_link in LINKS and gpu.host_link in LINKS


def test_overrides_replace_catalog_values():
    cluster = make_cluster("a100", 16, 8, "eth-100g", memory=40e9, peak_flops=100e12, inter_bandwidth=25e9)
    assert cluster.gpu.memory == 40e9 and cluster.peak("bf16") == 100e12 and cluster.inter.bandwidth == 25e9
    assert cluster.nodes == 2 and cluster.intra.name == "nvlink3"
    assert make_cluster("v100").peak("bf16") == 0  # V100 has no bf16
