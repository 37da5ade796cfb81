"""Run a config twice (one process, then its own layout) and compare the two trainings.

Both runs get the same seed, data order and global batch, so they see the same samples
in every step; only the layout differs. Compared: each step's loss and gradient norm
(from ``metrics.jsonl``) and, at the end, every parameter (from the final checkpoint,
read back as full tensors). Dropout is switched off in both runs (``model.no_dropout``,
which reaches a custom model's own rates too), since its masks depend on the layout's
random streams and would differ by design, not by error; the report names what was on
(``dropout_notes``), so a user whose model trains with dropout knows what was compared.
"""

from __future__ import annotations

import dataclasses
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from meshyard.checkpoint.tools import model_state, resolve
from meshyard.config.sections import Config, ParallelConfig, PrecisionConfig, RunConfig
from meshyard.runtime.parallel_dims import ParallelDims
from meshyard.train.precision import resolve_dtype
from meshyard.validate import validate


@dataclass(frozen=True)
class Tolerance:
    """Largest differences still counted as the same training, for one precision."""

    loss_rel: float
    grad_norm_rel: float
    param_abs: float


# fp32 reorders sums across ranks (1e-7 per operation) and Adam may amplify that in
# near-zero moments; half precisions round every matmul to 3 (bf16) or 4 (fp16) digits.
TOLERANCES = {
    "fp32": Tolerance(loss_rel=1e-5, grad_norm_rel=1e-4, param_abs=1e-4),
    "bf16": Tolerance(loss_rel=2e-2, grad_norm_rel=5e-2, param_abs=5e-2),
    "fp16": Tolerance(loss_rel=1e-2, grad_norm_rel=5e-2, param_abs=2e-2),
}


def tolerance_for(run: RunConfig, precision: PrecisionConfig) -> tuple[str, Tolerance]:
    """The precision a run computes in and the tolerance that goes with it."""
    device = torch.device("cuda" if run.device != "cpu" and torch.cuda.is_available() else "cpu")
    name = {torch.float32: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16"}[
        resolve_dtype(precision.dtype, device)]
    return name, TOLERANCES[name]


@dataclass
class VerifyReport:
    """Per-step and final differences between the single-process and the layout run."""

    precision: str
    tolerance: Tolerance
    layout: str
    steps: list[dict[str, float]] = field(default_factory=list)
    max_param_diff: float = 0.0
    worst_param: str = ""
    missing: list[str] = field(default_factory=list)
    run_dirs: tuple[str, str] = ("", "")
    notes: list[str] = field(default_factory=list)

    @property
    def passed(self) -> bool:
        t = self.tolerance
        return (not self.missing and bool(self.steps) and self.max_param_diff <= t.param_abs
                and all(s["loss_rel"] <= t.loss_rel and s["grad_norm_rel"] <= t.grad_norm_rel for s in self.steps))

    def format(self) -> str:
        t = self.tolerance
        lines = [f"meshyard verify: {self.layout} against 1 process ({self.precision})",
                 f"{'step':>5} {'loss (1 proc)':>14} {'loss (layout)':>14} {'rel diff':>10} {'grad norm rel':>14}"]
        for s in self.steps:
            lines.append(f"{int(s['step']):>5} {s['loss_single']:>14.7f} {s['loss_layout']:>14.7f} "
                         f"{s['loss_rel']:>10.2e} {s['grad_norm_rel']:>14.2e}")
        lines.append(f"max parameter difference: {self.max_param_diff:.2e}"
                     + (f" ({self.worst_param})" if self.worst_param else ""))
        if self.missing:
            lines.append(f"parameters missing from one of the checkpoints: {', '.join(self.missing)}")
        lines += self.notes
        verdict = "PASS" if self.passed else "FAIL"
        lines.append(f"{verdict}: thresholds loss rel <= {t.loss_rel:g}, grad norm rel <= {t.grad_norm_rel:g}, "
                     f"parameters abs <= {t.param_abs:g}")
        return "\n".join(lines)


