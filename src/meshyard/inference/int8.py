"""INT8 linear layers as a model runs them and as an export stores them.

A layer is PyTorch's dynamically quantized linear: its weight int8 with one scale and zero
point per output row (per-channel), its activations quantized on the fly. An export stores
it as plain tensors (``int8_entries``) and a reader rebuilds the same layer from them
(``set_int8_entries``). Which layers to quantize is the exporter's choice
(``meshyard.export.quantize``).
"""

from __future__ import annotations

import copy
import warnings

import torch
from torch import nn

# The eager-mode API lives on in torch.ao.quantization (deprecated in favour of the separate
# torchao package, which meshyard does not depend on); its warnings say nothing to a user.
with warnings.catch_warnings():
    warnings.simplefilter("ignore")
    from torch.ao.nn.quantized.dynamic import Linear as DynamicLinear
    from torch.ao.quantization import per_channel_dynamic_qconfig, quantize_dynamic


def quantize_named_linears(module: nn.Module, names: list[str], inplace: bool = False) -> nn.Module:
    """The model with the named linear layers replaced by dynamically quantized int8 ones
    (per-channel weights); the original is left alone unless ``inplace``."""
    target = module if inplace else copy.deepcopy(module)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # deprecation notices of the eager-mode API (see the imports)
        return quantize_dynamic(target.eval(), {name: per_channel_dynamic_qconfig for name in names},
                                dtype=torch.qint8, inplace=True)


def quantized_linears(module: nn.Module) -> dict[str, DynamicLinear]:
    """The int8 linear layers of a quantized model, by name."""
    return {name: sub for name, sub in module.named_modules() if isinstance(sub, DynamicLinear)}


def int8_entries(layer: DynamicLinear) -> dict[str, torch.Tensor]:
    """Plain tensors that hold one int8 layer exactly: the int8 weight, its per-row scales
    and zero points, and the float bias (absent when the layer has none)."""
    weight = layer.weight()
    if weight.qscheme() != torch.per_channel_affine:
        raise ValueError(f"expected a per-channel int8 weight, got {weight.qscheme()}")
    entries = {"weight_int8": weight.int_repr().contiguous(),
               "weight_scale": weight.q_per_channel_scales().contiguous(),
               "weight_zero_point": weight.q_per_channel_zero_points().contiguous()}
    bias = layer.bias()
    if bias is not None:
        entries["bias"] = bias.detach().contiguous()
    return entries


def set_int8_entries(layer: DynamicLinear, entries: dict[str, torch.Tensor]) -> None:
    """Give an int8 layer the weight and bias of ``int8_entries``: the same integers,
    scales and zero points (requantizing their dequantized values gives each integer back,
    since it lies far less than half a step from its dequantized value)."""
    scale = entries["weight_scale"].to(torch.float64)
    zero_point = entries["weight_zero_point"].to(torch.int64)
    values = (entries["weight_int8"].to(torch.float64) - zero_point[:, None]) * scale[:, None]
    weight = torch.quantize_per_channel(values.float(), scale, zero_point, 0, torch.qint8)
    layer.set_weight_bias(weight, entries.get("bias"))
