"""``meshyard plan``: will it fit, which layout, how will it scale. Parsing only; the
arithmetic lives in the library modules of ``meshyard.plan``."""

from __future__ import annotations

import argparse

from rich.console import Console

from meshyard.errors import call_command
from meshyard.hardware import GPUS, INTER_NODE_LINKS, CatalogError
from meshyard.plan.inputs import PlanInputError, PlanInputs, resolve_inputs
from meshyard.plan.layout import CONFIG_STRATEGIES, TRAINABLE_PRECISIONS
from meshyard.plan.report import (
    render_catalog, render_cluster, render_memory, render_model, render_plan, render_scale, render_settings,
    render_step,
)
from meshyard.plan.scale import plot_scale, simulate_scale
from meshyard.plan.search import plan
from meshyard.run_dir import RunDir


DESCRIPTION = """\
Estimate memory per device, rank parallel layouts and predict scaling before renting
GPUs. For a model (a GPT preset, a custom GPT size, your own builder, or a meshyard
config) and a cluster, every combination of data parallelism (ddp, zero1, fsdp2 =
ZeRO-2, fsdp3 = ZeRO-3, hsdp), tensor and pipeline degree (context- and expert-parallel
degrees too, where asked or where the model has experts), activation checkpointing,
CPU offload, the fused loss and micro-batch is estimated; the fastest that fits are
ranked, and each layout that does not fit says why. With --scale, one layout is
predicted across cluster sizes (table and PNG plot)."""

EPILOG = """\
examples:
  meshyard plan --model gpt2-124m --gpus 8
  meshyard plan --model gpt --n-layer 32 --n-head 32 --d-model 4096 --seq-len 4096 \\
      --gpus 64 --gpu h100 --gpu-memory 80GB --gpus-per-node 8 --interconnect ib-ndr-8x
  meshyard plan --config run.toml --gpus 16 --gpu a100 --interconnect eth-100g
  meshyard plan --model gpt2-124m --moe-experts 8 --moe-top-k 2 --gpus 8 --ep 1,2,8
  meshyard plan --model gpt2-124m --scale 8,64,512,4096 --strategy fsdp --out scale.png
  meshyard plan --model gpt2-124m --gpus 8 --tokens 10B --gpu-hour-price 2.5 --restarts runs/spot-1
  meshyard plan --list-hardware

Sizes: GB = 10^9 bytes, GiB = 2^30 bytes (a bare number is GB). The cost model and its
assumptions are described in docs/plan.md."""


