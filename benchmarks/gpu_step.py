"""meshyard's single-device training step against the plain PyTorch loop a user would write.

One device: a nanoGPT-style loop written here by hand (its own model classes, AdamW fused
on CUDA and PyTorch's default on CPU, a loop over the parameters, where meshyard fuses the
step (--fused-plain gives the plain loop the fused step there too), bf16 autocast on CUDA,
torch.compile of the model, clipping at 1.0, ``loss.item()`` each step, random batches
already on the device) and ``meshyard.run`` of a GPT of the same
shape (random data, no parallelism, ``train.compile`` as --compile). They alternate for
--rounds rounds, taking turns to go first, so drift on the machine hits both; each run is a
fresh process, so neither inherits the other's threads, allocator state or compiled code.

Both are timed in wall time over the steady steps, after --warmup steps (which include
compilation): the plain loop with perf_counter and a device synchronize, meshyard from its
records' ``time`` field. The figure is meshyard tokens/s / plain tokens/s, the median of the
per-round ratios; MFU uses meshyard's FLOPs per token and the datasheet peak (CUDA) or a
measured fp32 matmul peak (CPU). "first steps" is the warmup's time in the first round;
the contender that goes second there finds the compiler's caches warm, so read it as a
rough figure. On CUDA the result is written to benchmarks/results/gpu-<date>.json; on CPU
only with --out. On a CPU shared with other work, --threads 1 gives steadier figures.

With --fsdp a third contender runs each round: the same meshyard job under
``parallel.strategy = "fsdp"`` on the one device, so what sharding costs where there is
nothing to shard is measured beside ``none`` (target: within 3%). With --tuned another
runs ``none`` with ``train.compile_tuning = true``: what tuning the compiled kernels gains;
with --fused-loss another with ``train.fused_linear_loss = true``: what fusing the head and
the loss gains in tokens/s and in peak memory (on CPU the process's peak resident size);
with --graphs the plain loop again, compiled with mode 'reduce-overhead': what replaying
the compiled step as CUDA graphs gains (on CPU nothing is graphed), and on CUDA meshyard
with ``train.cuda_graphs = true``: what the trainer gains from them.
With --profile each meshyard contender also records two of its warmup steps with
torch.profiler (``metrics.profile_steps``) and the script prints their operator and kernel
tables (device time first on CUDA) after the figures: where the trainer's step goes.

    python benchmarks/gpu_step.py [--rounds 4] [--steps 30] [--warmup 10] [--no-compile] [--fsdp] [--tuned]
        [--fused-loss] [--graphs] [--profile]
        [--model gpt2-124m] [--seq-len 1024] [--batch 16] [--vocab 50304] [--out PATH]
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import gc
import json
import math
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

import meshyard
from meshyard.config.load import load_config
from meshyard.metrics.throughput import catalog_peak, measured_cpu_peak, training_flops_per_token
from meshyard.models.gpt import GPT as MeshyardGPT
from meshyard.models.gpt import GPT_PRESETS, GPTShape
from meshyard.run_dir import RunDir

# Defaults per device: GPT-2 small at its real size on a GPU, a toy that a 2-core CPU runs
# in seconds elsewhere.
DEFAULTS = {
    "cuda": {"model": "gpt2-124m", "seq_len": 1024, "batch": 16, "vocab": 50304, "steps": 30, "warmup": 10},
    "cpu": {"model": "gpt-mini", "seq_len": 64, "batch": 8, "vocab": 256, "steps": 30, "warmup": 5},
}
SEED = 1234


# --- the plain loop's model, nanoGPT style ------------------------------------------------
class CausalSelfAttention(nn.Module):
    def __init__(self, d_model: int, n_head: int) -> None:
        super().__init__()
        self.n_head = n_head
        self.c_attn = nn.Linear(d_model, 3 * d_model)
        self.c_proj = nn.Linear(d_model, d_model)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, T, C = x.shape
        q, k, v = self.c_attn(x).split(C, dim=2)
        q, k, v = (t.view(B, T, self.n_head, C // self.n_head).transpose(1, 2) for t in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.c_proj(y.transpose(1, 2).contiguous().view(B, T, C))


class MLP(nn.Module):
    def __init__(self, d_model: int) -> None:
        super().__init__()
        self.c_fc = nn.Linear(d_model, 4 * d_model)
        self.gelu = nn.GELU(approximate="tanh")  # GPT-2's GELU, as meshyard's GPT computes it
        self.c_proj = nn.Linear(4 * d_model, d_model)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.c_proj(self.gelu(self.c_fc(x)))


class Block(nn.Module):
    def __init__(self, d_model: int, n_head: int) -> None:
        super().__init__()
        self.ln_1, self.attn = nn.LayerNorm(d_model), CausalSelfAttention(d_model, n_head)
        self.ln_2, self.mlp = nn.LayerNorm(d_model), MLP(d_model)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


class GPT(nn.Module):
    def __init__(self, vocab: int, seq_len: int, n_layer: int, n_head: int, d_model: int) -> None:
        super().__init__()
        self.wte, self.wpe = nn.Embedding(vocab, d_model), nn.Embedding(seq_len, d_model)
        self.h = nn.ModuleList(Block(d_model, n_head) for _ in range(n_layer))
        self.ln_f = nn.LayerNorm(d_model)
        self.lm_head = nn.Linear(d_model, vocab, bias=False)
        self.wte.weight = self.lm_head.weight  # weight tying
        for name, p in self.named_parameters():
            if name.endswith("c_proj.weight"):
                nn.init.normal_(p, 0.0, 0.02 / math.sqrt(2 * n_layer))
            elif p.dim() >= 2:
                nn.init.normal_(p, 0.0, 0.02)
            elif name.endswith("bias"):
                nn.init.zeros_(p)

    def forward(self, idx: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        # As in nanoGPT the loss is computed inside forward, so torch.compile of the model
        # covers it (without that, F.cross_entropy of bf16 logits makes an fp32 copy).
        pos = torch.arange(idx.shape[1], device=idx.device)
        x = self.wte(idx) + self.wpe(pos)
        for block in self.h:
            x = block(x)
        logits = self.lm_head(self.ln_f(x))
        return F.cross_entropy(logits.view(-1, logits.size(-1)), targets.reshape(-1))


@dataclass
class Outcome:
    tokens_per_s: float
    first_steps_s: float  # the warmup steps, compilation included
    peak_memory_bytes: int | None
    profile: str | None = None  # with --profile: meshyard's operator and kernel table of two warmup steps


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def start_memory(device: torch.device) -> None:
    """Free what the previous contender left and start its peak afresh."""
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(device)


def peak_memory(device: torch.device) -> int:
    """The contender's peak: CUDA memory allocated, or on CPU the process's peak resident
    size (each contender is a fresh process, so the figures compare)."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device)
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # KiB on Linux


