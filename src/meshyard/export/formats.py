"""The export formats: how each file is written and read back, and its sidecar.

This is the one module that knows the files' layouts: ``meshyard export`` writes through
it and the serving runtimes (``meshyard.serve.runtimes``) read through it.

- safetensors: the model's tensors, read back into a model built from the run's config
  (the eager runtime). A tensor shared by two names (tied embeddings) is stored once and
  the other name recorded as its alias. An INT8 export stores each quantized linear layer
  as its int8 weight, per-row scales and zero points (``quantize.int8_entries``).
- torchscript: the model traced on an example batch (``torch.jit.trace``); sizes are read
  from the input at run time, so any batch and sequence length up to the context work.
- onnx: ``torch.onnx.export`` with the dynamo exporter, batch and sequence as dynamic axes
  (opset 18), run in ONNX Runtime on the CPU.

Every export has a sidecar ``<export>.json`` (``sidecar_path``): what the server needs to
describe the model without opening the export, and the figures of its checks.
"""

from __future__ import annotations

import json
import logging
import warnings
from pathlib import Path
from typing import Any, Callable

import torch
from torch import nn

from meshyard.extras import require
from meshyard.export.quantize import int8_entries, quantize_linears, quantized_linears, set_int8_entries
from meshyard.models.outputs import logits_of

FORMATS: dict[str, tuple[str, ...]] = {"safetensors": (".safetensors",), "torchscript": (".pt", ".ts"),
                                       "onnx": (".onnx",)}
RUNTIME_OF: dict[str, str] = {"safetensors": "eager", "torchscript": "torchscript", "onnx": "onnxruntime"}
ONNX_OPSET = 18  # the dynamo exporter's own default; LayerNormalization is a single node from 17 on
INPUT, OUTPUT = "tokens", "logits"
_TIED, _INT8 = "meshyard.tied", "meshyard.int8_linears"  # safetensors metadata keys

Forward = Callable[[torch.Tensor], torch.Tensor]


class ExportFormatError(ValueError):
    """An export file or its sidecar cannot be used; the message says what to do instead."""


def check_suffix(fmt: str, path: Path) -> None:
    """Refuse an output path whose suffix does not say its format (the server and people
    tell exports apart by it)."""
    if fmt not in FORMATS:
        raise ExportFormatError(f"unknown export format '{fmt}'; choose one of {', '.join(FORMATS)}")
    if path.suffix not in FORMATS[fmt]:
        raise ExportFormatError(f"--out {path} does not end in {' or '.join(FORMATS[fmt])}, the suffix of a "
                                f"{fmt} export; name the file e.g. {path.with_suffix(FORMATS[fmt][0]).name}")


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


def write_sidecar(path: Path, facts: dict[str, Any]) -> None:
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
    save_file = require("safetensors.torch", "a safetensors export").save_file
    layers = quantized_linears(module)
    tensors: dict[str, torch.Tensor] = {}
    tied: dict[str, str] = {}
    first_name: dict[tuple[int, int, tuple[int, ...]], str] = {}
    for name, tensor in module.state_dict().items():
        if not isinstance(tensor, torch.Tensor) or any(name.startswith(f"{layer}.") for layer in layers):
            continue  # a quantized layer's packed state: saved below as plain entries
        key = (tensor.untyped_storage().data_ptr(), tensor.storage_offset(), tuple(tensor.shape))
        if key in first_name:
            tied[name] = first_name[key]
        else:
            first_name[key] = name
            tensors[name] = tensor.detach().contiguous()
    for layer_name, layer in layers.items():
        tensors.update({f"{layer_name}.{suffix}": t for suffix, t in int8_entries(layer).items()})
    metadata = {"format": "pt", _TIED: json.dumps(tied), _INT8: json.dumps(sorted(layers))}
    save_file(tensors, str(path), metadata=metadata)


def read_safetensors(path: Path, module: nn.Module) -> nn.Module:
    """The export's weights put into ``module``, a freshly built float32 model of the same
    config; an INT8 export's layers are quantized first. Returns the model to run."""
    safe_open = require("safetensors", "reading a safetensors export").safe_open
    with safe_open(str(path), framework="pt") as f:
        metadata = f.metadata() or {}
        tensors = {key: f.get_tensor(key) for key in f.keys()}
    tied, layers = json.loads(metadata.get(_TIED, "{}")), json.loads(metadata.get(_INT8, "[]"))
    plain = {k: v for k, v in tensors.items() if not any(k.startswith(f"{layer}.") for layer in layers)}
    plain.update({alias: plain[name] for alias, name in tied.items() if name in plain})
    result = module.load_state_dict(plain, strict=False)
    quantized_weights = {f"{layer}.{part}" for layer in layers for part in ("weight", "bias")}
    missing = [k for k in result.missing_keys if k not in quantized_weights]
    if missing or result.unexpected_keys:
        raise ExportFormatError(
            f"{path} does not fit the model its sidecar's config builds (missing {missing[:5]}, unexpected "
            f"{result.unexpected_keys[:5]}); the export and its sidecar belong to different models: export again")
    if not layers:
        return module.eval()
    quantized = quantize_linears(module, layers, inplace=True)
    for name, layer in quantized_linears(quantized).items():
        set_int8_entries(layer, {k.removeprefix(f"{name}."): v for k, v in tensors.items()
                                 if k.startswith(f"{name}.")})
    return quantized.eval()


# --- TorchScript -------------------------------------------------------------------------

def write_torchscript(module: nn.Module, path: Path, example: torch.Tensor) -> None:
    """The module traced on ``example`` and saved with ``torch.jit.save``."""
    with warnings.catch_warnings(), torch.no_grad():
        # Python-side checks (e.g. a sequence longer than the context) are not traced and say
        # so in a warning; the serving engines check lengths themselves before every call.
        warnings.simplefilter("ignore", torch.jit.TracerWarning)
        traced = torch.jit.trace(LogitsOnly(module).eval(), example, check_trace=False)
    torch.jit.save(traced, str(path))


def read_torchscript(path: Path) -> torch.jit.ScriptModule:
    """A TorchScript export, loaded on the CPU in eval mode."""
    return torch.jit.load(str(path), map_location="cpu").eval()


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
