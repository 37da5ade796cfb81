"""Training step time of a mixture-of-experts GPT against a dense GPT with the same active
parameters, printed as a ratio.

The MoE model has ``--experts`` experts per block, each as wide as a dense feed-forward
of ratio 4, and routes each token to ``--top-k`` of them; the dense model's feed-forward
is ``--top-k`` times as wide (mlp_ratio = 4 x top_k), so a token passes through the same
number of weights in both (the router's d_model x experts aside) and the model FLOPs per
token match. Both train the same batches with AdamW, the MoE one with its router losses;
rounds alternate between the models (one thread, so that the other's warm caches or the
machine's load affect both alike) and the median and spread of each are reported.

What the ratio shows on a CPU: the price of routing (top-k, sorting and gathering the
tokens, one matmul per expert instead of one for all, the scatter back) for the same
FLOPs, and the optimizer's work on all the experts' weights (it updates every expert).

    python benchmarks/moe.py [--experts 8] [--top-k 2] [--d-model 256] [--layers 4] [--rounds 7]
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
import torch.nn.functional as F

from meshyard.models.flops import gpt_counts
from meshyard.models.gpt import GPT, GPTShape
from meshyard.models.moe import MoEShape
from meshyard.train.expert_load import ExpertLoad


def build(args: argparse.Namespace, moe: bool) -> tuple[GPT, GPTShape]:
    shape = GPTShape(vocab_size=args.vocab, context_length=args.seq_len, n_layer=args.layers, n_head=args.heads,
                     d_model=args.d_model, mlp_ratio=4 if moe else 4 * args.top_k, bias=False,
                     moe=MoEShape(args.experts, args.top_k) if moe else None)
    torch.manual_seed(0)
    return GPT(shape), shape


def steps(model: GPT, batches: list[torch.Tensor], vocab: int) -> float:
    """Seconds for one training step over each of ``batches`` (forward, backward, AdamW)."""
    load = ExpertLoad(model)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4, foreach=True)
    start = time.perf_counter()
    for tokens in batches:
        logits = model(tokens[:, :-1])
        loss = F.cross_entropy(logits.reshape(-1, vocab), tokens[:, 1:].reshape(-1))
        load.training_loss(loss).backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        load.take_step()
    return (time.perf_counter() - start) / len(batches)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--experts", type=int, default=8)
    parser.add_argument("--top-k", type=int, default=2)
    parser.add_argument("--d-model", type=int, default=256)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--seq-len", type=int, default=128)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--vocab", type=int, default=256)
    parser.add_argument("--steps", type=int, default=5, help="timed steps per round")
    parser.add_argument("--rounds", type=int, default=7)
    args = parser.parse_args()
    torch.set_num_threads(1)

    models = {name: build(args, name == "moe") for name in ("dense", "moe")}
    for name, (_, shape) in models.items():
        counts = gpt_counts(shape)
        print(f"{name:>5}: {counts.n_params / 1e6:.2f}M parameters, {counts.active_params / 1e6:.2f}M active "
              f"per token, {counts.matmul_params_per_layer / 1e6:.3f}M matmul weights per block")
    generator = torch.Generator().manual_seed(1)
    batches = [torch.randint(0, args.vocab, (args.batch, args.seq_len + 1), generator=generator)
               for _ in range(args.steps)]
    for model, _ in models.values():  # warm-up: allocator, kernels, optimizer state
        steps(model, batches[:1], args.vocab)
    times: dict[str, list[float]] = {name: [] for name in models}
    for _ in range(args.rounds):
        for name, (model, _) in models.items():
            times[name].append(steps(model, batches, args.vocab))
    ratios = [m / d for m, d in zip(times["moe"], times["dense"])]
    tokens = args.batch * args.seq_len
    for name, values in times.items():
        median = statistics.median(values)
        print(f"{name:>5}: {median * 1000:7.1f} ms/step (min {min(values) * 1000:.1f}, max {max(values) * 1000:.1f}), "
              f"{tokens / median:,.0f} tokens/s")
    print(f"moe / dense step time: {statistics.median(ratios):.2f}x (per-round ratios {min(ratios):.2f} to "
          f"{max(ratios):.2f} over {args.rounds} rounds; {args.experts} experts, top-{args.top_k}, "
          f"{args.batch} x {args.seq_len} tokens, d_model {args.d_model}, {args.layers} layers, 1 thread)")


if __name__ == "__main__":
    main()
