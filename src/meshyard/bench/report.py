"""What every benchmark writes: a fixed-width table, a JSON record with the environment,
and plots (matplotlib with the Agg backend, so no display is needed)."""

from __future__ import annotations

import json
import os
import platform
import time
from pathlib import Path
from typing import Any, Sequence

import torch

from meshyard.errors import BadInput
from meshyard.extras import require


class BenchInputError(BadInput, ValueError):
    """A bad benchmark argument; the message says what is wrong and what is accepted."""


def default_out_dir(kind: str) -> Path:
    return Path("runs") / f"bench-{kind}-{time.strftime('%Y%m%d-%H%M%S')}"


def environment() -> dict[str, Any]:
    """Versions and hardware, so a figure can be traced to where it was measured."""
    import numpy

    import meshyard

    try:
        import matplotlib
        matplotlib_version = matplotlib.__version__
    except ImportError:  # an optional extra: the record is still written
        matplotlib_version = None
    cuda = torch.cuda.is_available()
    return {
        "time": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "host": platform.node(),
        "platform": platform.platform(),
        "machine": platform.machine(),
        "processor": platform.processor() or None,
        "cpu_count": os.cpu_count(),
        "python": platform.python_version(),
        "meshyard": meshyard.__version__,
        "torch": torch.__version__,
        "numpy": numpy.__version__,
        "matplotlib": matplotlib_version,
        "cuda": torch.version.cuda if cuda else None,
        "gpus": [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())] if cuda else [],
        "backend": "nccl" if cuda else "gloo",
    }


def format_table(headers: Sequence[str], rows: Sequence[Sequence[Any]]) -> str:
    """Right-aligned columns, one header line and a rule; floats as given by the caller."""
    cells = [[str(h) for h in headers]] + [[_cell(v) for v in row] for row in rows]
    widths = [max(len(row[i]) for row in cells) for i in range(len(headers))]
    lines = ["  ".join(c.rjust(w) for c, w in zip(row, widths)) for row in cells]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines)


def _cell(value: Any) -> str:
    if value is None:
        return "-"
    if isinstance(value, float):
        return f"{value:,.0f}" if abs(value) >= 1e4 else f"{value:.4g}"
    if isinstance(value, int) and not isinstance(value, bool):
        return f"{value:,}"
    return str(value)


def write_record(out_dir: Path, name: str, record: dict[str, Any], table: str) -> None:
    """``<name>.json`` (record plus environment) and ``<name>.txt`` (the table)."""
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / f"{name}.json").write_text(json.dumps({**record, "environment": environment()}, indent=2))
    (out_dir / f"{name}.txt").write_text(table + "\n")


def new_figure(columns: int, title: str):
    """A figure with ``columns`` side-by-side axes, drawn off-screen."""
    matplotlib = require("matplotlib", "the plots of 'meshyard bench'")
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, axes = plt.subplots(1, columns, figsize=(5.5 * columns, 4), squeeze=False)
    figure.suptitle(title)
    return figure, list(axes[0])


def save_figure(figure: Any, path: Path) -> None:
    import matplotlib.pyplot as plt

    figure.tight_layout()
    figure.savefig(path, dpi=110)
    plt.close(figure)


def bench_overrides(out_dir: Path, label: str) -> list[str]:
    """Overrides every benchmarked run gets: its own run directory, no progress bar and
    no checkpoints (the figures are about training, not about saving)."""
    return [f"--run.run_dir={(out_dir / 'runs' / label).resolve()}", "--metrics.progress_bar=false",
            "--checkpoint.enabled=false"]
