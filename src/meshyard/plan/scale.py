"""The scale simulator: one layout's predicted throughput across cluster sizes.

Two ways to grow a job, and they scale differently:

- fixed per-GPU batch (weak scaling): every data-parallel rank keeps its samples per
  step, the global batch grows with the cluster, compute per GPU stays constant and
  only communication grows; throughput is near-linear while the gradient exchange
  hides behind backward (Li et al. 2020, PyTorch DDP).
- fixed global batch (strong scaling): the same samples are spread thinner, compute
  per GPU shrinks while the gradient exchange does not, so efficiency falls (Goyal
  et al. 2017; the reason large runs raise the batch with the cluster).

At each size the strategy, tp and pp are kept; checkpointing, offload and the
micro-batch are chosen as the planner would unless the user fixed them.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from pathlib import Path

from meshyard.extras import require
from meshyard.plan.hardware import Cluster
from meshyard.plan.model import ModelDescription
from meshyard.plan.search import Candidate, PlanRequest, plan


@dataclass(frozen=True)
class ScalePoint:
    """The prediction at one cluster size, or why the layout cannot run there."""

    n_gpus: int
    global_batch: int
    candidate: Candidate | None
    reason: str = ""
    efficiency: float = 0.0
    """Throughput per GPU relative to the smallest size that runs (1.0 = linear)."""


@dataclass(frozen=True)
class ScaleResult:
    points: tuple[ScalePoint, ...]
    mode: str
    """'fixed global batch' or 'fixed per-GPU batch'."""
    layout_label: str
    gpus_per_node: int


def simulate_scale(desc: ModelDescription, cluster: Cluster, sizes: list[int], request: PlanRequest,
                   per_rank_batch: int = 0) -> ScaleResult:
    """Predict ``request``'s layout at each size in ``sizes``.

    ``request`` must fix one strategy, one tp and one pp. With ``per_rank_batch`` > 0
    each data-parallel rank keeps that many samples per step (weak scaling); otherwise
    ``request.global_batch`` stays fixed (strong scaling).
    """
    strategy, tp, pp = request.strategies[0], request.tp[0], request.pp[0]
    points: list[ScalePoint] = []
    for n in sizes:
        sized = cluster.with_gpus(n)
        dp = n // (tp * pp) if n % (tp * pp) == 0 else 0
        batch = per_rank_batch * dp if per_rank_batch else request.global_batch
        if dp == 0:
            points.append(ScalePoint(n, batch, None, f"tp x pp = {tp * pp} does not divide {n} GPUs"))
            continue
        result = plan(desc, sized, replace(request, global_batch=max(batch, 1)))
        if result.feasible:
            points.append(ScalePoint(n, batch, result.feasible[0]))
        elif result.rejected:
            points.append(ScalePoint(n, batch, None, result.rejected[0].reason))
        else:
            points.append(ScalePoint(n, batch, None, f"'{strategy}' is not a distinct layout on {n} GPUs"))
    mode = "fixed per-GPU batch" if per_rank_batch else "fixed global batch"
    return ScaleResult(points=tuple(_with_efficiency(points)), mode=mode,
                       layout_label=f"{strategy} tp={tp} pp={pp}", gpus_per_node=cluster.gpus_per_node)


def _with_efficiency(points: list[ScalePoint]) -> list[ScalePoint]:
    base = next((p for p in points if p.candidate is not None), None)
    if base is None or base.candidate is None:
        return points
    per_gpu = base.candidate.step.tokens_per_second / base.n_gpus
    return [replace(p, efficiency=p.candidate.step.tokens_per_second / p.n_gpus / per_gpu) if p.candidate else p
            for p in points]


def plot_scale(result: ScaleResult, path: str | Path, title: str = "") -> Path:
    """Write a PNG: throughput against GPUs (with the linear ideal) and efficiency."""
    matplotlib = require("matplotlib", "the plot of 'meshyard plan --scale'")
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ok = [p for p in result.points if p.candidate is not None]
    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4.2))
    if ok:
        gpus = [p.n_gpus for p in ok]
        tps = [p.candidate.step.tokens_per_second for p in ok]  # type: ignore[union-attr]
        ideal = [tps[0] * g / gpus[0] for g in gpus]
        left.plot(gpus, tps, "o-", label="predicted")
        left.plot(gpus, ideal, "--", color="grey", label="linear")
        right.plot(gpus, [100 * p.efficiency for p in ok], "o-")
    for point in result.points:
        if point.candidate is None:  # mark sizes where the layout cannot run
            for axis in (left, right):
                axis.axvline(point.n_gpus, color="tab:red", alpha=0.4, linestyle=":")
            right.annotate("cannot run", (point.n_gpus, 5), color="tab:red", ha="center", fontsize=8)
    left.set(xscale="log", yscale="log", xlabel="GPUs", ylabel="tokens/s", title="Throughput")
    left.legend()
    right.set(xscale="log", xlabel="GPUs", ylabel="scaling efficiency (%)", ylim=(0, 110),
              title=f"Efficiency ({result.mode})")
    for axis in (left, right):
        axis.grid(True, which="both", alpha=0.3)
    fig.suptitle(title or result.layout_label)
    fig.tight_layout()
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