def describe_layout(p: ParallelConfig, nproc: int, dims: ParallelDims) -> str:
    parts = [f"{nproc} ranks", f"strategy {p.strategy}", f"dp_replicate {dims.dp_replicate}",
             f"dp_shard {dims.dp_shard}", f"tp {dims.tp}", f"pp {dims.pp}"]
    if dims.cp > 1:
        parts.append(f"cp {dims.cp}")
    if dims.ep > 1:
        parts.append(f"ep {dims.ep}")
    if dims.pp > 1:
        parts.append(f"{p.pp_schedule} x {p.microbatches or dims.pp} micro-batches")
    if p.ac != "none":
        parts.append(f"ac {p.ac}")
    return ", ".join(parts)


def dropout_notes(cfg: Config) -> list[str]:
    """A line for the report naming the dropout the model applies in training, which the
    comparison switches off; [] when it applies none (or cannot be built on the meta
    device here, where the runs will say what is wrong)."""
    from meshyard.data.corpus import BYTE_VOCAB
    from meshyard.models.dropout import active_dropout
    from meshyard.models.registry import build_model

    try:
        with torch.device("meta"):
            model = build_model(dataclasses.replace(cfg.model, no_dropout=False),
                                cfg.model.vocab_size or cfg.data.vocab_size or BYTE_VOCAB, cfg.data.seq_len)
    except Exception:  # noqa: BLE001 - a builder's failure is the runs' to report
        return []
    found = active_dropout(model)
    if not found:
        return []
    return [f"dropout switched off in both runs: {', '.join(found)} (its masks depend on each layout's random "
            "streams, so with it on the losses differ by design; set model.no_dropout = true to train so)"]


RANDOMNESS_CHECK_PARAMETERS = 50_000_000
"""Models up to this size are run twice on one batch (in training mode, dropout off) to
find randomness other than dropout; larger ones are not built in full for that."""


def randomness_notes(cfg: Config) -> list[str]:
    """A line for the report when the model's forward is random in training even with its
    dropout off (noise, sampling, random masks): two forwards of one batch under different
    random seeds differ, and so will the runs compared. [] when they agree, or when the
    model is too large (``RANDOMNESS_CHECK_PARAMETERS``) or cannot be built here."""
    from meshyard.data.corpus import BYTE_VOCAB
    from meshyard.models.outputs import logits_of
    from meshyard.models.registry import build_model

    model_cfg = dataclasses.replace(cfg.model, no_dropout=True)
    vocab = cfg.model.vocab_size or cfg.data.vocab_size or BYTE_VOCAB
    try:
        with torch.device("meta"):
            size = sum(p.numel() for p in build_model(model_cfg, vocab, cfg.data.seq_len).parameters())
        if size > RANDOMNESS_CHECK_PARAMETERS:
            return []
        torch.manual_seed(0)
        model = build_model(model_cfg, vocab, cfg.data.seq_len).train()
        tokens = torch.randint(0, vocab, (2, min(cfg.data.seq_len, 16)), generator=torch.Generator().manual_seed(0))
        outputs = []
        for seed in (1, 2):
            torch.manual_seed(seed)
            with torch.no_grad():
                outputs.append(logits_of(model(tokens)).float())
    except Exception:  # noqa: BLE001 - a model that cannot run here is the runs' to report
        return []
    difference = (outputs[0] - outputs[1]).abs().max().item()
    if difference == 0:
        return []
    return [f"the model's forward is random in training even with dropout off (two forwards of one batch under "
            f"different seeds differ by up to {difference:.2e}), so the runs compared differ by that too; make the "
            "forward deterministic in training (or behind a flag) to verify the layout"]


def _for_comparison(cfg: Config, steps: int, run_dir: Path) -> Config:
    """Same job, ``steps`` long, dropout off (the model's own rates too), a final
    synchronous checkpoint, own run dir."""
    return dataclasses.replace(
        cfg,
        model=dataclasses.replace(cfg.model, dropout=0.0, no_dropout=True),
        train=dataclasses.replace(cfg.train, steps=steps, eval_every=0),
        checkpoint=dataclasses.replace(cfg.checkpoint, enabled=True, save_final=True, interval=0,
                                       interval_minutes=0.0, async_save=False, dir=""),
        metrics=dataclasses.replace(cfg.metrics, jsonl=True, progress_bar=False),
        run=dataclasses.replace(cfg.run, run_dir=str(run_dir)),
    )


