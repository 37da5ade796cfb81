"""serve.device and serve.dtype: checked by the config, resolved against the machine in one place."""

from __future__ import annotations

import pytest
import torch

from meshyard.config.checks import section_problems
from meshyard.config.load import ConfigError, load_section
from meshyard.inference.loading import describe, load_engine
from meshyard.inference.placement import resolve, resolve_device, resolve_dtype, resolve_for_export
from meshyard.inference.source import ModelSourceError


def test_auto_device_is_the_first_cuda_device_when_there_is_one_else_the_cpu():
    assert resolve_device("auto", cuda_count=0) == torch.device("cpu")
    assert resolve_device("auto", cuda_count=2) == torch.device("cuda", 0)
    assert resolve_device("cpu", cuda_count=2) == torch.device("cpu")
    assert resolve_device("cuda", cuda_count=1) == torch.device("cuda", 0)
    assert resolve_device("cuda:1", cuda_count=2) == torch.device("cuda", 1)


@pytest.mark.parametrize("requested, count", [("cuda", 0), ("cuda:2", 2)])
def test_a_cuda_device_that_is_not_there_is_a_clear_error(requested, count):
    with pytest.raises(ModelSourceError, match=f"serve.device = '{requested}' but .*'auto' or 'cpu'"):
        resolve_device(requested, cuda_count=count)


def test_auto_dtype_is_bf16_on_a_cuda_device_that_supports_it_else_fp32():
    cuda = torch.device("cuda", 0)
    assert resolve_dtype("auto", cuda, bf16_supported=True) == torch.bfloat16
    assert resolve_dtype("auto", cuda, bf16_supported=False) == torch.float32
    assert resolve_dtype("auto", torch.device("cpu")) == torch.float32
    assert [resolve_dtype(name, torch.device("cpu")) for name in ("fp32", "bf16", "fp16")] == [
        torch.float32, torch.bfloat16, torch.float16]


def test_on_this_machine_auto_resolves_as_torch_sees_it():
    placement = resolve("auto", "auto")
    assert placement.device.type == ("cuda" if torch.cuda.is_available() else "cpu")


def _serve(*overrides: str):
    return load_section("serve", None, list(overrides))


@pytest.mark.parametrize("device", ["auto", "cpu", "cuda", "cuda:0", "cuda:3"])
def test_the_documented_devices_pass_the_config_check(device):
    assert section_problems("serve", _serve(f"--serve.device={device}")) == []


@pytest.mark.parametrize("device", ["gpu", "cuda:", "cuda:x", "mps", ""])
def test_other_devices_fail_the_config_check_naming_the_choices(device):
    problems = section_problems("serve", _serve(f"--serve.device={device}"))
    assert len(problems) == 1 and "serve.device" in problems[0] and "'cuda:N'" in problems[0]


def test_an_unknown_dtype_is_the_configs_usual_error():
    with pytest.raises(ConfigError, match="serve.dtype"):
        _serve("--serve.dtype=int4")


def test_exports_run_on_the_cpu_and_refuse_another_device_or_dtype():
    assert resolve_for_export("auto", "auto", "x.pt").device == torch.device("cpu")
    for device, dtype in (("cuda", "auto"), ("cuda:0", "fp32"), ("cpu", "bf16")):
        with pytest.raises(ModelSourceError, match="runs on the CPU"):
            resolve_for_export(device, dtype, "x.pt")


def test_a_checkpoint_loads_in_the_dtype_asked_and_counts_its_bytes_in_it(trained_run):
    source = describe(str(trained_run))
    fp32, bf16 = load_engine(source, device="cpu", dtype="fp32"), load_engine(source, device="cpu", dtype="bf16")
    assert {p.dtype for p in bf16.module.parameters()} == {torch.bfloat16}
    assert bf16.bytes * 2 == fp32.bytes  # serve.memory_budget_bytes counts what the weights take
