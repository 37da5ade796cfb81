"""The hardware catalog: device names as CUDA reports them find their datasheet entry."""

from __future__ import annotations

from meshyard.hardware import GPUS, gpu_for_device_name


def test_device_names_find_the_most_specific_entry():
    assert gpu_for_device_name("NVIDIA H100 80GB HBM3") is GPUS["h100"]
    assert gpu_for_device_name("NVIDIA H100 PCIe") is GPUS["h100-pcie"]
    assert gpu_for_device_name("NVIDIA A100-SXM4-40GB") is GPUS["a100-40gb"]
    assert gpu_for_device_name("Some Unknown Accelerator") is None
