"""The ``Cluster`` the cost model runs on: catalog hardware, grouped into nodes.

GPUs and links come from the catalog (``meshyard.hardware``); the cost model applies the
efficiency factors below on top of their datasheet figures, and every figure can be
overridden from the command line.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from meshyard.hardware import GpuSpec, LinkSpec, gpu_spec, link_spec


@dataclass(frozen=True)
class Cluster:
    """Devices, how they are grouped into nodes, and the achievable fractions of peak."""

    gpu: GpuSpec
    n_gpus: int
    gpus_per_node: int
    intra: LinkSpec
    inter: LinkSpec
    compute_efficiency: float = 0.5
    """Fraction of peak FLOP/s that large transformer matmuls sustain (MFU-like)."""
    link_efficiency: float = 0.8
    """Fraction of a link's bandwidth collectives achieve (NCCL bus bandwidth / wire)."""
    host_bandwidth: float = 100e9
    """Host memory bandwidth per node for an offloaded optimizer step, bytes/s."""

    @property
    def nodes(self) -> int:
        return -(-self.n_gpus // self.gpus_per_node)

    def peak(self, dtype: str) -> float:
        """Peak FLOP/s of one device for ``dtype``; 0 when the device lacks it."""
        return self.gpu.peak_flops.get(dtype, 0.0)

    def with_gpus(self, n_gpus: int) -> "Cluster":
        return replace(self, n_gpus=n_gpus)


def make_cluster(
    gpu: str = "h100",
    n_gpus: int = 8,
    gpus_per_node: int = 8,
    interconnect: str = "ib-ndr-8x",
    intra: str | None = None,
    **overrides: float,
) -> Cluster:
    """A cluster from catalog names; ``overrides`` may replace ``memory``, ``peak_flops``
    (one number for the compute dtype, applied to all dtypes), ``intra_bandwidth``,
    ``inter_bandwidth`` and any ``Cluster`` field."""
    spec = gpu_spec(gpu)
    if "memory" in overrides:
        spec = replace(spec, memory=overrides.pop("memory"))
    if "peak_flops" in overrides:
        value = overrides.pop("peak_flops")
        spec = replace(spec, peak_flops={k: value for k in ("fp32", "bf16", "fp16")})
    intra_spec = link_spec(intra or spec.intra_link)
    inter_spec = link_spec(interconnect)
    if "intra_bandwidth" in overrides:
        intra_spec = replace(intra_spec, bandwidth=overrides.pop("intra_bandwidth"))
    if "inter_bandwidth" in overrides:
        inter_spec = replace(inter_spec, bandwidth=overrides.pop("inter_bandwidth"))
    return Cluster(gpu=spec, n_gpus=n_gpus, gpus_per_node=gpus_per_node, intra=intra_spec, inter=inter_spec,
                   **overrides)  # type: ignore[arg-type]
