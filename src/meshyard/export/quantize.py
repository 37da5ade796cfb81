"""INT8: which linear layers an export quantizes, and quantizing them, in PyTorch and in
ONNX Runtime (the int8 layers themselves, and how an export stores them, are
``meshyard.inference.int8``'s).

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

import logging
from pathlib import Path

from torch import nn

from meshyard.extras import require
from meshyard.inference.int8 import quantize_named_linears


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
    return quantize_named_linears(module, linears_to_quantize(module) if names is None else names, inplace)


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