def _add_arguments(p: argparse.ArgumentParser) -> None:
    _add_model_arguments(p)
    train = p.add_argument_group("training")
    train.add_argument("--seq-len", type=int, help="tokens per sample (default 1024)")
    train.add_argument("--global-batch", type=int, help="samples per optimizer step (default about 0.5M tokens)")
    train.add_argument("--precision", choices=TRAINABLE_PRECISIONS, help="fp32, bf16 (default: fp32 parameters, "
                       "bf16 compute) or fp16: the precisions meshyard trains in")
    train.add_argument("--optimizer", choices=("adamw", "sgd"), help="optimizer (default adamw)")
    hw = p.add_argument_group("hardware")
    hw.add_argument("--gpus", type=int, default=8, help="devices in the job (default 8)")
    hw.add_argument("--gpu", default="h100", help=f"GPU model: {', '.join(GPUS)} (default h100)")
    hw.add_argument("--gpu-memory", help="memory per GPU, e.g. 80GB or 80GiB (default: the catalog's)")
    hw.add_argument("--gpus-per-node", type=int, default=8, help="GPUs in one node (default 8)")
    hw.add_argument("--interconnect", default="ib-ndr-8x",
                    help=f"between nodes: {', '.join(INTER_NODE_LINKS)} (default ib-ndr-8x)")
    hw.add_argument("--intra-node", help="inside a node: nvlink3, nvlink4, pcie4, ... (default: the GPU's)")
    hw.add_argument("--peak-tflops", type=float, help="override the GPU's dense peak TFLOP/s")
    hw.add_argument("--intra-bw", help="override intra-node bandwidth per GPU, e.g. 450GB/s")
    hw.add_argument("--inter-bw", help="override inter-node bandwidth per node, e.g. 400GB/s")
    hw.add_argument("--efficiency", type=float, default=0.5, help="achievable fraction of peak FLOP/s (0.5)")
    hw.add_argument("--link-efficiency", type=float, default=0.8, help="achievable fraction of link bandwidth (0.8)")
    hw.add_argument("--overlap", type=float, default=0.9,
                    help="fraction of concurrent compute that hides communication (0.9)")
    hw.add_argument("--headroom", type=float, default=0.1,
                    help="fraction of GPU memory kept free for context, NCCL and fragmentation (0.1)")
    hw.add_argument("--list-hardware", action="store_true", help="print the GPU and interconnect catalog and exit")
    _add_cost_arguments(p)
    search = p.add_argument_group("layouts to consider (comma-separated lists; default: all)")
    search.add_argument("--strategy", help=f"data parallelism, as a config names it ({', '.join(CONFIG_STRATEGIES)}; "
                        "fsdp is ZeRO-3) or as the planner does (fsdp2 = ZeRO-2, fsdp3 = ZeRO-3, hsdp)")
    search.add_argument("--reshard-after-forward", choices=("true", "false"),
                        help="with --strategy fsdp, as parallel.reshard_after_forward: true (default) plans ZeRO-3 "
                             "(fsdp3), false ZeRO-2 (fsdp2)")
    search.add_argument("--tp", help="tensor-parallel degrees, e.g. 1,2,4")
    search.add_argument("--pp", help="pipeline-parallel degrees, e.g. 1,2")
    search.add_argument("--cp", help="context-parallel degrees, e.g. 1,2,4 (parallel.cp: each sequence split over "
                                     "cp ranks; default 1, since only long sequences need it)")
    search.add_argument("--ep", help="expert-parallel degrees, e.g. 1,2,8 (parallel.ep: a MoE model's experts split "
                                     "over ep of the sharded data-parallel ranks, tokens sent all-to-all; default: "
                                     "1 and every power of two that divides the experts)")
    search.add_argument("--micro-batch", help="micro-batch sizes (samples per rank per forward)")
    search.add_argument("--ac", help="activation checkpointing: none, selective (every other block), full")
    search.add_argument("--offload", choices=("auto", "on", "off"), default="auto",
                        help="CPU offload of sharded states with fsdp3/hsdp (default: try both)")
    search.add_argument("--fused-loss", choices=("auto", "on", "off"),
                        help="the output head and the loss computed together without whole logits "
                             "(train.fused_linear_loss; meshyard's GPT with tp = pp = 1). Default: try both, "
                             "or on where --config sets it")
    search.add_argument("--pp-schedule", choices=("1f1b", "gpipe", "interleaved"), default="1f1b")
    search.add_argument("--pp-virtual", type=int, default=1, help="model chunks per rank (interleaved)")
    search.add_argument("--no-sequence-parallel", action="store_true", help="TP without sequence parallelism")
    _add_output_arguments(p)


def _add_model_arguments(p: argparse.ArgumentParser) -> None:
    model = p.add_argument_group("model")
    model.add_argument("--config", help="meshyard TOML config: its [model], data.seq_len, train.global_batch, "
                                        "optim.name and precision.dtype become the defaults")
    model.add_argument("--model", help="gpt-tiny ... gpt2-124m, 'gpt' with --n-layer/--n-head/--d-model, 'mlp', "
                                       "or your builder as module:function / file.py:function (default gpt2-124m)")
    model.add_argument("--n-layer", type=int, help="blocks (custom GPT)")
    model.add_argument("--n-head", type=int, help="attention heads (custom GPT)")
    model.add_argument("--d-model", type=int, help="hidden width (custom GPT)")
    model.add_argument("--vocab-size", type=int, help="vocabulary (default 50257, the GPT-2 tokenizer's)")
    model.add_argument("--untied-embeddings", action="store_true", help="separate output head (default: tied)")
    model.add_argument("--moe-experts", type=int, help="routed experts in every block's mixture-of-experts "
                                                       "feed-forward (GPT; default 0: dense, or the config's)")
    model.add_argument("--moe-top-k", type=int, help="experts each token is routed to (default 2, or the config's)")
    model.add_argument("--moe-shared-experts", type=int, help="always-active experts (default 0, or the config's)")


def _add_output_arguments(p: argparse.ArgumentParser) -> None:
    out = p.add_argument_group("output")
    out.add_argument("--top", type=int, default=10, help="feasible layouts to list (10)")
    out.add_argument("--show-rejected", type=int, default=10, help="rejection reasons to list (10)")
    out.add_argument("--explain", type=int, default=1,
                     help="print the memory and time arithmetic of the N-th ranked layout (1; 0 for none)")
    out.add_argument("--scale", help="cluster sizes to simulate one layout on, e.g. 8,64,512,4096")
    out.add_argument("--per-gpu-batch", type=int,
                     help="--scale: samples per data-parallel rank per step (weak scaling, default 8); "
                          "giving --global-batch instead keeps the global batch fixed")
    out.add_argument("--out", default="meshyard-plan-scale.png", help="--scale: PNG file for the plot")


