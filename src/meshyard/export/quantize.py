"""INT8: dynamic quantization of a model's linear layers, in PyTorch and in ONNX Runtime.

Dynamic quantization stores each linear layer's weight as int8 with one scale per output
row (per-channel: a row's range, not the whole matrix's, sets its step, which keeps the
small rows exact enough) and quantizes the activations on the fly, batch by batch. Nothing
else changes: embeddings, norms and biases stay float32.

A head tied to the token embedding (GPT-2 style, ``model.tie_embeddings``) stays float32
and tied. Its matrix is the embedding table, which the lookup needs in float32 anyway:
quantizing the head would untie it and add an int8 copy beside the table, so the file
would grow by vocabulary x width bytes where every other layer shrinks. ONNX Runtime is
asked for the same thing: only MatMul nodes with a constant weight are quantized, and the
tied head multiplies by a transpose of the embedding table, not by a constant of its own.
The price is speed on large vocabularies, where the head is a large share of the work
(GPT-2's 50257 x 768 head does nearly a third of its matrix products); with the byte
vocabulary (256) it is 1% of gpt-small's. An untied head is quantized like any linear layer.
"""

from __future__ import annotations

import copy
import logging
import warnings
from pathlib import Path

import torch
from torch import nn

from meshyard.extras import require

# The eager-mode API lives on in torch.ao.quantization (deprecated in favour of the separate
# torchao package, which meshyard does not depend on); its warnings say nothing to a user.
with warnings.catch_warnings():
    warnings.simplefilter("ignore")
    from torch.ao.nn.quantized.dynamic import Linear as DynamicLinear
    from torch.ao.quantization import per_channel_dynamic_qconfig, quantize_dynamic

def linears_to_quantize(module: nn.Module) -> list[str]:
    """Names of the ``nn.Linear`` layers whose weight is their own: a weight shared with
    another module (a head tied to the embedding) is left out (see the module docstring)."""
    owners: dict[int, int] = {}
    for sub in module.modules():
        for param in sub.parameters(recurse=False):
            owners[id(param)] = owners.get(id(param), 0) + 1
    return [name for name, sub in module.named_modules()
            if type(sub) is nn.Linear and owners[id(sub.weight)] == 1]


def quantize_linears(module: nn.Module, names: list[str] | None = None, inplace: bool = False) -> nn.Module:
    """The model with the named linear layers (default: ``linears_to_quantize``) replaced
    by dynamically quantized int8 ones (per-channel weights); the original is left alone
    unless ``inplace``."""
    names = linears_to_quantize(module) if names is None else names
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


def quantize_onnx(source: Path, out: Path) -> None:
    """ONNX Runtime's dynamic quantization of ``source`` into ``out``: int8 per-channel
    weights for the MatMul nodes with a constant weight (the linear layers; see the
    module docstring for the tied head)."""
    quantization = require("onnxruntime.quantization", "an INT8 ONNX export")
    logger = logging.getLogger()
    level = logger.level
    logger.setLevel("ERROR")  # it advises a pre-processing pass on the root logger, once per call
    try:
        quantization.quantize_dynamic(str(source), str(out), op_types_to_quantize=["MatMul"], per_channel=True,
                                      weight_type=quantization.QuantType.QInt8)
    finally:
        logger.setLevel(level)
