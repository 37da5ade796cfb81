"""``meshyard export RUN|CHECKPOINT --format F [--int8] --out PATH``: argument parsing only."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from meshyard.export.exporter import ExportInputError, ExportRefused, ExportRequest, export_model
from meshyard.inference.exports import FORMATS, RUNTIME_OF, ExportFormatError
from meshyard.inference.source import ModelSourceError

EXIT_REFUSED = 1

EPILOG = """examples:
  meshyard export runs/tiny --format onnx --out tiny.onnx
  meshyard export runs/tiny --format torchscript --int8 --out tiny-int8.pt
  meshyard serve tiny.onnx --runtime onnxruntime

Every export is loaded back in the runtime that serves it and compared with the eager model on the
run's held-out samples; an export beyond --tolerance (float32) or --max-loss-increase (INT8) is
refused and nothing is written. Beside PATH goes PATH.json, the sidecar a server reads."""


def register(subparsers: argparse._SubParsersAction) -> None:
    """Register ``meshyard export``; what cannot be exported is told as ``meshyard export: ...``.
    It takes no config overrides."""
    p = subparsers.add_parser(
        "export", help="write a trained model as safetensors, TorchScript or ONNX (optionally INT8), checked",
        description="Write the model of a run (its newest valid checkpoint) or of one checkpoint in a format\n"
        "for serving: safetensors (eager PyTorch), torchscript or onnx (ONNX Runtime).",
        epilog=EPILOG, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("location", metavar="RUN|CHECKPOINT", help="a run directory or one of its checkpoints")
    p.add_argument("--format", required=True, choices=list(FORMATS),
                   help="; ".join(f"{fmt}: {' or '.join(suffixes)}, runtime {RUNTIME_OF[fmt]}"
                                  for fmt, suffixes in FORMATS.items()))
    p.add_argument("--out", required=True, type=Path, metavar="PATH",
                   help="the export file (its suffix names the format)")
    p.add_argument("--int8", action="store_true",
                   help="quantize the linear layers to int8 (dynamic quantization: PyTorch's, or ONNX Runtime's "
                   "for onnx)")
    p.add_argument("--tolerance", type=float, default=1e-4, metavar="T",
                   help="largest |logit difference| from the eager model a float32 export may show (default 1e-4)")
    p.add_argument("--max-loss-increase", type=float, default=0.02, metavar="F",
                   help="refuse an INT8 export whose eval loss is worse than float32's by more than this fraction "
                   "(default 0.02 = 2%%)")
    p.add_argument("--batches", type=int, default=4, metavar="N",
                   help="held-out batches of 8 samples compared (default 4)")
    p.set_defaults(handler=main, takes_overrides=False,
                   own_errors=(ModelSourceError, ExportFormatError, ExportInputError), error_prefix="meshyard export")


def main(args: argparse.Namespace, overrides: list[str]) -> int:
    """Run the export; 0 when written, 1 when refused by its check; bad input raises (exit code 2)."""
    if args.batches < 1 or args.tolerance < 0:
        raise ExportInputError("--batches must be at least 1 and --tolerance at least 0")
    request = ExportRequest(location=args.location, format=args.format, out=args.out, int8=args.int8,
                            tolerance=args.tolerance, max_loss_increase=args.max_loss_increase, batches=args.batches)
    try:
        export_model(request, report=lambda line: print(f"meshyard {line}", flush=True))
    except ExportRefused as exc:
        print(f"meshyard export: refused: {exc}", file=sys.stderr)
        return EXIT_REFUSED
    return 0