def _add_cost_arguments(p: argparse.ArgumentParser) -> None:
    cost = p.add_argument_group("cost (US dollars; default prices: meshyard.metrics.cost.PRICES)")
    cost.add_argument("--tokens", help="tokens to train, each layout priced for them: 300M, 10B, 2T (default 1B)")
    cost.add_argument("--gpu-hour-price", type=float,
                      help="on-demand price per GPU-hour (default: the price table's for --gpu)")
    cost.add_argument("--spot-hour-price", type=float,
                      help="spot (preemptible) price per GPU-hour (default: the price table's for --gpu)")
    cost.add_argument("--restarts", metavar="RUN_DIR",
                      help=f"a run whose {RunDir.RESTARTS} measured restarts on spot capacity: the spot cost adds "
                           "its restart overhead (time to resume, lost steps) at the rate it restarted")


def _bind(p: argparse.ArgumentParser) -> None:
    """The handler, and how bad input is told: ``meshyard plan: ...``; no config overrides."""
    p.set_defaults(handler=main, takes_overrides=False, own_errors=(PlanInputError, CatalogError),
                   error_prefix="meshyard plan")


def register(subparsers: argparse._SubParsersAction) -> None:
    """Add the ``plan`` subcommand to a ``meshyard`` argument parser."""
    p = subparsers.add_parser("plan", help="estimate memory, rank parallel layouts, predict scaling",
                              description=DESCRIPTION, epilog=EPILOG,
                              formatter_class=argparse.RawDescriptionHelpFormatter)
    _add_arguments(p)
    _bind(p)


def build_parser() -> argparse.ArgumentParser:
    """A stand-alone parser (``python -m meshyard.plan``)."""
    p = argparse.ArgumentParser(prog="meshyard plan", description=DESCRIPTION, epilog=EPILOG,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    _add_arguments(p)
    _bind(p)
    return p


def _console() -> Console:
    console = Console(soft_wrap=False)
    if not console.is_terminal:
        console = Console(width=150, soft_wrap=False)
    return console


def main(args: argparse.Namespace, overrides: list[str]) -> int:
    """Run ``meshyard plan``; bad input raises ``PlanInputError`` or ``CatalogError``."""
    console = _console()
    if args.list_hardware:
        render_catalog(console)
        return 0
    inputs = resolve_inputs(args)
    render_model(console, inputs.desc, inputs.request.seq_len)
    render_cluster(console, inputs.cluster, inputs.request.precision.peak_dtype)
    if inputs.scale_sizes:
        return _run_scale(console, inputs, args.out)
    return _run_plan(console, inputs, args)


def _run_plan(console: Console, inputs: PlanInputs, args: argparse.Namespace) -> int:
    request = inputs.request
    console.print(f"Global batch {request.global_batch} x {request.seq_len} tokens, {request.precision.name}, "
                  f"{request.optimizer}.")
    result = plan(inputs.desc, inputs.cluster, request)
    render_plan(console, result, args.top, args.show_rejected, inputs.pricing)
    if not result.feasible:
        console.print("[bold red]No layout fits.[/] Add GPUs, pick a GPU with more memory, lower --seq-len or "
                      "--global-batch, or allow more layouts (--ac full, --offload on, --tp/--pp).")
        return 0
    if 0 < args.explain <= len(result.feasible):
        chosen = result.feasible[args.explain - 1]
        label = f"#{args.explain} {chosen.layout.describe()}"
        render_memory(console, chosen.memory, f"Memory of {label}")
        render_step(console, chosen.step, f"Step time of {label}")
    render_settings(console, result.feasible[0].layout, inputs.cluster.nodes)
    return 0


def _run_scale(console: Console, inputs: PlanInputs, out: str) -> int:
    request = inputs.request
    result = simulate_scale(inputs.desc, inputs.cluster, inputs.scale_sizes, request,
                            per_rank_batch=inputs.per_rank_batch)
    render_scale(console, result)
    if inputs.per_rank_batch:
        console.print(f"Each data-parallel rank keeps {inputs.per_rank_batch} samples per step; give "
                      "--global-batch to keep the global batch fixed instead.")
    else:
        console.print(f"The global batch stays {request.global_batch}; give --per-gpu-batch to grow it with "
                      "the cluster instead.")
    try:
        path = plot_scale(result, out, title=f"{inputs.desc.name}: {result.layout_label} on "
                                             f"{inputs.cluster.gpu.name} / {inputs.cluster.inter.name}")
    except OSError as exc:
        raise PlanInputError(f"cannot write the plot to '{out}' ({exc.strerror or exc}); "
                             "pass --out with a writable path.") from None
    console.print(f"Plot written to {path}")
    return 0


def run(argv: list[str] | None = None) -> int:
    """Parse ``argv`` (default: the process arguments) and run, as ``meshyard plan`` does."""
    return call_command(build_parser().parse_args(argv), [])


__all__ = ["build_parser", "main", "register", "run"]
