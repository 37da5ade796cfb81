"""The accelerator and interconnect catalog: datasheet figures by name.

Figures are vendor datasheet values: dense (no sparsity) peak FLOP/s per dtype, memory
as the driver reports it, and one-direction link bandwidth per GPU (intra-node) or per
node (inter-node, all NICs together). The planner's cost model (``meshyard.plan``)
applies efficiency factors on top; training metrics read the peak behind MFU here. It
imports nothing but the standard library, so a worker can read it without the planner.
"""

from __future__ import annotations

import difflib
from dataclasses import dataclass

from meshyard.errors import BadInput

GiB = 2**30
MiB = 2**20


@dataclass(frozen=True)
class GpuSpec:
    """One accelerator model."""

    name: str
    memory: float
    """Bytes of device memory."""
    peak_flops: dict[str, float]
    """Dense peak FLOP/s by compute dtype ('fp32', 'bf16', 'fp16'); a missing dtype is unsupported."""
    hbm_bandwidth: float
    """Device memory bandwidth, bytes/s (bounds the optimizer step)."""
    intra_link: str
    """Default intra-node interconnect (a key of ``LINKS``)."""
    host_link: str = "pcie4"
    """Link to host memory, used by CPU offload."""


@dataclass(frozen=True)
class LinkSpec:
    """One interconnect: bandwidth in one direction and the latency of one hop."""

    name: str
    bandwidth: float
    """Bytes/s in one direction: per GPU for intra-node links, per node for inter-node ones."""
    latency: float
    """Seconds per hop of a collective (software and wire)."""
    description: str


_T = 1e12
GPUS: dict[str, GpuSpec] = {g.name: g for g in (
    GpuSpec("v100", 32 * GiB, {"fp32": 15.7 * _T, "fp16": 125 * _T}, 900e9, "nvlink2", "pcie3"),
    GpuSpec("a10", 23028 * MiB, {"fp32": 31.2 * _T, "bf16": 125 * _T, "fp16": 125 * _T}, 600e9, "pcie4"),
    GpuSpec("l4", 23034 * MiB, {"fp32": 30.3 * _T, "bf16": 121 * _T, "fp16": 121 * _T}, 300e9, "pcie4"),
    GpuSpec("l40s", 46068 * MiB, {"fp32": 91.6 * _T, "bf16": 362 * _T, "fp16": 362 * _T}, 864e9, "pcie4"),
    GpuSpec("a100-40gb", 40 * GiB, {"fp32": 19.5 * _T, "bf16": 312 * _T, "fp16": 312 * _T}, 1555e9, "nvlink3"),
    GpuSpec("a100", 80 * GiB, {"fp32": 19.5 * _T, "bf16": 312 * _T, "fp16": 312 * _T}, 2039e9, "nvlink3"),
    GpuSpec("h100-pcie", 81559 * MiB, {"fp32": 51 * _T, "bf16": 756 * _T, "fp16": 756 * _T}, 2000e9, "pcie5",
            "pcie5"),
    GpuSpec("h100", 81559 * MiB, {"fp32": 67 * _T, "bf16": 989 * _T, "fp16": 989 * _T}, 3350e9, "nvlink4", "pcie5"),
    GpuSpec("h200", 143771 * MiB, {"fp32": 67 * _T, "bf16": 989 * _T, "fp16": 989 * _T}, 4800e9, "nvlink4",
            "pcie5"),
    GpuSpec("b200", 183359 * MiB, {"fp32": 80 * _T, "bf16": 2250 * _T, "fp16": 2250 * _T}, 8000e9, "nvlink5",
            "pcie5"),
    GpuSpec("mi300x", 192 * GiB, {"fp32": 163.4 * _T, "bf16": 1307 * _T, "fp16": 1307 * _T}, 5300e9, "xgmi",
            "pcie5"),
)}

GPU_ALIASES = {"h100-sxm": "h100", "a100-80gb": "a100", "a100-sxm": "a100", "h200-sxm": "h200", "v100-32gb": "v100"}

