"""Writing the export formats and their sidecars (``meshyard.inference.exports`` reads them
back, as the server and the exporter's own check do).

- safetensors: the model's tensors through the one safetensors writer
  (``meshyard.checkpoint.model_file``): a tensor shared by two names (tied embeddings) is
  stored once and the other name recorded as its alias. An INT8 export stores each
  quantized linear layer as its int8 weight, per-row scales and zero points
  (``meshyard.inference.int8.int8_entries``).
- torchscript: the model traced on an example batch (``torch.jit.trace``); sizes are read
  from the input at run time, so any batch and sequence length up to the context work.
- onnx: ``torch.onnx.export`` with the dynamo exporter, batch and sequence as dynamic axes
  (opset 18), run in ONNX Runtime on the CPU.
"""

from __future__ import annotations

import json
import logging
import warnings
from pathlib import Path
from typing import Any

import torch
from torch import nn

from meshyard.checkpoint.model_file import write_model_file
from meshyard.extras import require
from meshyard.inference.exports import FORMATS, INPUT, OUTPUT, ExportFormatError, sidecar_path
from meshyard.inference.int8 import int8_entries, quantized_linears
from meshyard.models.outputs import logits_of

ONNX_OPSET = 18  # the dynamo exporter's own default; LayerNormalization is a single node from 17 on


def check_suffix(fmt: str, path: Path) -> None:
    """Refuse an output path whose suffix does not say its format (the server and people
    tell exports apart by it)."""
    if fmt not in FORMATS:
        raise ExportFormatError(f"unknown export format '{fmt}'; choose one of {', '.join(FORMATS)}")
    if path.suffix not in FORMATS[fmt]:
        raise ExportFormatError(f"--out {path} does not end in {' or '.join(FORMATS[fmt])}, the suffix of a "
                                f"{fmt} export; name the file e.g. {path.with_suffix(FORMATS[fmt][0]).name}")


def write_sidecar(path: Path, facts: dict[str, Any]) -> None:
    """The export's sidecar (``meshyard.inference.exports.read_sidecar`` reads it)."""
    sidecar_path(path).write_text(json.dumps(facts, indent=2, sort_keys=True) + "\n")


class LogitsOnly(nn.Module):
    """A model whose forward returns only its logits tensor (a model may return an object
    holding them, which tracing and ONNX cannot pass on)."""

    def __init__(self, module: nn.Module) -> None:
        super().__init__()
        self.module = module

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return logits_of(self.module(tokens))


def example_tokens(vocab_size: int, context_length: int) -> torch.Tensor:
    """A small batch to trace and export with: two rows (a size of 1 would be taken for a
    constant by the exporter) of a few tokens."""
    return torch.arange(2 * min(8, context_length)).reshape(2, -1) % vocab_size


# --- safetensors -------------------------------------------------------------------------

def write_safetensors(module: nn.Module, path: Path) -> None:
    """The module's tensors (an INT8 module's layers as int8 entries) into ``path``."""
    layers = quantized_linears(module)
    tensors = {name: tensor for name, tensor in module.state_dict().items()
               # a quantized layer's packed state is no tensor: it is saved below as plain entries
               if isinstance(tensor, torch.Tensor) and not any(name.startswith(f"{layer}.") for layer in layers)}
    for layer_name, layer in layers.items():
        tensors.update({f"{layer_name}.{suffix}": t for suffix, t in int8_entries(layer).items()})
    write_model_file(tensors, path, int8_linears=list(layers), feature="a safetensors export")


# --- TorchScript -------------------------------------------------------------------------

def write_torchscript(module: nn.Module, path: Path, example: torch.Tensor) -> None:
    """The module traced on ``example`` and saved with ``torch.jit.save``."""
    with warnings.catch_warnings(), torch.no_grad():
        # Python-side checks (e.g. a sequence longer than the context) are not traced and say
        # so in a warning; the serving engines check lengths themselves before every call.
        warnings.simplefilter("ignore", torch.jit.TracerWarning)
        traced = torch.jit.trace(LogitsOnly(module).eval(), example, check_trace=False)
    torch.jit.save(traced, str(path))


# --- ONNX --------------------------------------------------------------------------------

def write_onnx(module: nn.Module, path: Path, example: torch.Tensor, context_length: int) -> None:
    """The float32 module as ONNX (dynamo exporter), batch and sequence dynamic up to the context."""
    require("onnx", "an ONNX export")
    require("onnxscript", "an ONNX export")  # what the dynamo exporter translates with
    batch = torch.export.Dim("batch", min=1)
    sequence = torch.export.Dim("sequence", min=1, max=context_length)
    quiet = logging.getLogger("torch.onnx")
    level = quiet.level
    quiet.setLevel(logging.ERROR)  # notes about optional packages (torchvision) it does not need here
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            torch.onnx.export(LogitsOnly(module).eval(), (example,), str(path), input_names=[INPUT],
                              output_names=[OUTPUT], dynamo=True, opset_version=ONNX_OPSET, external_data=False,
                              dynamic_shapes={INPUT: {0: batch, 1: sequence}}, verbose=False)
    finally:
        quiet.setLevel(level)


