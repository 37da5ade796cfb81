"""meshyard against its peers: the same training job under five loops, side by side.

Every contender trains meshyard's own GPT (built by ``meshyard.models.registry.build_model``
with the same seed), on the same random tokens held in memory (the ``random`` data
source: 1M tokens from ``numpy.random.default_rng(0)``, cut into windows of seq_len + 1),
with the same global batch, AdamW hyperparameters, warmup + cosine learning-rate
schedule (meshyard's ``OptimConfig`` defaults), gradient clipping at 1.0 and DDP
settings (25 MiB buckets, gradients as bucket views), on N CPU ranks over gloo with
one thread per rank, without evaluation or checkpoints:

    ddp                a hand-written torch DDP loop, ranks started by torch.multiprocessing
    accelerate         Hugging Face Accelerate (Accelerator(cpu=True) under torchrun, its
                       multi-CPU launch without MPI)
    fabric             Lightning Fabric (Fabric(accelerator="cpu", strategy="ddp"), its own launcher)
    meshyard           ``meshyard run --nproc N`` (meshyard's launcher: the elastic agent)
    meshyard-torchrun  ``torchrun --nproc-per-node N -m meshyard.cli run``

Each round runs every contender once, as a fresh job, in a shuffled order, so drift on
a shared machine hits all of them. Each job loads its batches through its usual loader
(a DataLoader over the windows, sharded by its framework; meshyard's own sharded
loader), and rank 0 notes when every step ends. The figure is the step period: the
time between consecutive step ends, which covers everything a loop does per step
(loading, forward, backward, clipping, optimizer, schedule, loss.item(), and any
records or checks it keeps); the first --warmup steps are skipped. "in-step" is the
time from fetching the batch to the loss being read (meshyard's ``step_time_s``); the
rest of the period is per-step work between steps.

Printed per contender: the median period over all measured steps, the spread of the
per-round medians, the ratio to the fastest contender and that ratio's spread over the
rounds (each round's median against the fastest's in the same round). meshyard's target
is within 3% of the fastest peer. meshyard runs with its breakdown timer, MFU and
per-rank gathering off (``--full-metrics`` turns them back on); what it always does
(metrics.jsonl, per-rank logs, the per-step agreement all-reduce, the hang watchdog)
stays on.

Accelerate and Lightning are not meshyard dependencies: ``pip install -e '.[bench]'``
installs them; a contender whose framework is missing is skipped with a message.

    python benchmarks/peers.py [--rounds 10] [--steps 40] [--warmup 5] [--model gpt-mini]
                               [--contenders ddp,accelerate,fabric,meshyard,meshyard-torchrun]
                               [--full-metrics] [--out peers.json]
"""

from __future__ import annotations

import argparse
import functools
import importlib
import json
import os
import random
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterable

import numpy as np
import torch
import torch.distributed as dist
import torch.nn.functional as F

from meshyard.config.sections import ModelConfig, OptimConfig
from meshyard.models.registry import build_model
from meshyard.train.optim import lr_multiplier, parameter_groups

VOCAB = 256  # the random source's vocabulary (byte-sized)
SEED = 1234  # meshyard's train.seed default: same initial weights everywhere
GRAD_CLIP = 1.0
BUCKET_MB = 25.0
OPTIM = OptimConfig()  # lr, betas, eps, weight decay, warmup and cosine floor: meshyard's defaults
INSTALL_HINT = "pip install -e '.[bench]'"
TORCHRUN = [sys.executable, "-m", "torch.distributed.run", "--standalone"]


@dataclass(frozen=True)
class Contender:
    label: str
    modules: tuple[str, ...] = ()  # any one of these must import (alternative package names)
    package: str = ""  # what to install, named in the message when it is missing