def plain_run(args: argparse.Namespace, device: torch.device, reference_params: int,
              compile_mode: str = "default") -> Outcome:
    """The hand-written loop; wall time over the steady steps. ``compile_mode``
    'reduce-overhead' replays the compiled forward and backward as CUDA graphs."""
    start_memory(device)
    torch.manual_seed(SEED)
    shape = GPT_PRESETS[args.model]
    model = GPT(args.vocab, args.seq_len, shape["n_layer"], shape["n_head"], shape["d_model"]).to(device)
    n_params = sum(p.numel() for p in model.parameters())
    if n_params != reference_params:  # the two contenders must train the same shape
        raise SystemExit(f"plain model has {n_params} parameters, meshyard's GPT {reference_params}")
    params = [p for p in model.parameters() if p.requires_grad]
    groups = [{"params": [p for p in params if p.dim() >= 2], "weight_decay": 0.1},
              {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0}]
    cuda = device.type == "cuda"
    fused = cuda or args.fused_plain
    optimizer = torch.optim.AdamW(groups, lr=6e-4, betas=(0.9, 0.95), **({"fused": True} if fused else {}))
    forward = torch.compile(model, mode=compile_mode) if args.compile else model
    data = torch.randint(0, args.vocab, (args.steps, args.batch, args.seq_len + 1), device=device)
    inputs, targets = data[..., :-1].contiguous(), data[..., 1:].contiguous()

    def step(i: int) -> None:
        context = torch.autocast("cuda", dtype=torch.bfloat16) if cuda else contextlib.nullcontext()
        with context:
            loss = forward(inputs[i], targets[i])
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        loss.item()  # what users do each step, to log it

    synchronize(device)
    begin = time.perf_counter()
    for i in range(args.warmup):
        step(i)
    synchronize(device)
    steady = time.perf_counter()
    for i in range(args.warmup, args.steps):
        step(i)
    synchronize(device)
    end = time.perf_counter()
    tokens = (args.steps - args.warmup) * args.batch * args.seq_len
    return Outcome(tokens / (end - steady), steady - begin, peak_memory(device))


