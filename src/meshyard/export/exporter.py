"""``meshyard export``: write a run's model in a serving format, checked before it lands.

In order: the model is loaded as the server loads it (``describe`` + the eager engine);
the export is written into a scratch folder beside ``--out``; it is loaded back in the
runtime that will serve it (``meshyard.inference.runtimes.open_export``) and compared with the
eager model on the run's held-out batches. An INT8 export is the float32 export checked the
same way, then quantized, and its eval loss is held against the float32 model's. Only an
export that passes is moved to ``--out``, with its sidecar; otherwise nothing is left there.
"""

from __future__ import annotations

import math
import os
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import torch
from torch import nn

from meshyard.config.dump import recorded_dict
from meshyard.data.corpus import DataSourceError
from meshyard.errors import BadInput
from meshyard.export import formats
from meshyard.export.parity import HeldOut, Parity, compare, held_out, seconds_per_forward
from meshyard.export.quantize import quantize_linears, quantize_onnx
from meshyard.inference.engine import Forward
from meshyard.inference.exports import sidecar_path
from meshyard.inference.loading import describe, load_engine
from meshyard.inference.runtimes import open_export
from meshyard.inference.source import ModelSource
from meshyard.inference.tokenizer import tokenizer_record
from meshyard.plugins import PluginError
from meshyard.run_dir import RunDir

SPEED_BATCH = 16  # the batch the INT8 speed ratio is measured at
Report = Callable[[str], None]


class ExportInputError(BadInput, ValueError):
    """The export cannot be made from what was given; the message says what to give instead."""


class ExportRefused(Exception):
    """The export was written but failed its check; nothing was left at ``--out``."""


@dataclass(frozen=True)
class ExportRequest:
    """What ``meshyard export`` was asked for."""

    location: str  # a run directory or a checkpoint
    format: str
    out: Path
    int8: bool = False
    tolerance: float = 1e-4  # largest |logit difference| a float32 export may show
    max_loss_increase: float = 0.02  # largest relative eval-loss increase an INT8 export may show
    batches: int = 4  # held-out batches compared


@dataclass(frozen=True)
class Int8Figures:
    """An INT8 export against the float32 export of the same format."""

    parity: Parity  # against the eager float32 model
    fp32_bytes: int
    int8_bytes: int
    fp32_seconds: float  # one forward at batch SPEED_BATCH over the whole context
    int8_seconds: float

    @property
    def size_ratio(self) -> float:
        return self.fp32_bytes / self.int8_bytes

    @property
    def speed_ratio(self) -> float:
        return self.fp32_seconds / self.int8_seconds

    def as_dict(self) -> dict[str, Any]:
        return {**self.parity.as_dict(), "fp32_bytes": self.fp32_bytes, "int8_bytes": self.int8_bytes,
                "size_ratio": self.size_ratio, "fp32_seconds": self.fp32_seconds, "int8_seconds": self.int8_seconds,
                "speed_ratio": self.speed_ratio, "speed_batch": SPEED_BATCH}


def export_model(request: ExportRequest, report: Report = print) -> dict[str, Any]:
    """Write the checked export and its sidecar at ``request.out``; return the sidecar's facts.

    Raises ``ExportRefused`` when the export fails its check, ``ModelSourceError``,
    ``ExportFormatError`` or ``ExportInputError`` on bad input; in every case nothing is
    left at ``request.out``.
    """
    formats.check_suffix(request.format, request.out)
    source = describe(request.location)
    if not source.checkpoint:
        raise ExportInputError(f"{request.location} is already an export; give the run directory or checkpoint "
                               "it came from")
    eager = load_engine(source, "eager")
    held = _held_out(request, source)
    report(f"export: {source.name} {source.version} from {source.checkpoint}; checking on {held.description}")
    request.out.parent.mkdir(parents=True, exist_ok=True)
    scratch = Path(tempfile.mkdtemp(prefix=f".{request.out.name}.", dir=request.out.parent))
    try:
        facts = _write_checked(request, source, eager.module, eager.forward, held, scratch, report)
        candidate = scratch / request.out.name
        formats.write_sidecar(candidate, facts)
        # Some writers create their file private (0600); give it the mode of a file this
        # process creates (the sidecar's), as a user expects of an output file.
        os.chmod(candidate, sidecar_path(candidate).stat().st_mode & 0o777)
        os.replace(candidate, request.out)
        os.replace(sidecar_path(candidate), sidecar_path(request.out))
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    report(f"export: wrote {request.out} ({request.out.stat().st_size:,} bytes) and "
           f"{sidecar_path(request.out).name}")
    return facts


def _held_out(request: ExportRequest, source: ModelSource) -> HeldOut:
    try:
        return held_out(source.config.data, request.batches)
    except (DataSourceError, PluginError, OSError) as exc:
        raise ExportInputError(
            f"the held-out data of {request.location} cannot be read ({exc}); every export is checked on the run's "
            "own held-out samples, so run the export where the run's data is (data.paths, data.cache_dir or the "
            f"dataset builder of its {RunDir.CONFIG})") from None