def single_process(cfg: Config, micro_batch: int) -> Config:
    """``cfg`` on one process: no parallelism, the same global batch in micro-batches of
    the layout's size (so it fits where one rank of the layout fits activations)."""
    return dataclasses.replace(
        cfg,
        parallel=ParallelConfig(strategy="none"),
        train=dataclasses.replace(cfg.train, micro_batch=micro_batch, grad_accum=0),
        run=dataclasses.replace(cfg.run, nproc=1),
    )


def _rel(a: float, b: float) -> float:
    return abs(a - b) / max(abs(b), 1e-12)


def compare_runs(single_dir: Path, layout_dir: Path, report: VerifyReport) -> VerifyReport:
    """Fill ``report`` from two finished run directories."""
    from meshyard.metrics.records import read_metrics

    expected, actual = read_metrics(single_dir), read_metrics(layout_dir)
    for e, a in zip(expected, actual):
        report.steps.append({"step": e["step"], "loss_single": e["loss"], "loss_layout": a["loss"],
                             "loss_rel": _rel(a["loss"], e["loss"]),
                             "grad_norm_rel": _rel(a.get("grad_norm", 0.0), e.get("grad_norm", 0.0))})
    if len(expected) != len(actual):
        report.missing.append(f"steps ({len(expected)} vs {len(actual)} recorded)")
    reference = model_state(resolve(str(single_dir), {}))
    trained = model_state(resolve(str(layout_dir), {}))
    report.missing += sorted(set(reference) ^ set(trained))
    for name in sorted(set(reference) & set(trained)):
        diff = (trained[name].float() - reference[name].float()).abs().max().item() if reference[name].numel() else 0.0
        if diff > report.max_param_diff:  # named only when some parameter differs at all
            report.max_param_diff, report.worst_param = diff, name
    return report


def verify_layout(cfg: Config, nproc: int, steps: int = 5, workdir: str | Path | None = None,
                  quiet: bool = True) -> VerifyReport:
    """Train ``cfg`` for ``steps`` on one process and on ``nproc`` ranks; compare them.

    Raises ``ConfigError`` if ``cfg`` is not valid on ``nproc`` ranks. Run directories go
    under ``workdir`` (kept) or a temporary folder (removed).
    """
    from meshyard.api import run

    layout_cfg = dataclasses.replace(cfg, run=dataclasses.replace(cfg.run, nproc=nproc))
    checked = validate(layout_cfg, nproc)
    batch = checked.batch
    precision, tolerance = tolerance_for(cfg.run, cfg.precision)
    report = VerifyReport(precision, tolerance, describe_layout(layout_cfg.parallel, nproc, checked.dims),
                          notes=dropout_notes(cfg) + randomness_notes(cfg))
    with tempfile.TemporaryDirectory(prefix="meshyard-verify-") as scratch:
        root = Path(workdir) if workdir else Path(scratch)
        single_cfg = _for_comparison(single_process(cfg, batch.micro_batch), steps, root / "single")
        layout_run_cfg = _for_comparison(layout_cfg, steps, root / "layout")
        _quietly(run, quiet, single_cfg, nproc=1, resume="none")
        _quietly(run, quiet, layout_run_cfg, nproc=nproc, resume="none")
        report.run_dirs = (str(root / "single"), str(root / "layout"))
        return compare_runs(root / "single", root / "layout", report)


def _quietly(fn: Any, quiet: bool, *args: Any, **kwargs: Any) -> Any:
    """Run ``fn`` with this process's stdout silenced (the runs' own records stay on disk)."""
    if not quiet:
        return fn(*args, **kwargs)
    import contextlib
    import io

    with contextlib.redirect_stdout(io.StringIO()):
        return fn(*args, **kwargs)