def meshyard_overrides(args: argparse.Namespace, device: torch.device, run_dir: Path, strategy: str) -> list[str]:
    # Enough random tokens that the measured steps never cross an epoch boundary.
    windows = math.ceil(args.steps * args.batch / 0.98) + 2
    random_tokens = max(1_048_576, windows * args.seq_len + 1)
    return [
        f"--model.name={args.model}", f"--model.vocab_size={args.vocab}", "--data.source=random",
        f"--data.vocab_size={args.vocab}", f"--data.random_tokens={random_tokens}", f"--data.seq_len={args.seq_len}",
        f"--data.cache_dir={run_dir.parent / 'cache'}", f"--parallel.strategy={strategy}",
        f"--train.compile={'true' if args.compile else 'false'}",
        f"--precision.dtype={'bf16' if device.type == 'cuda' else 'fp32'}", f"--run.device={device.type}",
        # meshyard limits a CPU rank to 1 thread by default; the plain loop uses the same count.
        f"--run.threads_per_rank={args.threads}",
        f"--train.steps={args.steps}", f"--train.global_batch={args.batch}", f"--train.micro_batch={args.batch}",
        "--train.grad_clip=1.0", "--train.eval_every=0", "--checkpoint.enabled=false",
        "--metrics.progress_bar=false", f"--metrics.log_every={10 ** 6}", f"--run.run_dir={run_dir}",
    ]


def meshyard_run(args: argparse.Namespace, device: torch.device, run_dir: Path, strategy: str,
                 extra: list[str]) -> Outcome:
    """``meshyard.run`` in this process; wall time between its records' ``time`` stamps."""
    start_memory(device)
    # Two steps late in the warmup, after compilation and before the timed steps.
    profiled = [f"--metrics.profile_steps=[{args.warmup - 2}, {args.warmup - 1}]"] if args.profile else []
    result = meshyard.run(load_config(None, meshyard_overrides(args, device, run_dir, strategy) + extra + profiled),
                          nproc=1)
    records = result.metrics()
    if len(records) != args.steps:
        raise SystemExit(f"meshyard recorded {len(records)} steps, expected {args.steps} ({result.run_dir})")
    # records[warmup - 1] is stamped as the last warmup step ends: from there to the last
    # record is the same (steps - warmup) steps the plain loop times.
    seconds = records[-1]["time"] - records[args.warmup - 1]["time"]
    tokens = (args.steps - args.warmup) * args.batch * args.seq_len
    first = sum(r["step_time_s"] for r in records[: args.warmup])
    table = RunDir(result.run_dir).profile / "rank-0.txt"
    return Outcome(tokens / seconds, first, peak_memory(device), table.read_text() if args.profile else None)


# Contender name -> meshyard's parallel.strategy (None: the plain loop) and further overrides
# (for the plain loop: its torch.compile mode).
CONTENDERS: dict[str, tuple[str | None, list[str]]] = {
    "plain": (None, ["default"]), "graphs": (None, ["reduce-overhead"]), "meshyard": ("none", []), "fsdp": ("fsdp", []),
    "tuned": ("none", ["--train.compile_tuning=true"]),
    "fused": ("none", ["--train.fused_linear_loss=true"]),
    "graphed": ("none", ["--train.cuda_graphs=true"]),
}


