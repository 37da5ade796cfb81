"""The files ``meshyard export`` writes, as they are read back: the formats and the
runtime each runs in, the sidecar, and reading each format.

``meshyard.export.formats`` writes what this module reads; the serving runtimes
(``meshyard.inference.runtimes``) and the exporter's own check read through it.

- safetensors: the model's tensors (``meshyard.checkpoint.model_file``), put into a model
  built from the run's config (the eager runtime); an INT8 export's linear layers are
  rebuilt from their int8 entries (``meshyard.inference.int8``).
- torchscript: ``torch.jit.load`` on the CPU.
- onnx: an ONNX Runtime session on the CPU; its input is ``INPUT``, its output ``OUTPUT``.

Every export has a sidecar ``<export>.json`` (``sidecar_path``): what the server needs to
describe the model without opening the export, and the figures of its checks.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
from torch import nn

from meshyard.checkpoint.model_file import read_model_file
from meshyard.errors import BadInput
from meshyard.extras import require
from meshyard.inference.engine import Forward
from meshyard.inference.int8 import quantize_named_linears, quantized_linears, set_int8_entries

FORMATS: dict[str, tuple[str, ...]] = {"safetensors": (".safetensors",), "torchscript": (".pt", ".ts"),
                                       "onnx": (".onnx",)}
RUNTIME_OF: dict[str, str] = {"safetensors": "eager", "torchscript": "torchscript", "onnx": "onnxruntime"}
INPUT, OUTPUT = "tokens", "logits"  # the names of an ONNX export's input and output


class ExportFormatError(BadInput, ValueError):
    """An export file or its sidecar cannot be used; the message says what to do instead."""


def sidecar_path(path: Path | str) -> Path:
    """Where an export's sidecar lies: the export's path with '.json' added."""
    return Path(f"{path}.json")


def read_sidecar(path: Path | str) -> dict[str, Any]:
    """The sidecar of the export at ``path``, checked for the keys a server needs."""
    side = sidecar_path(path)
    try:
        facts = json.loads(side.read_text())
    except FileNotFoundError:
        raise ExportFormatError(f"{path} has no sidecar {side.name} beside it, so it is not an export written by "
                                "'meshyard export'; export the run again, or serve the run directory or checkpoint "
                                "itself") from None
    except (OSError, ValueError) as exc:
        raise ExportFormatError(f"cannot read {side} ({exc}); export the model again") from None
    missing = [k for k in ("format", "int8", "vocab_size", "context_length", "name", "version") if k not in facts]
    if missing or facts.get("format") not in FORMATS:
        raise ExportFormatError(f"{side} lacks {', '.join(missing) or 'a known format'}; it was not written by "
                                "'meshyard export' of this version: export the model again")
    return facts


def read_safetensors(path: Path, module: nn.Module) -> nn.Module:
    """The export's weights put into ``module``, a freshly built float32 model of the same
    config; an INT8 export's layers are quantized first. Returns the model to run."""
    tensors, layers = read_model_file(path, "reading a safetensors export")
    plain = {k: v for k, v in tensors.items() if not any(k.startswith(f"{layer}.") for layer in layers)}
    result = module.load_state_dict(plain, strict=False)
    quantized_weights = {f"{layer}.{part}" for layer in layers for part in ("weight", "bias")}
    missing = [k for k in result.missing_keys if k not in quantized_weights]
    if missing or result.unexpected_keys:
        raise ExportFormatError(
            f"{path} does not fit the model its sidecar's config builds (missing {missing[:5]}, unexpected "
            f"{result.unexpected_keys[:5]}); the export and its sidecar belong to different models: export again")
    if not layers:
        return module.eval()
    quantized = quantize_named_linears(module, layers, inplace=True)
    for name, layer in quantized_linears(quantized).items():
        set_int8_entries(layer, {k.removeprefix(f"{name}."): v for k, v in tensors.items()
                                 if k.startswith(f"{name}.")})
    return quantized.eval()


def read_torchscript(path: Path) -> torch.jit.ScriptModule:
    """A TorchScript export, loaded on the CPU in eval mode."""
    return torch.jit.load(str(path), map_location="cpu").eval()


def onnx_session(path: Path, threads: int = 0):
    """An ONNX Runtime session on the CPU; ``threads`` > 0 sets its intra-op threads."""
    ort = require("onnxruntime", "running an ONNX export")
    options = ort.SessionOptions()
    if threads > 0:
        options.intra_op_num_threads = threads
    options.log_severity_level = 3  # errors only: its warnings about unused initializers are noise here
    return ort.InferenceSession(str(path), sess_options=options, providers=["CPUExecutionProvider"])


def onnx_forward(session) -> Forward:
    """[B, T] ids to [B, T, V] float32 logits through an ONNX Runtime session."""
    def forward(tokens: torch.Tensor) -> torch.Tensor:
        feed = {INPUT: tokens.detach().to(device="cpu", dtype=torch.int64).numpy()}
        return torch.from_numpy(session.run([OUTPUT], feed)[0])
    return forward
