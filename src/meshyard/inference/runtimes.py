"""Serving a file written by ``meshyard export``: its description and its engine.

Each export format runs in one runtime (``exports.RUNTIME_OF``): a safetensors export in
eager PyTorch (the model built from the config in its sidecar, its weights put in), a
TorchScript export in ``torch.jit`` and an ONNX export in ONNX Runtime on the CPU. Asking
for another runtime is an error that names the right one.

The TorchScript and ONNX engines answer the ``Engine`` protocol through a forward
function, so batching, padding and generation are those of the eager engine
(``meshyard.inference.engine``); they have no KV cache, so generation recomputes the sequence
at each step and the continuous scheduler falls back to dynamic batching for them.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from torch import nn

from meshyard.config.load import ConfigError, config_from_dict
from meshyard.config.sections import Config
from meshyard.inference import exports
from meshyard.inference.engine import EagerEngine, Engine, ForwardEngine, module_bytes
from meshyard.inference.int8 import int8_entries, quantized_linears
from meshyard.inference.source import ModelSource, ModelSourceError, build_served_model
from meshyard.inference.tokenizer import tokenizer_from_record

RUNTIMES = ("eager", "torchscript", "onnxruntime")


def describe_export(path: str, name: str | None = None) -> ModelSource:
    """The export at ``path`` as its sidecar describes it, served under ``name`` or the
    name it was exported with; its version is the export's own (checkpoint version plus
    format, and '.int8' for an INT8 export)."""
    facts = _sidecar(path)
    return ModelSource(
        path=path, name=name or facts["name"], version=facts["version"], vocab_size=int(facts["vocab_size"]),
        context_length=int(facts["context_length"]),
        tokenizer=tokenizer_from_record(facts.get("tokenizer")),
        estimated_bytes=Path(path).expanduser().stat().st_size, config=_config(facts, path), checkpoint="",
    )


def load_export_engine(source: ModelSource, runtime: str = "eager", threads: int | None = None) -> Engine:
    """The engine of an export in ``runtime``, which must be the one its format runs in.
    ONNX Runtime uses ``threads`` intra-op threads (default: torch's thread count, which
    the server sets from ``serve.threads``)."""
    facts = _sidecar(source.path)
    fmt = facts["format"]
    if runtime not in RUNTIMES:
        raise ModelSourceError(f"unknown runtime '{runtime}'; choose one of {', '.join(RUNTIMES)}")
    if exports.RUNTIME_OF[fmt] != runtime:
        raise ModelSourceError(
            f"{source.path} is a {fmt} export, which runs in the '{exports.RUNTIME_OF[fmt]}' runtime, not "
            f"'{runtime}'; serve it with --runtime {exports.RUNTIME_OF[fmt]}, or export the run again with "
            f"--format {_format_for(runtime)} for the '{runtime}' runtime")
    path = Path(source.path).expanduser()
    threads = torch.get_num_threads() if threads is None else threads
    try:
        return open_export(path, fmt, source.config, source.vocab_size, source.context_length, threads)
    except ModelSourceError:
        raise
    except (OSError, RuntimeError, ValueError) as exc:  # a damaged file, or one of another model
        raise ModelSourceError(f"{source.path} cannot be loaded as a {fmt} export ({str(exc).splitlines()[0]}); "
                               "export the model again with meshyard export") from None


def open_export(path: Path, fmt: str, config: Config | None, vocab_size: int, context_length: int,
                threads: int = 0) -> Engine:
    """The engine of the export file ``path`` of format ``fmt`` (no sidecar needed: the
    export command checks a file through this before it writes the sidecar). A
    safetensors export needs the run's ``config`` to build its model."""
    if fmt == "safetensors":
        module = exports.read_safetensors(path, _build(config, vocab_size, path))
        engine = EagerEngine(module, vocab_size, context_length)
        engine.bytes = module_bytes(module) + _int8_bytes(module)  # packed int8 weights are no parameters
        return engine
    if fmt == "torchscript":
        scripted = exports.read_torchscript(path)
        return TorchScriptEngine(scripted, vocab_size, context_length, bytes_=path.stat().st_size)
    if fmt == "onnx":
        session = exports.onnx_session(path, threads)
        return OnnxEngine(session, vocab_size, context_length, bytes_=path.stat().st_size)
    raise ModelSourceError(f"{path}: unknown export format '{fmt}'; expected one of {', '.join(exports.FORMATS)}")


class TorchScriptEngine(ForwardEngine):
    """A TorchScript export (``torch.jit.load``) on the CPU."""

    def __init__(self, module: torch.jit.ScriptModule, vocab_size: int, context_length: int, bytes_: int) -> None:
        super().__init__(module, vocab_size, context_length, bytes_)


class OnnxEngine(ForwardEngine):
    """An ONNX export in an ONNX Runtime session on the CPU."""

    def __init__(self, session: Any, vocab_size: int, context_length: int, bytes_: int) -> None:
        super().__init__(exports.onnx_forward(session), vocab_size, context_length, bytes_)


def _sidecar(path: str) -> dict[str, Any]:
    try:
        return exports.read_sidecar(Path(path).expanduser())
    except exports.ExportFormatError as exc:
        raise ModelSourceError(str(exc)) from None


def _config(facts: dict[str, Any], path: str) -> Config | None:
    """The run config recorded in the sidecar (its model and data sections), if any."""
    recorded = facts.get("config")
    if not recorded:
        return None
    try:
        return config_from_dict(recorded)
    except ConfigError as exc:
        raise ModelSourceError(f"the sidecar of {path} records a config this meshyard cannot read "
                               f"({'; '.join(exc.problems)}); export the model again") from None


def _build(config: Config | None, vocab_size: int, path: Path) -> nn.Module:
    """A fresh float32 model of the exported run, to put a safetensors export's weights in."""
    if config is None:
        raise ModelSourceError(f"the sidecar of {path} records no config to build the model from; export the "
                               "model again with meshyard export")
    return build_served_model(config, vocab_size, path, "serve it where its model file can be found, or export "
                              "it to torchscript or onnx, which carry the model's code")


def _int8_bytes(module: nn.Module) -> int:
    """Bytes of the int8 layers' weights, scales, zero points and biases."""
    return sum(t.numel() * t.element_size() for layer in quantized_linears(module).values()
               for t in int8_entries(layer).values())


def _format_for(runtime: str) -> str:
    return next(fmt for fmt, rt in exports.RUNTIME_OF.items() if rt == runtime)