def parse_args() -> tuple[argparse.Namespace, torch.device]:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", choices=["auto", "cpu", "cuda"], default="auto")
    parser.add_argument("--model", choices=sorted(GPT_PRESETS), help="meshyard GPT preset")
    parser.add_argument("--seq-len", type=int)
    parser.add_argument("--batch", type=int, help="samples per step (global = micro batch)")
    parser.add_argument("--vocab", type=int)
    parser.add_argument("--steps", type=int, help="steps per contender per round, warmup included")
    parser.add_argument("--warmup", type=int, help="first steps left out of the timing (compilation)")
    # Even: each contender goes second as often as first (the second run of a round was
    # measured 5-10% slower on a shared 2-core machine, whichever it was).
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--compile", action=argparse.BooleanOptionalAction, default=True)
    parser.add_argument("--threads", type=int, default=torch.get_num_threads(),
                        help="CPU threads of both (default: torch's)")
    parser.add_argument("--fsdp", action="store_true", help="also time meshyard under strategy fsdp")
    parser.add_argument("--fused-plain", action="store_true",
                        help="on CPU, give the plain loop the fused AdamW step meshyard takes (PyTorch's default "
                             "there is a loop over the parameters): the ratio is then the framework's own cost")
    parser.add_argument("--tuned", action="store_true",
                        help="also time meshyard with train.compile_tuning = true (what kernel tuning gains)")
    parser.add_argument("--fused-loss", action="store_true",
                        help="also time meshyard with train.fused_linear_loss = true (the head and the loss fused)")
    parser.add_argument("--graphs", action="store_true",
                        help="also time the plain loop compiled with mode='reduce-overhead' (CUDA graphs): what "
                             "replaying the step as graphs would gain")
    parser.add_argument("--profile", action="store_true",
                        help="print each meshyard contender's torch.profiler table of two warmup steps (round 1)")
    parser.add_argument("--out", type=Path, help="JSON result (default on CUDA: benchmarks/results/gpu-<date>.json)")
    # Internal: each contender's run is a fresh process, so neither inherits the other's
    # threads, allocator or compiled code; the driver reads its outcome back.
    parser.add_argument("--contender", choices=CONTENDERS, help=argparse.SUPPRESS)
    parser.add_argument("--run-dir", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args()
    wanted = "cuda" if args.device == "auto" and torch.cuda.is_available() else args.device
    device = torch.device("cpu" if wanted == "auto" else wanted)
    for key, value in DEFAULTS[device.type].items():
        if getattr(args, key) is None:
            setattr(args, key, value)
    if not 1 <= args.warmup < args.steps:
        parser.error("--warmup must be at least 1 and below --steps")
    if args.graphs and not args.compile:
        parser.error("--graphs replays the compiled step as CUDA graphs: it needs --compile")
    if args.profile and args.warmup < 3:
        parser.error("--profile records two warmup steps after the first: give --warmup 3 or more")
    return args, device


OUTCOME_PREFIX = "gpu_step outcome: "


def fresh_run(name: str, run_dir: Path) -> Outcome:
    """One contender's run in a new process with this command's options."""
    argv = [sys.executable, str(Path(__file__).resolve()), *sys.argv[1:], "--contender", name, "--run-dir",
            str(run_dir)]
    proc = subprocess.run(argv, capture_output=True, text=True)
    lines = [line for line in proc.stdout.splitlines() if line.startswith(OUTCOME_PREFIX)]
    if proc.returncode != 0 or not lines:
        tail = "\n".join((proc.stdout + proc.stderr).splitlines()[-30:])
        raise SystemExit(f"gpu_step: the {name} run failed (exit code {proc.returncode}):\n{tail}")
    return Outcome(**json.loads(lines[-1].removeprefix(OUTCOME_PREFIX)))


def main() -> None:
    args, device = parse_args()
    torch.set_num_threads(args.threads)
    cuda = device.type == "cuda"
    dtype = torch.bfloat16 if cuda else torch.float32
    preset = GPT_PRESETS[args.model]
    with torch.device("meta"):  # the FLOPs formula needs meshyard's GPT, not its memory
        reference = MeshyardGPT(GPTShape(args.vocab, args.seq_len, preset["n_layer"], preset["n_head"],
                                         preset["d_model"]))
    flops_per_token = training_flops_per_token(reference, args.seq_len)
    reference_params = sum(p.numel() for p in reference.parameters())
    peak = catalog_peak(torch.cuda.get_device_name(device), dtype) if cuda else measured_cpu_peak()
    device_name = torch.cuda.get_device_name(device) if cuda else f"CPU, {args.threads} threads"

    if args.contender is not None:
        strategy, extra = CONTENDERS[args.contender]
        outcome = (plain_run(args, device, reference_params, *extra) if strategy is None
                   else meshyard_run(args, device, args.run_dir, strategy, extra))
        print(OUTCOME_PREFIX + json.dumps(asdict(outcome)), flush=True)
        return

    graphed = args.graphs and cuda  # train.cuda_graphs needs a CUDA device
    names = (["plain", "meshyard"] + ["fsdp"] * args.fsdp + ["tuned"] * args.tuned + ["fused"] * args.fused_loss
             + ["graphs"] * args.graphs + ["graphed"] * graphed)
    runs: dict[str, list[Outcome]] = {name: [] for name in names}
    with tempfile.TemporaryDirectory() as workdir:
        for round_index in range(args.rounds):
            order = names if round_index % 2 == 0 else names[::-1]
            for name in order:
                runs[name].append(fresh_run(name, Path(workdir) / f"{name}{round_index}"))
            plain_tps = runs["plain"][-1].tokens_per_s
            figures = ", ".join(f"{name} {runs[name][-1].tokens_per_s:,.0f} tok/s" for name in names)
            print(f"round {round_index + 1} ({order[0]} first): {figures}, ratio "
                  f"{runs['meshyard'][-1].tokens_per_s / plain_tps:.4f}", flush=True)

    def median_ratio(name: str, baseline: str) -> float:
        return statistics.median(o.tokens_per_s / b.tokens_per_s for b, o in zip(runs[baseline], runs[name]))

    ratio = median_ratio("meshyard", "plain")
    summary = {}
    for name, outcomes in runs.items():
        tps = statistics.median(o.tokens_per_s for o in outcomes)
        memory = max((o.peak_memory_bytes for o in outcomes if o.peak_memory_bytes is not None), default=None)
        summary[name] = {"tokens_per_s": tps, "mfu": tps * flops_per_token / peak if peak else None,
                         "vs_baseline": 1.0 if name == "plain" else median_ratio(name, "plain"),
                         "peak_memory_bytes": memory,
                         "compile_s": outcomes[0].first_steps_s,  # the first round's: cold compile caches
                         "rounds": [asdict(o) for o in outcomes]}

    print(f"\n{device_name}, torch {torch.__version__}: {args.model} (vocab {args.vocab}), batch {args.batch} x "
          f"{args.seq_len} tokens, {str(dtype).removeprefix('torch.')}, compile {'on' if args.compile else 'off'}; "
          f"{args.rounds} rounds x {args.steps - args.warmup} timed steps after {args.warmup} warmup; "
          f"plain AdamW {'fused' if cuda or args.fused_plain else 'a loop over the parameters'}")
    print(f"{'loop':<10}{'tokens/s':>14}{'MFU':>8}{'peak mem':>11}{'first steps':>13}  (warmup, round 1)")
    for name, row in summary.items():
        mfu = f"{row['mfu']:.1%}" if row["mfu"] is not None else "n/a"
        memory = f"{row['peak_memory_bytes'] / 2**30:.2f} GiB" if row["peak_memory_bytes"] is not None else "n/a"
        print(f"{name:<10}{row['tokens_per_s']:>14,.0f}{mfu:>8}{memory:>11}{row['compile_s']:>12.2f}s")
    peak_text = f"{peak / 1e12:.1f} TFLOP/s {'datasheet' if cuda else 'measured fp32 matmul'}" if peak else "unknown"
    print(f"FLOPs per token {flops_per_token / 1e6:.1f} M; peak {peak_text}")
    print(f"ratio meshyard / plain tokens/s (median of rounds): {ratio:.4f}")
    fsdp_vs_none = median_ratio("fsdp", "meshyard") if args.fsdp else None
    if fsdp_vs_none is not None:
        print(f"ratio fsdp / none tokens/s (median of rounds): {fsdp_vs_none:.4f} (target: >= 0.97)")
    tuned_vs_untuned = median_ratio("tuned", "meshyard") if args.tuned else None
    if tuned_vs_untuned is not None:
        print(f"ratio compile_tuning true / false tokens/s (median of rounds): {tuned_vs_untuned:.4f}")
    fused_vs_logits = median_ratio("fused", "meshyard") if args.fused_loss else None
    if fused_vs_logits is not None:
        memory_ratio = summary["fused"]["peak_memory_bytes"] / summary["meshyard"]["peak_memory_bytes"]
        print(f"ratio fused_linear_loss true / false: tokens/s {fused_vs_logits:.4f} (median of rounds), peak memory "
              f"{memory_ratio:.3f}")
    graphs_vs_plain = median_ratio("graphs", "plain") if args.graphs else None
    if graphs_vs_plain is not None:
        print(f"ratio plain with CUDA graphs / plain tokens/s (median of rounds): {graphs_vs_plain:.4f}")
    graphed_vs_meshyard = median_ratio("graphed", "meshyard") if graphed else None
    if graphed_vs_meshyard is not None:
        graphed_mfu = summary["graphed"]["mfu"]
        print(f"ratio train.cuda_graphs true / false tokens/s (median of rounds): {graphed_vs_meshyard:.4f}; "
              f"with graphs / plain {median_ratio('graphed', 'plain'):.4f}, MFU "
              f"{'n/a' if graphed_mfu is None else f'{graphed_mfu:.1%}'}")
    mfu = summary["meshyard"]["mfu"]
    if cuda:
        met = ratio >= 1.0 and mfu is not None and mfu >= 0.40
        print(f"verdict: {'met' if met else 'NOT met'} (targets on CUDA: ratio >= 1.0 and MFU >= 40%"
              f"{'; MFU unknown for this GPU' if mfu is None else ''})")
    else:
        met = ratio >= 0.98
        # The target is set against the loop a user writes, with PyTorch's default step.
        against = "; measured against a plain loop given the fused step (--fused-plain)" if args.fused_plain else ""
        print(f"verdict: {'met' if met else 'NOT met'} (target on CPU: ratio >= 0.98{against})")

    out = args.out or (Path(__file__).parent / "results" / f"gpu-{datetime.date.today().isoformat()}.json"
                       if cuda else None)
    if out is not None:
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps({
            "device": device_name, "torch": torch.__version__,
            "config": {"model": args.model, "seq_len": args.seq_len, "batch": args.batch, "vocab": args.vocab,
                       "dtype": str(dtype).removeprefix("torch."), "compile": args.compile, "steps": args.steps,
                       "warmup": args.warmup, "rounds": args.rounds, "threads": args.threads if not cuda else None,
                       "plain_adamw_fused": cuda or args.fused_plain},
            "flops_per_token": flops_per_token, "peak_flops": peak, "vs_baseline": ratio, "targets_met": met,
            "fsdp_vs_none": fsdp_vs_none, "tuned_vs_untuned": tuned_vs_untuned, "fused_vs_logits": fused_vs_logits,
            "graphs_vs_plain": graphs_vs_plain, "graphed_vs_meshyard": graphed_vs_meshyard,
            "contenders": summary,
        }, indent=2) + "\n")
        print(f"wrote {out}")
    for name in names:
        if runs[name][0].profile:
            print(f"\n{name}, round 1: {runs[name][0].profile}")


if __name__ == "__main__":
    main()