CONTENDERS: dict[str, Contender] = {
    "ddp": Contender("plain torch DDP"),
    "accelerate": Contender("HF Accelerate", ("accelerate",), "accelerate"),
    "fabric": Contender("Lightning Fabric", ("lightning.fabric", "lightning_fabric"), "lightning"),
    "meshyard": Contender("meshyard"),
    "meshyard-torchrun": Contender("meshyard torchrun"),
}
PEERS = ("ddp", "accelerate", "fabric")


# --- what every peer shares ---------------------------------------------------------

class TokenWindows(torch.utils.data.Dataset):
    """Non-overlapping windows of seq_len + 1 random tokens: (input, next-token target)."""

    def __init__(self, tokens: int, seq_len: int) -> None:
        self.tokens = np.random.default_rng(0).integers(0, VOCAB, size=tokens, dtype=np.int64)
        self.seq_len = seq_len

    def __len__(self) -> int:
        return (len(self.tokens) - 1) // self.seq_len

    def __getitem__(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        start = index * self.seq_len
        window = torch.from_numpy(self.tokens[start : start + self.seq_len + 1])
        return window[:-1], window[1:]


def build_job(args: argparse.Namespace) -> tuple[torch.nn.Module, torch.optim.Optimizer, Any, TokenWindows]:
    """The model, AdamW, its schedule and the dataset, identical for every peer."""
    torch.set_num_threads(1)
    torch.manual_seed(SEED)
    model = build_model(ModelConfig(name=args.model), VOCAB, args.seq_len)
    optimizer = torch.optim.AdamW(parameter_groups(model, OPTIM.weight_decay), lr=OPTIM.lr,
                                  betas=tuple(OPTIM.betas), eps=OPTIM.eps)
    schedule = functools.partial(lr_multiplier, warmup_steps=OPTIM.warmup_steps, total_steps=args.steps,
                                 schedule=OPTIM.schedule, min_lr_ratio=OPTIM.min_lr_ratio)
    return model, optimizer, torch.optim.lr_scheduler.LambdaLR(optimizer, schedule), TokenWindows(
        args.random_tokens, args.seq_len)


def next_token_loss(model: torch.nn.Module, inputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    logits = model(inputs)
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))


def timed_loop(batches: Iterable, steps: int, train_step: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]
               ) -> dict[str, list[float]]:
    """Run ``steps`` steps; the same clock points for every peer: before the batch is
    fetched, and after the loss is read."""
    starts, ends, losses = [], [], []
    iterator = iter(batches)
    for _ in range(steps):
        start = time.perf_counter()
        inputs, targets = next(iterator)
        losses.append(train_step(inputs, targets).item())
        ends.append(time.perf_counter())
        starts.append(start)
    return {"starts": starts, "ends": ends, "losses": losses}


def finish(path: str, times: dict[str, list[float]], is_main: bool) -> None:
    """Rank 0 saves its clock readings; then all ranks leave together (a rank tearing its
    group down while its peer still has gloo work in flight can hang on exit)."""
    if is_main:
        Path(path).write_text(json.dumps(times))
    if dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()


# --- the peers (each runs inside its own job's worker processes) ---------------------

def ddp_rank(rank: int, args: argparse.Namespace) -> None:
    from torch.nn.parallel import DistributedDataParallel
    from torch.utils.data.distributed import DistributedSampler

    dist.init_process_group("gloo", rank=rank, world_size=args.nproc)
    model, optimizer, scheduler, dataset = build_job(args)
    model = DistributedDataParallel(model, bucket_cap_mb=BUCKET_MB, gradient_as_bucket_view=True)
    sampler = DistributedSampler(dataset, args.nproc, rank, shuffle=True, seed=SEED, drop_last=True)
    loader = torch.utils.data.DataLoader(dataset, batch_size=args.global_batch // args.nproc, sampler=sampler,
                                         drop_last=True)

    def train_step(inputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        loss = next_token_loss(model, inputs, targets)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), GRAD_CLIP)
        optimizer.step()
        scheduler.step()
        optimizer.zero_grad(set_to_none=True)
        return loss

    finish(args.times, timed_loop(loader, args.steps, train_step), rank == 0)


