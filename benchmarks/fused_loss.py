"""The output head and the loss, fused (``train.fused_linear_loss``) against the logits
through the cross-entropy: peak memory and time of one forward and backward, side by side.

Both compute the mean next-token loss of ``--rows`` hidden states of width ``--width``
against a head of ``--vocab`` rows (GPT-2's by default) and its gradients: the unfused way
as the trainer does without the setting (``F.linear``, then ``next_token_loss``), the fused
way with ``linear_cross_entropy``. They alternate for --rounds rounds in one process, on
the same inputs. On CUDA: bf16 autocast and, with --compile, each wrapped in
torch.compile; memory is the allocator's peak above what the inputs hold
(``max_memory_allocated``). On CPU: fp32, and memory is the peak of c10's CPU allocator
above the inputs, read from torch.profiler's allocation events as ``meshyard plan``'s
measurements are (``meshyard.plan.measure``), in a round of its own after the timed ones
(the profiler slows what it watches).

    python benchmarks/fused_loss.py [--rows 4096] [--width 768] [--vocab 50304] [--rounds 5] [--compile]

Prints each variant's median time and peak, and the ratios fused / unfused.
"""

from __future__ import annotations

import argparse
import statistics
import time
from typing import Callable

import torch
import torch.nn.functional as F

from meshyard.models.linear_cross_entropy import linear_cross_entropy
from meshyard.plan.measure import measure_call_peak
from meshyard.train.loss import next_token_loss


def unfused(hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return next_token_loss(F.linear(hidden, weight), targets)


def fused(hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return linear_cross_entropy(hidden, weight, targets)


def step(loss_fn: Callable[..., torch.Tensor], inputs: tuple[torch.Tensor, ...], device: torch.device) -> None:
    """One forward and backward under the device's precision; the gradients are dropped after."""
    hidden, weight, _ = inputs
    with torch.autocast(device.type, dtype=torch.bfloat16, enabled=device.type == "cuda"):
        loss = loss_fn(*inputs)
    loss.backward()
    hidden.grad = weight.grad = None


def seconds(loss_fn: Callable[..., torch.Tensor], inputs: tuple[torch.Tensor, ...], device: torch.device) -> float:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    start = time.perf_counter()
    step(loss_fn, inputs, device)
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return time.perf_counter() - start


def peak_bytes(loss_fn: Callable[..., torch.Tensor], inputs: tuple[torch.Tensor, ...], device: torch.device) -> int:
    """The allocator's peak during one step, above what was live before it."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        before = torch.cuda.memory_allocated(device)
        torch.cuda.reset_peak_memory_stats(device)
        step(loss_fn, inputs, device)
        return torch.cuda.max_memory_allocated(device) - before
    return measure_call_peak(lambda: step(loss_fn, inputs, device))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", choices=["auto", "cpu", "cuda"], default="auto")
    parser.add_argument("--rows", type=int, help="tokens (default: 4096 on CPU, 16 x 1024 on CUDA)")
    parser.add_argument("--width", type=int, default=768)
    parser.add_argument("--vocab", type=int, default=50304)
    parser.add_argument("--rounds", type=int, default=5, help="timed rounds, after one warmup round")
    parser.add_argument("--compile", action="store_true", help="torch.compile both (CUDA)")
    args = parser.parse_args()
    device = torch.device("cuda" if args.device == "auto" and torch.cuda.is_available()
                          else "cpu" if args.device == "auto" else args.device)
    rows = args.rows or (16 * 1024 if device.type == "cuda" else 4096)
    generator = torch.Generator(device).manual_seed(0)
    inputs = (torch.randn(rows, args.width, device=device, generator=generator).requires_grad_(),
              (0.02 * torch.randn(args.vocab, args.width, device=device, generator=generator)).requires_grad_(),
              torch.randint(0, args.vocab, (rows,), device=device, generator=generator))
    variants = {"unfused": unfused, "fused": fused}
    if args.compile:
        variants = {name: torch.compile(fn, fullgraph=True) for name, fn in variants.items()}
    for fn in variants.values():
        step(fn, inputs, device)  # warmup (compilation, allocator caches)
    times: dict[str, list[float]] = {name: [] for name in variants}
    for round_index in range(args.rounds):
        order = list(variants) if round_index % 2 == 0 else list(variants)[::-1]
        for name in order:
            times[name].append(seconds(variants[name], inputs, device))
    peaks = {name: peak_bytes(fn, inputs, device) for name, fn in variants.items()}

    dtype = "bf16 autocast" if device.type == "cuda" else "fp32"
    print(f"{torch.cuda.get_device_name(device) if device.type == 'cuda' else 'CPU'}, torch {torch.__version__}: "
          f"{rows} rows x width {args.width} -> vocabulary {args.vocab}, {dtype}, "
          f"compile {'on' if args.compile else 'off'}, {args.rounds} rounds")
    logits = rows * args.vocab * (2 if device.type == "cuda" else 4)
    print(f"(the logits alone: {logits / 2**20:,.0f} MiB)")
    for name in variants:
        print(f"{name:<9} forward+backward {statistics.median(times[name]) * 1e3:9.1f} ms   peak "
              f"{peaks[name] / 2**20:9,.0f} MiB")
    time_ratio = statistics.median(f / u for f, u in zip(times["fused"], times["unfused"]))
    memory_ratio = peaks["fused"] / peaks["unfused"]
    print(f"fused / unfused: time {time_ratio:.3f} (median of rounds), peak memory {memory_ratio:.3f}")


if __name__ == "__main__":
    main()
