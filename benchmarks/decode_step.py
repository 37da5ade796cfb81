"""What one decoding step of the KV-cache path costs, and how much of it is the model's
matrix work: the rest is host work (bookkeeping, masks, tensor building, sampling) that a
fast step keeps small.

For each row count (default 1, 4, 16 and 32), a cache holds that many sequences, each
prefilled with a prompt of ``--prompt`` tokens (lengths staggered by a few tokens, as in
a server's running batch), and one step is what the continuous batcher does per step:
``decode_step`` over every row, then the next token of each row (greedy) back on the host.
Printed per row count:

- step: the time of one such step (the lowest median of five blocks of steps). On CUDA that
  is the continuous scheduler's step over every slot of its long-lived cache, replayed from
  a CUDA graph; ``grouped`` is then also printed: the step of a cache made for one call
  (what a dynamic batch decodes with), which groups the rows by span and launches eagerly;
- matrix: the time, measured alike, of the same model's matrix work alone on prebuilt tensors (every
  linear layer on ``rows`` tokens and attention over the step's mean cached span, no cache
  bookkeeping, no sampling): what the step cannot go below in eager PyTorch;
- overhead = step - matrix.

Defaults: on the CPU a small meshyard preset (gpt-mini, vocabulary 256, 32-token prompts,
float32); on CUDA gpt2-124m (vocabulary 50304) in bf16 with 128-token prompts.
``--out FILE`` writes the figures as JSON; ``--baseline FILE`` (such a file, written by an
earlier implementation) prints each overhead against it.

    python benchmarks/decode_step.py [--device auto] [--model gpt-mini] [--rows 1,4,16,32]
        [--steps 200] [--threads 2] [--out FILE] [--baseline FILE] [--profile PREFIX]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch
import torch.nn.functional as F

from meshyard.inference.decoding import decode_step
from meshyard.inference.sampling import Sampling, next_tokens
from meshyard.models.gpt import GPT, GPT_PRESETS, GPTShape

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def build(model: str, vocab: int, context: int, device: torch.device, dtype: torch.dtype) -> GPT:
    shape = GPTShape(vocab_size=vocab, context_length=context, **GPT_PRESETS[model])
    with torch.device(device):
        return GPT(shape).to(dtype).eval()


def timed(fn, steps: int, device: torch.device, blocks: int = 5) -> float:
    """Seconds of one ``fn`` call: the lowest median of ``blocks`` blocks of calls (after a few
    unmeasured ones), so that a burst of load from other processes on the machine does not count."""
    for _ in range(5):
        fn()
    medians = []
    for _ in range(blocks):
        times = []
        for _ in range(max(1, steps // blocks)):
            if device.type == "cuda":
                torch.cuda.synchronize()
            started = time.perf_counter()
            fn()
            if device.type == "cuda":
                torch.cuda.synchronize()
            times.append(time.perf_counter() - started)
        medians.append(statistics.median(times))
    return min(medians)


def step_seconds(module: GPT, rows: int, prompt: int, steps: int, device: torch.device,
                 profile: Path | None = None, grouped: bool = False) -> float:
    """One decoding step over ``rows`` prefilled slots, tokens chosen greedily to the host.
    With ``profile``, ten more steps run under torch.profiler afterwards (see ``profiled``).
    ``grouped``: the grouped step, as a cache made for one call takes (on the CPU every
    cache does)."""
    total = prompt + rows + steps + 16
    cache = module.init_kv_cache(rows, total)
    if grouped:
        cache.every_slot_steps = False
    slots = [cache.allocate() for _ in range(rows)]
    for slot in slots:  # staggered lengths: prompt, prompt + 1, ...
        length = prompt + slot % 8
        module(torch.zeros(1, length, dtype=torch.long, device=device), cache=cache, slots=[slot], positions=[0])
    sampling = [Sampling(max_new_tokens=steps + 16)] * rows
    generators = [None] * rows
    tokens = [1] * rows
    vocab = module.shape.vocab_size

    def step() -> None:
        nonlocal tokens
        logits = decode_step(module, cache, slots, tokens)
        tokens = next_tokens(logits, sampling, generators, vocab).tolist()

    with torch.inference_mode():
        seconds = timed(step, steps, device)
        if profile is not None:
            profiled(step, device, profile)
        return seconds


def profiled(step, device: torch.device, trace: Path) -> None:
    """Ten steps under torch.profiler: prints the operators by host time and (on CUDA) by
    device time, and writes a Chrome trace to ``trace``: where a step's time goes when it is
    far above its matrix work."""
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    with profile(activities=activities) as run:
        for _ in range(10):
            step()
        if device.type == "cuda":
            torch.cuda.synchronize()
    table = run.key_averages()
    print(table.table(sort_by="self_cpu_time_total", row_limit=25, max_name_column_width=60))
    if device.type == "cuda":
        print(table.table(sort_by="self_device_time_total", row_limit=15, max_name_column_width=60))
    run.export_chrome_trace(str(trace))
    print(f"trace of 10 steps: {trace}")


def matrix_seconds(module: GPT, rows: int, prompt: int, steps: int, device: torch.device) -> float:
    """The same step's matrix work alone on prebuilt tensors: every linear layer on ``rows``
    tokens, attention of one query per row over its cached span, the output head."""
    shape, dtype = module.shape, module.tok_emb.weight.dtype
    span = prompt + 4 + 5 + steps // 2  # the mean span the step's rows attend over (they grow by one per step)
    x = torch.randn(rows, 1, shape.d_model, device=device, dtype=dtype)
    keys = torch.randn(rows, shape.n_head, span, shape.head_dim, device=device, dtype=dtype)

    def forward() -> None:
        h = x
        for block in module.blocks:
            q = block.attn.qkv(h)[..., : shape.d_model].view(rows, 1, shape.n_head, -1).transpose(1, 2)
            y = F.scaled_dot_product_attention(q, keys, keys).transpose(1, 2).reshape(rows, 1, -1)
            h = block.attn.proj(y)
            h = block.mlp.proj(block.mlp.fc(h))
        module.lm_head(h)

    with torch.inference_mode():
        return timed(forward, steps, device)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="auto", help="auto (CUDA when present), cpu, cuda or cuda:N")
    parser.add_argument("--model", help="GPT preset (default gpt-mini on CPU, gpt2-124m on CUDA)")
    parser.add_argument("--dtype", choices=sorted(DTYPES), help="default fp32 on CPU, bf16 on CUDA")
    parser.add_argument("--vocab", type=int, help="vocabulary (default 256 on CPU, 50304 on CUDA)")
    parser.add_argument("--prompt", type=int, help="prompt tokens per row (default 32 on CPU, 128 on CUDA)")
    parser.add_argument("--rows", default="1,4,16,32")
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--threads", type=int, default=0, help="torch threads on the CPU (0: torch's default)")
    parser.add_argument("--label", default="", help="what was measured (kept in --out)")
    parser.add_argument("--out", help="write the figures as JSON here")
    parser.add_argument("--baseline", help="a JSON file of an earlier run: print overheads against it")
    parser.add_argument("--profile", help="also profile ten steps per row count: operator tables on stdout, "
                        "Chrome traces at PROFILE-rows<N>.json")
    args = parser.parse_args()
    if args.device == "auto":
        args.device = "cuda" if torch.cuda.is_available() else "cpu"
    device = torch.device(args.device)
    cuda = device.type == "cuda"
    model = args.model or ("gpt2-124m" if cuda else "gpt-mini")
    dtype = DTYPES[args.dtype or ("bf16" if cuda else "fp32")]
    vocab = args.vocab or (50304 if cuda else 256)
    prompt = args.prompt or (128 if cuda else 32)
    if args.threads:
        torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    module = build(model, vocab, max(1024, prompt + args.steps + 64), device, dtype)
    name = torch.cuda.get_device_name(device) if cuda else f"CPU, {torch.get_num_threads()} threads"
    print(f"{model} vocab {vocab} {str(dtype).removeprefix('torch.')} on {name}, {prompt}-token prompts, "
          f"{args.steps} steps per row count")
    baseline = {r["rows"]: r for r in json.loads(Path(args.baseline).read_text())["results"]} if args.baseline else {}
    results = []
    for rows in [int(r) for r in args.rows.split(",")]:
        trace = Path(f"{args.profile}-rows{rows}.json") if args.profile else None
        step = step_seconds(module, rows, prompt, args.steps, device, trace)
        matrix = matrix_seconds(module, rows, prompt, args.steps, device)
        result = {"rows": rows, "step_ms": step * 1e3, "matrix_ms": matrix * 1e3, "overhead_ms": (step - matrix) * 1e3}
        if cuda:
            result["grouped_ms"] = step_seconds(module, rows, prompt, args.steps, device, grouped=True) * 1e3
        results.append(result)
        line = (f"rows {rows:3d}: step {result['step_ms']:7.3f} ms  matrix {result['matrix_ms']:7.3f} ms  "
                f"overhead {result['overhead_ms']:7.3f} ms")
        if cuda:
            line += f"  grouped {result['grouped_ms']:7.3f} ms"
        if rows in baseline:
            before = baseline[rows]
            line += (f"  | before: step {before['step_ms']:7.3f} ms overhead {before['overhead_ms']:7.3f} ms "
                     f"(overhead x{result['overhead_ms'] / max(before['overhead_ms'], 1e-9):.2f})")
        print(line, flush=True)
    if args.out:
        Path(args.out).write_text(json.dumps({"label": args.label, "model": model, "device": name, "vocab": vocab,
                                              "dtype": str(dtype), "prompt": prompt, "results": results}, indent=1))


if __name__ == "__main__":
    main()