def _write_checked(request: ExportRequest, source: ModelSource, module: nn.Module, eager: Forward,
                   held: HeldOut, scratch: Path, report: Report) -> dict[str, Any]:
    """Write the export into ``scratch`` (an INT8 one beside its float32 original), check
    it, and return the sidecar's facts; raise ``ExportRefused`` when a check fails."""
    suffix = request.out.suffix
    fp32_path = scratch / (f"fp32{suffix}" if request.int8 else request.out.name)
    example = formats.example_tokens(source.vocab_size, source.context_length)
    _write(request.format, module, fp32_path, example, source.context_length)
    fp32 = _open(request.format, fp32_path, source).forward
    parity = compare(eager, fp32, held)
    report(_parity_line("float32 " + request.format, parity))
    check_parity(request, parity)
    facts = _facts(request, source, parity)
    if request.int8:
        int8_path = scratch / request.out.name
        if request.format == "onnx":
            quantize_onnx(fp32_path, int8_path)
        else:
            _write(request.format, quantize_linears(module), int8_path, example, source.context_length)
        figures = _int8_figures(request, source, fp32, fp32_path, int8_path, eager, held)
        report(_parity_line("int8 " + request.format, figures.parity))
        report(f"int8: {figures.size_ratio:.2f}x smaller ({figures.fp32_bytes:,} -> {figures.int8_bytes:,} bytes), "
               f"{figures.speed_ratio:.2f}x as fast as float32 at batch {SPEED_BATCH} x {source.context_length} "
               "tokens, "
               f"eval loss {100 * figures.parity.relative_loss_change:+.3f}%")
        check_int8_loss(request, figures.parity)
        facts["int8_check"] = figures.as_dict()
    return facts


def _write(fmt: str, module: nn.Module, path: Path, example: torch.Tensor, context_length: int) -> None:
    if fmt == "safetensors":
        formats.write_safetensors(module, path)
    elif fmt == "torchscript":
        formats.write_torchscript(module, path, example)
    else:
        formats.write_onnx(module, path, example, context_length)


def _open(fmt: str, path: Path, source: ModelSource):
    """The export at ``path`` in the runtime that serves it, as the server opens it."""
    return open_export(path, fmt, source.config, source.vocab_size, source.context_length, torch.get_num_threads())


def _int8_figures(request: ExportRequest, source: ModelSource, fp32: Forward, fp32_path: Path, int8_path: Path,
                  eager: Forward, held: HeldOut) -> Int8Figures:
    int8 = _open(request.format, int8_path, source).forward
    tokens = torch.arange(SPEED_BATCH * source.context_length).reshape(SPEED_BATCH, -1) % source.vocab_size
    return Int8Figures(parity=compare(eager, int8, held), fp32_bytes=fp32_path.stat().st_size,
                       int8_bytes=int8_path.stat().st_size, fp32_seconds=seconds_per_forward(fp32, tokens, 3),
                       int8_seconds=seconds_per_forward(int8, tokens, 3))


def check_parity(request: ExportRequest, parity: Parity) -> None:
    """Refuse a float32 export whose logits differ from the eager model's beyond the tolerance."""
    if math.isfinite(parity.max_abs_diff) and parity.max_abs_diff <= request.tolerance:
        return
    how_far = (f"its logits differ by up to {parity.max_abs_diff:.3g} on held-out data" if
               math.isfinite(parity.max_abs_diff) else "it gave non-finite logits, logits of another shape, or "
               "failed on an input of another shape than the example's")
    raise ExportRefused(
        f"the {request.format} export does not compute what the model computes: {how_far}, beyond the "
        f"tolerance {request.tolerance:g} (eval loss "
        f"{parity.eager_loss:.5f} eager, {parity.export_loss:.5f} exported). Nothing was written to {request.out}. "
        "The model may do something its trace or the exporter cannot follow (data-dependent control flow, "
        "in-place tricks); try another --format, or pass a larger --tolerance if the difference is rounding you accept")


def check_int8_loss(request: ExportRequest, parity: Parity) -> None:
    """Refuse an INT8 export whose eval loss is worse than float32's by more than allowed."""
    change = parity.relative_loss_change
    if math.isfinite(change) and change <= request.max_loss_increase:
        return
    raise ExportRefused(
        f"the INT8 {request.format} export loses too much accuracy: its eval loss is {parity.export_loss:.5f} "
        f"against {parity.eager_loss:.5f} in float32, {100 * change:+.2f}%, beyond the allowed "
        f"{100 * request.max_loss_increase:+.2f}% (--max-loss-increase {request.max_loss_increase:g}). Nothing was "
        f"written to {request.out}. Serve the float32 export instead (drop --int8), or accept the loss with a "
        "larger --max-loss-increase")


def _parity_line(what: str, parity: Parity) -> str:
    return (f"{what}: max |logit diff| {parity.max_abs_diff:.3g}, eval loss {parity.eager_loss:.5f} eager vs "
            f"{parity.export_loss:.5f} exported ({parity.loss_change:+.2e})")


def _facts(request: ExportRequest, source: ModelSource, parity: Parity) -> dict[str, Any]:
    """The sidecar: what describes the export to a server, and how it was checked."""
    recorded = recorded_dict(source.config)
    version = f"{source.version}.{request.format}" + (".int8" if request.int8 else "")
    return {
        "format": request.format, "int8": request.int8, "vocab_size": source.vocab_size,
        "context_length": source.context_length,
        "tokenizer": tokenizer_record(source.tokenizer),
        "name": source.name, "version": version, "source": source.checkpoint,
        "parity": {**parity.as_dict(), "tolerance": request.tolerance},
        "max_loss_increase": request.max_loss_increase if request.int8 else None,
        "config": {"model": recorded["model"], "data": recorded["data"]},
        "opset": formats.ONNX_OPSET if request.format == "onnx" else None, "torch": torch.__version__,
    }