LINKS: dict[str, LinkSpec] = {link.name: link for link in (
    # Intra-node, per GPU, one direction.
    LinkSpec("nvlink2", 150e9, 3e-6, "NVLink 2 (V100 SXM2, 6 links)"),
    LinkSpec("nvlink3", 300e9, 3e-6, "NVLink 3 via NVSwitch (A100 SXM)"),
    LinkSpec("nvlink4", 450e9, 3e-6, "NVLink 4 via NVSwitch (H100/H200 SXM)"),
    LinkSpec("nvlink5", 900e9, 3e-6, "NVLink 5 via NVSwitch (B200)"),
    LinkSpec("xgmi", 448e9, 4e-6, "AMD Infinity Fabric (MI300X, 7 links)"),
    LinkSpec("pcie3", 16e9, 8e-6, "PCIe 3.0 x16"),
    LinkSpec("pcie4", 32e9, 8e-6, "PCIe 4.0 x16"),
    LinkSpec("pcie5", 64e9, 8e-6, "PCIe 5.0 x16"),
    # Inter-node, per node (all NICs), one direction.
    LinkSpec("ib-hdr", 25e9, 5e-6, "1 x InfiniBand HDR 200 Gb/s per node"),
    LinkSpec("ib-hdr-8x", 200e9, 5e-6, "8 x InfiniBand HDR 200 Gb/s per node (DGX A100)"),
    LinkSpec("ib-ndr", 50e9, 5e-6, "1 x InfiniBand NDR 400 Gb/s per node"),
    LinkSpec("ib-ndr-8x", 400e9, 5e-6, "8 x InfiniBand NDR 400 Gb/s per node (DGX H100)"),
    LinkSpec("roce-400g-8x", 400e9, 8e-6, "8 x 400 Gb/s RoCE per node"),
    LinkSpec("efa-400g", 50e9, 15e-6, "AWS EFA 400 Gb/s per node (p4d)"),
    LinkSpec("efa-3200g", 400e9, 15e-6, "AWS EFA 3200 Gb/s per node (p5)"),
    LinkSpec("eth-100g", 12.5e9, 20e-6, "100 Gb/s Ethernet (TCP) per node"),
    LinkSpec("eth-25g", 3.125e9, 30e-6, "25 Gb/s Ethernet (TCP) per node"),
)}

INTER_NODE_LINKS = ("ib-hdr", "ib-hdr-8x", "ib-ndr", "ib-ndr-8x", "roce-400g-8x", "efa-400g", "efa-3200g",
                    "eth-100g", "eth-25g")


class CatalogError(BadInput, ValueError):
    """An unknown GPU or link name; the message lists the known ones."""


def _lookup(kind: str, name: str, table: dict, aliases: dict[str, str] | None = None) -> object:
    key = name.strip().lower()
    key = (aliases or {}).get(key, key)
    if key in table:
        return table[key]
    close = difflib.get_close_matches(key, list(table), n=1, cutoff=0.5)
    hint = f" (did you mean '{close[0]}'?)" if close else ""
    raise CatalogError(f"unknown {kind} '{name}'{hint}; known: {', '.join(table)}")


def gpu_spec(name: str) -> GpuSpec:
    """The catalog entry for ``name`` (case-insensitive; a few aliases such as h100-sxm)."""
    return _lookup("GPU", name, GPUS, GPU_ALIASES)  # type: ignore[return-value]


def link_spec(name: str) -> LinkSpec:
    """The catalog entry for the interconnect ``name``."""
    return _lookup("interconnect", name, LINKS)  # type: ignore[return-value]


def gpu_for_device_name(device_name: str) -> GpuSpec | None:
    """The catalog entry for a device name as CUDA reports it ('NVIDIA H100 PCIe'): the most
    specific one all of whose name parts appear in it (h100-pcie before h100), or None."""
    name = device_name.lower()
    matches = [spec for spec in GPUS.values() if all(part in name for part in spec.name.split("-"))]
    return max(matches, key=lambda spec: len(spec.name)) if matches else None