def ddp_worker(args: argparse.Namespace) -> None:
    import torch.multiprocessing as mp

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()))
    mp.spawn(ddp_rank, (args,), nprocs=args.nproc)


def accelerate_worker(args: argparse.Namespace) -> None:
    from accelerate import Accelerator
    from accelerate.utils import DistributedDataParallelKwargs

    # The schedule steps once per optimizer step, as in the other loops (by default
    # Accelerate steps it once per process).
    accelerator = Accelerator(cpu=True, step_scheduler_with_optimizer=False, kwargs_handlers=[
        DistributedDataParallelKwargs(bucket_cap_mb=int(BUCKET_MB), gradient_as_bucket_view=True)])
    model, optimizer, scheduler, dataset = build_job(args)
    loader = torch.utils.data.DataLoader(dataset, batch_size=args.global_batch // args.nproc, shuffle=True,
                                         drop_last=True)
    model, optimizer, loader, scheduler = accelerator.prepare(model, optimizer, loader, scheduler)

    def train_step(inputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        loss = next_token_loss(model, inputs, targets)
        accelerator.backward(loss)
        accelerator.clip_grad_norm_(model.parameters(), GRAD_CLIP)
        optimizer.step()
        scheduler.step()
        optimizer.zero_grad(set_to_none=True)
        return loss

    finish(args.times, timed_loop(loader, args.steps, train_step), accelerator.is_main_process)


def fabric_worker(args: argparse.Namespace) -> None:
    try:
        from lightning.fabric import Fabric
        from lightning.fabric.strategies import DDPStrategy
    except ImportError:
        from lightning_fabric import Fabric
        from lightning_fabric.strategies import DDPStrategy

    strategy = DDPStrategy(bucket_cap_mb=BUCKET_MB, gradient_as_bucket_view=True)
    fabric = Fabric(accelerator="cpu", devices=args.nproc, strategy=strategy, precision="32-true")
    fabric.launch()  # starts the other ranks by running this command again
    model, optimizer, scheduler, dataset = build_job(args)
    model, optimizer = fabric.setup(model, optimizer)
    loader = fabric.setup_dataloaders(torch.utils.data.DataLoader(
        dataset, batch_size=args.global_batch // args.nproc, shuffle=True, drop_last=True))

    def train_step(inputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        loss = next_token_loss(model, inputs, targets)
        fabric.backward(loss)
        fabric.clip_gradients(model, optimizer, max_norm=GRAD_CLIP)
        optimizer.step()
        scheduler.step()
        optimizer.zero_grad(set_to_none=True)
        return loss

    finish(args.times, timed_loop(loader, args.steps, train_step), fabric.global_rank == 0)


WORKERS = {"ddp": ddp_worker, "accelerate": accelerate_worker, "fabric": fabric_worker}


# --- the driver: one fresh job per contender and round ------------------------------

def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def missing(name: str) -> str | None:
    """Why contender ``name`` cannot run here (its framework does not import), or None."""
    contender = CONTENDERS[name]
    errors = []
    for module in contender.modules:
        try:
            importlib.import_module(module)
            return None
        except ImportError as exc:
            errors.append(str(exc))
    return f"{contender.package} is not installed ({errors[0]})" if errors else None


def meshyard_overrides(args: argparse.Namespace, run_dir: Path) -> list[str]:
    measured = "true" if args.full_metrics else "false"
    return [
        f"--model.name={args.model}", "--data.source=random", f"--data.seq_len={args.seq_len}",
        f"--data.random_tokens={args.random_tokens}", f"--data.cache_dir={run_dir.parent / 'cache'}",
        f"--train.steps={args.steps}", f"--train.global_batch={args.global_batch}", f"--train.seed={SEED}",
        f"--train.grad_clip={GRAD_CLIP}", "--train.eval_every=0", "--checkpoint.enabled=false",
        "--parallel.strategy=ddp", f"--parallel.bucket_mb={BUCKET_MB}", "--parallel.gradient_as_bucket_view=true",
        "--run.threads_per_rank=1", f"--run.run_dir={run_dir}", "--metrics.progress_bar=false",
        f"--metrics.log_every={10**6}", f"--metrics.breakdown={measured}", f"--metrics.mfu={measured}",
        f"--metrics.gather_every={10 if args.full_metrics else 0}",
    ]


def peer_argv(args: argparse.Namespace, name: str, work: Path) -> list[str]:
    # The settings travel in a file: torchrun would take options such as --nproc
    # for abbreviations of its own.
    settings = {key: value for key, value in vars(args).items() if key not in ("out", "contenders")}
    (work / "job.json").write_text(json.dumps({**settings, "times": str(work / "times.json")}))
    worker = [str(Path(__file__).resolve()), "--worker", name, str(work / "job.json")]
    if name == "accelerate":
        return [*TORCHRUN, "--nproc-per-node", str(args.nproc), *worker]
    return [sys.executable, *worker]


def command(args: argparse.Namespace, name: str, work: Path) -> list[str]:
    if name == "meshyard":
        return [sys.executable, "-m", "meshyard.cli", "run", "--nproc", str(args.nproc),
                *meshyard_overrides(args, work / "run")]
    if name == "meshyard-torchrun":
        return [*TORCHRUN, "--nproc-per-node", str(args.nproc), "-m", "meshyard.cli", "run",
                *meshyard_overrides(args, work / "run")]
    return peer_argv(args, name, work)


def read_times(name: str, work: Path) -> dict[str, list[float]]:
    """Step ends, in-step times and losses of rank 0, whichever way the job reported them."""
    if name.startswith("meshyard"):
        from meshyard.metrics.records import read_metrics

        records = read_metrics(work / "run")
        return {"ends": [r["time"] for r in records], "in_step": [r["step_time_s"] for r in records],
                "losses": [r["loss"] for r in records]}
    times = json.loads((work / "times.json").read_text())
    return {"ends": times["ends"], "in_step": [e - s for s, e in zip(times["starts"], times["ends"])],
            "losses": times["losses"]}


CONTENDER_TIMEOUT_S = 900
"""Longest a contender's job may take: minutes for the default job even on a busy machine."""


def run_contender(args: argparse.Namespace, name: str, work: Path) -> dict[str, Any]:
    """One fresh job; its steady-state step periods and in-step times."""
    work.mkdir(parents=True)
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore"}
    started = time.perf_counter()
    try:
        proc = subprocess.run(command(args, name, work), cwd=work, env=env, capture_output=True, text=True,
                              timeout=CONTENDER_TIMEOUT_S)
    except subprocess.TimeoutExpired as exc:
        # A job that hangs (a gloo group torn down while its peer still works) must not
        # hold the whole comparison: it is named, with its last output.
        output = "".join(part.decode() if isinstance(part, bytes) else part or "" for part in (exc.stdout, exc.stderr))
        tail = "\n".join(output.splitlines()[-30:])
        raise SystemExit(f"peers: {name} did not finish in {CONTENDER_TIMEOUT_S} s:\n{tail}") from None
    job_s = time.perf_counter() - started
    if proc.returncode != 0:
        tail = "\n".join((proc.stdout + proc.stderr).splitlines()[-30:])
        raise SystemExit(f"peers: {name} failed (exit code {proc.returncode}):\n{tail}")
    times = read_times(name, work)
    ends, skip = times["ends"], args.warmup
    if len(ends) != args.steps:
        raise SystemExit(f"peers: {name} reported {len(ends)} steps, expected {args.steps}")
    return {"periods_s": [ends[i] - ends[i - 1] for i in range(skip, len(ends))],
            "in_step_s": times["in_step"][skip:], "mean_loss": statistics.fmean(times["losses"][skip:]),
            "job_s": job_s}


def measure(args: argparse.Namespace, names: list[str]) -> dict[str, list[dict[str, Any]]]:
    """Every contender once per round, in a new shuffled order each round."""
    shuffler = random.Random(args.seed)
    rounds: dict[str, list[dict[str, Any]]] = {name: [] for name in names}
    with tempfile.TemporaryDirectory(prefix="meshyard-peers-") as tmp:
        for index in range(args.rounds):
            order = shuffler.sample(names, len(names))
            for name in order:
                rounds[name].append(run_contender(args, name, Path(tmp) / f"round{index}" / name))
            print(f"round {index + 1}/{args.rounds}: " + ", ".join(
                f"{name} {statistics.median(rounds[name][-1]['periods_s']) * 1e3:.2f} ms" for name in order),
                flush=True)
    return rounds


# --- figures ------------------------------------------------------------------------

def summarize(rounds: dict[str, list[dict[str, Any]]]) -> dict[str, Any]:
    """Pooled medians, ratios to the fastest contender, and their spread over rounds."""
    median = {name: statistics.median([p for r in runs for p in r["periods_s"]]) for name, runs in rounds.items()}
    per_round = {name: [statistics.median(r["periods_s"]) for r in runs] for name, runs in rounds.items()}
    fastest = min(median, key=median.get)

    def paired(name: str, against: str) -> list[float]:
        return [mine / theirs for mine, theirs in zip(per_round[name], per_round[against])]

    contenders = {}
    for name, runs in rounds.items():
        ratios = paired(name, fastest)
        contenders[name] = {
            "label": CONTENDERS[name].label, "median_step_s": median[name],
            "round_medians_s": per_round[name], "ratio_to_fastest": median[name] / median[fastest],
            "round_ratios_to_fastest": ratios,
            "median_in_step_s": statistics.median([t for r in runs for t in r["in_step_s"]]),
            "median_job_s": statistics.median([r["job_s"] for r in runs]),
            "mean_loss": statistics.fmean([r["mean_loss"] for r in runs]),
        }
    summary: dict[str, Any] = {"fastest": fastest, "contenders": contenders, "targets": {}}
    peers = [name for name in PEERS if name in median]
    if peers:
        best_peer = min(peers, key=median.get)
        for name in (n for n in median if n.startswith("meshyard")):
            ratios = paired(name, best_peer)
            summary["targets"][name] = {
                "fastest_peer": best_peer, "ratio": median[name] / median[best_peer],
                "median_round_ratio": statistics.median(ratios), "round_ratios": ratios, "target": 1.03,
            }
    return summary


def print_summary(args: argparse.Namespace, summary: dict[str, Any]) -> None:
    from meshyard.bench.report import format_table

    print(f"\n{args.model}, {args.nproc} ranks (gloo, 1 thread each), global batch {args.global_batch} x "
          f"{args.seq_len} tokens, {args.rounds} rounds x {args.steps - args.warmup} measured steps "
          f"(after {args.warmup} warm-up steps) per contender")
    rows = []
    for name, c in sorted(summary["contenders"].items(), key=lambda item: item[1]["median_step_s"]):
        low, high = min(c["round_medians_s"]), max(c["round_medians_s"])
        rows.append([c["label"], f"{c['median_step_s'] * 1e3:.2f}", f"{low * 1e3:.2f}-{high * 1e3:.2f}",
                     f"{c['ratio_to_fastest']:.4f}",
                     f"{min(c['round_ratios_to_fastest']):.3f}-{max(c['round_ratios_to_fastest']):.3f}",
                     f"{c['median_in_step_s'] * 1e3:.2f}", f"{c['median_job_s']:.1f}", f"{c['mean_loss']:.4f}"])
    print(format_table(["contender", "ms/step", "rounds min-max", "x fastest", "per round min-max",
                        "in-step ms", "job s", "mean loss"], rows))
    for name, t in summary["targets"].items():
        verdict = "within" if t["ratio"] <= t["target"] else "OVER"
        print(f"{CONTENDERS[name].label} / {CONTENDERS[t['fastest_peer']].label}: {t['ratio']:.4f} "
              f"(per-round median {t['median_round_ratio']:.4f}, min-max {min(t['round_ratios']):.3f}-"
              f"{max(t['round_ratios']):.3f}); {verdict} the {t['target']:.2f} target")


def write_json(path: Path, args: argparse.Namespace, summary: dict[str, Any],
               rounds: dict[str, list[dict[str, Any]]]) -> None:
    from meshyard.bench.report import environment

    versions = {}
    for module in ("accelerate", "lightning"):
        try:
            versions[module] = importlib.import_module(module).__version__
        except ImportError:
            versions[module] = None
    settings = {key: value for key, value in vars(args).items() if key not in ("worker", "job", "out")}
    record = {"settings": settings, **summary, "rounds": rounds, "environment": {**environment(), **versions}}
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(record, indent=2))
    print(f"figures written to {path}")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=10, help="times each contender runs (shuffled per round)")
    parser.add_argument("--steps", type=int, default=40, help="optimizer steps per job")
    parser.add_argument("--warmup", type=int, default=5, help="first steps of each job left out (at least 1)")
    parser.add_argument("--model", default="gpt-mini", help="meshyard GPT preset")
    parser.add_argument("--seq-len", type=int, default=128)
    parser.add_argument("--global-batch", type=int, default=16)
    parser.add_argument("--nproc", type=int, default=2)
    parser.add_argument("--random-tokens", type=int, default=1_048_576, help="length of the random token corpus")
    parser.add_argument("--contenders", default=",".join(CONTENDERS), help="comma-separated subset of: "
                        + ", ".join(CONTENDERS))
    parser.add_argument("--full-metrics", action="store_true",
                        help="meshyard with its breakdown timer, MFU and per-rank gathering on (its defaults)")
    parser.add_argument("--seed", type=int, default=0, help="seed of the per-round shuffle")
    parser.add_argument("--out", type=Path, help="write the figures (and every step period) to this JSON file")
    parser.add_argument("--worker", choices=sorted(WORKERS), help=argparse.SUPPRESS)
    parser.add_argument("job", nargs="?", help=argparse.SUPPRESS)  # a worker's settings (JSON)
    args = parser.parse_args(argv)
    if bool(args.worker) != bool(args.job):
        parser.error("unexpected argument: the script takes only options")
    names = [n.strip() for n in args.contenders.split(",") if n.strip()]
    unknown = [n for n in names if n not in CONTENDERS]
    if unknown or not names:
        parser.error(f"unknown contenders ({', '.join(unknown)}); known: {', '.join(CONTENDERS)}")
    if not 1 <= args.warmup < args.steps - 1:
        parser.error(f"--warmup {args.warmup} must be at least 1 and leave at least 2 of --steps {args.steps}")
    if args.global_batch % args.nproc:
        parser.error(f"--global-batch {args.global_batch} is not a multiple of --nproc {args.nproc}")
    args.contenders = names
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.worker:
        WORKERS[args.worker](argparse.Namespace(**json.loads(Path(args.job).read_text())))
        return 0
    names = []
    for name in args.contenders:
        why = missing(name)
        if why:
            print(f"peers: skipping {CONTENDERS[name].label}: {why}; install the peers with: {INSTALL_HINT}",
                  flush=True)
        else:
            names.append(name)
    if not names:
        print("peers: nothing left to measure", file=sys.stderr)
        return 2
    rounds = measure(args, names)
    summary = summarize(rounds)
    print_summary(args, summary)
    if args.out:
        write_json(args.out, args, summary, rounds)
    return 0


if __name__ == "__main__":
    sys.exit(main())
