"""Turn ``meshyard plan`` arguments into a model description, a cluster and a request.

Every check names the offending option and the fix, and raises ``PlanInputError``; the
CLI prints that one message and exits with code 2.
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass
from pathlib import Path

from meshyard.config.sections import ModelConfig, ParallelConfig
from meshyard.errors import BadInput
from meshyard.metrics.cost import resolve_price
from meshyard.run_dir import RunDir
from meshyard.models.gpt import GPT_PRESETS
from meshyard.plan.hardware import Cluster, make_cluster
from meshyard.plan.layout import AC_MODES, CONFIG_STRATEGIES, PRECISIONS, STRATEGIES, planner_strategy
from meshyard.plan.model import ModelDescription
from meshyard.plan.pricing import DEFAULT_TOKENS, MeasuredRestarts, Pricing
from meshyard.plan.search import PlanRequest
from meshyard.plan.trace import TraceError, describe_config
from meshyard.plan.units import parse_count, parse_size
from meshyard.plugins import PluginError, is_custom_reference

DEFAULT_MODEL = "gpt2-124m"
DEFAULT_VOCAB = 50257
DEFAULT_SEQ = 1024
DEFAULT_TOKENS_PER_STEP = 2**19
DEFAULT_PER_GPU_BATCH = 8
SWITCHES: dict[str, tuple[bool, ...]] = {"auto": (False, True), "on": (True,), "off": (False,)}
"""What an auto|on|off option (--offload, --fused-loss) lets the search try."""


class PlanInputError(BadInput, ValueError):
    """A bad ``meshyard plan`` argument; the message says what and how to fix it."""


@dataclass(frozen=True)
class PlanInputs:
    desc: ModelDescription
    cluster: Cluster
    request: PlanRequest
    scale_sizes: list[int]
    per_rank_batch: int
    pricing: Pricing | None = None
    """How layouts are priced; None without a price (--gpu-hour-price or the price table's)."""


@dataclass
class _Defaults:
    """Values a --config file supplies when the matching option is not given."""

    model: ModelConfig
    seq_len: int = DEFAULT_SEQ
    global_batch: int = 0
    optimizer: str = "adamw"
    precision: str = "bf16"
    vocab_size: int = DEFAULT_VOCAB
    fused_loss: bool = False
    """``train.fused_linear_loss``: the config runs the fused loss, so the plan does too."""


def _int_list(text: str | None, option: str) -> tuple[int, ...]:
    if not text:
        return ()
    try:
        values = tuple(int(v) for v in text.split(",") if v.strip())
    except ValueError:
        raise PlanInputError(f"{option} '{text}' is not a comma-separated list of whole numbers; "
                             f"write it like {option} 1,2,4") from None
    if not values or min(values) < 1:
        raise PlanInputError(f"{option} '{text}' must list numbers of at least 1, e.g. {option} 1,2,4")
    return values


def _choice_list(text: str | None, option: str, known: tuple[str, ...]) -> tuple[str, ...]:
    if not text:
        return ()
    values = tuple(v.strip().lower() for v in text.split(",") if v.strip())
    unknown = [v for v in values if v not in known]
    if unknown or not values:
        raise PlanInputError(f"{option} '{text}' has unknown value(s) {', '.join(unknown) or text}; "
                             f"choose from {', '.join(known)}")
    return values


def _given(value: int | None, default: int) -> int:
    """An option's value when given (0 included, so that it is checked), else the default."""
    return default if value is None else value


def _need(condition: bool, message: str) -> None:
    if not condition:
        raise PlanInputError(message)


def _config_defaults(path: str | None) -> _Defaults:
    if not path:
        return _Defaults(model=ModelConfig(name=DEFAULT_MODEL))
    from meshyard.config.load import ConfigError, load_config

    try:
        cfg = load_config(path)
    except ConfigError as exc:
        raise PlanInputError(f"--config {path}: {exc}") from None
    byte_text = cfg.data.source in ("stdlib", "text")
    vocab = cfg.model.vocab_size or cfg.data.vocab_size or (256 if byte_text else DEFAULT_VOCAB)
    dtype = cfg.precision.dtype if cfg.precision.dtype != "auto" else "bf16"
    return _Defaults(model=cfg.model, seq_len=cfg.data.seq_len, global_batch=cfg.train.global_batch,
                     optimizer=cfg.optim.name, precision=dtype, vocab_size=vocab,
                     fused_loss=cfg.train.fused_linear_loss)


def describe_from_args(args: argparse.Namespace, defaults: _Defaults, seq_len: int) -> ModelDescription:
    """The model named by --model (or the config) with the size options applied."""
    cfg = defaults.model
    name = args.model or cfg.name
    known = (*GPT_PRESETS, "gpt", "mlp")
    if name not in known and not is_custom_reference(name):
        raise PlanInputError(f"unknown model '{name}'; use one of {', '.join(known)} ('gpt' with --n-layer, "
                             "--n-head and --d-model for a custom size), or your own builder as "
                             "module:function or file.py:function")
    sizes = {"n_layer": args.n_layer, "n_head": args.n_head, "d_model": args.d_model}
    for key, value in sizes.items():
        _need(value is None or value >= 1, f"--{key.replace('_', '-')} {value} must be at least 1")
    if name == "gpt" and args.model and not all(sizes.values()):
        raise PlanInputError("--model gpt is a custom size: give --n-layer, --n-head and --d-model "
                             "(e.g. --n-layer 24 --n-head 16 --d-model 2048), or pick a preset such as gpt2-124m")
    vocab = _given(args.vocab_size, defaults.vocab_size)
    _need(vocab >= 1, f"--vocab-size {vocab} must be at least 1")
    model = ModelConfig(
        name=name, vocab_size=vocab, context_length=max(seq_len, cfg.context_length),
        n_layer=sizes["n_layer"] or cfg.n_layer, n_head=sizes["n_head"] or cfg.n_head,
        d_model=sizes["d_model"] or cfg.d_model, dropout=cfg.dropout,
        tie_embeddings=cfg.tie_embeddings and not args.untied_embeddings, options=dict(cfg.options),
        # Experts as configured or given: compute counts the active ones, memory all of them.
        moe_experts=_given(getattr(args, "moe_experts", None), cfg.moe_experts),
        moe_top_k=_given(getattr(args, "moe_top_k", None), cfg.moe_top_k),
        moe_shared_experts=_given(getattr(args, "moe_shared_experts", None), cfg.moe_shared_experts),
        moe_capacity_factor=cfg.moe_capacity_factor,
    )
    _check_experts(model, name)
    preset = GPT_PRESETS.get(name, {})
    d_model, n_head = model.d_model or preset.get("d_model", 0), model.n_head or preset.get("n_head", 0)
    if d_model and n_head and d_model % n_head:
        raise PlanInputError(f"d_model={d_model} is not divisible by n_head={n_head}; choose sizes where "
                             "--d-model is a multiple of --n-head")
    try:
        return describe_config(model, vocab, seq_len)
    except (TraceError, PluginError) as exc:
        raise PlanInputError(f"cannot describe model '{name}': {exc}") from None


def _check_experts(model: ModelConfig, name: str) -> None:
    """Experts only for meshyard's GPT, as many as top-k at least."""
    if model.moe_experts == 0:
        return
    _need(model.moe_experts > 0, f"--moe-experts {model.moe_experts} must be at least 1 (or 0 for dense blocks)")
    _need(name in (*GPT_PRESETS, "gpt"), f"--moe-experts gives meshyard's GPT experts, but the model is '{name}'; "
                                         "pick a GPT preset or 'gpt' with its sizes")
    _need(1 <= model.moe_top_k <= model.moe_experts,
          f"--moe-top-k {model.moe_top_k} must be between 1 and the {model.moe_experts} experts")
    _need(model.moe_shared_experts >= 0, f"--moe-shared-experts {model.moe_shared_experts} must not be negative")


def cluster_from_args(args: argparse.Namespace, n_gpus: int) -> Cluster:
    """The hardware: catalog entries with the command line's overrides."""
    for option, value, low_open in (("--efficiency", args.efficiency, True),
                                    ("--link-efficiency", args.link_efficiency, True),
                                    ("--overlap", args.overlap, False)):
        _need((0 < value <= 1) if low_open else (0 <= value <= 1),
              f"{option} {value} must be a fraction {'in (0, 1]' if low_open else 'between 0 and 1'}")
    overrides: dict[str, float] = {}
    if args.gpu_memory is not None:
        overrides["memory"] = _size(args.gpu_memory, "--gpu-memory")
    if args.peak_tflops is not None:
        _need(args.peak_tflops > 0, f"--peak-tflops {args.peak_tflops} must be positive, e.g. --peak-tflops 989")
        overrides["peak_flops"] = args.peak_tflops * 1e12
    if args.intra_bw is not None:
        overrides["intra_bandwidth"] = _size(args.intra_bw, "--intra-bw", per_second=True)
    if args.inter_bw is not None:
        overrides["inter_bandwidth"] = _size(args.inter_bw, "--inter-bw", per_second=True)
    return make_cluster(args.gpu, n_gpus, args.gpus_per_node, args.interconnect, args.intra_node,
                        compute_efficiency=args.efficiency, link_efficiency=args.link_efficiency, **overrides)


def _size(text: str, option: str, per_second: bool = False) -> float:
    raw = text[:-2] if per_second and text.lower().endswith("/s") else text
    try:
        return parse_size(raw)
    except ValueError as exc:
        unit = " per second (e.g. 450GB/s)" if per_second else ""
        raise PlanInputError(f"{option}: {exc}{unit}") from None


def _check_gpus(n: int, gpus_per_node: int, option: str) -> None:
    _need(n >= 1, f"{option} {n} must be at least 1")
    if n > gpus_per_node and n % gpus_per_node:
        raise PlanInputError(f"{option} {n} does not fill whole nodes of {gpus_per_node} GPUs; use a multiple of "
                             f"{gpus_per_node} or set --gpus-per-node")


def strategies_from_args(args: argparse.Namespace) -> tuple[str, ...]:
    """--strategy in the planner's names. The config's names are taken as a config means
    them (``planner_strategy``): 'fsdp' is fsdp3, or fsdp2 with --reshard-after-forward
    false; the planner's own names (fsdp2, fsdp3, hsdp) are taken as they are."""
    known = tuple(dict.fromkeys(CONFIG_STRATEGIES + STRATEGIES))
    names = _choice_list(args.strategy, "--strategy", known)
    reshard = getattr(args, "reshard_after_forward", None)
    _need(reshard is None or "fsdp" in names,
          "--reshard-after-forward applies to the config's 'fsdp' only: give --strategy fsdp")
    parallel = ParallelConfig(strategy="fsdp", reshard_after_forward=reshard != "false")
    planned = (planner_strategy(parallel) if name == "fsdp" else name for name in names)
    return tuple(dict.fromkeys(planned))


def _scale_layout(args: argparse.Namespace, strategies: tuple[str, ...], tp: tuple[int, ...],
                  pp: tuple[int, ...]) -> tuple[tuple[str, ...], tuple[int, ...], tuple[int, ...], int]:
    """--scale's single layout (fsdp3, tp 1, pp 1 unless given) and per-rank batch
    (0 when --global-batch fixes the global batch instead)."""
    strategies, tp, pp = strategies or ("fsdp3",), tp or (1,), pp or (1,)
    if len(strategies) > 1 or len(tp) > 1 or len(pp) > 1:
        raise PlanInputError("--scale predicts one layout: give a single --strategy, --tp and --pp "
                             "(e.g. --strategy fsdp3 --tp 1 --pp 1)")
    if args.global_batch is not None:
        return strategies, tp, pp, 0
    per_rank = _given(args.per_gpu_batch, DEFAULT_PER_GPU_BATCH)
    _need(per_rank >= 1, f"--per-gpu-batch {per_rank} must be at least 1")
    return strategies, tp, pp, per_rank


def _request(args: argparse.Namespace, defaults: _Defaults, seq_len: int, strategies: tuple[str, ...],
             tp: tuple[int, ...], pp: tuple[int, ...]) -> PlanRequest:
    default_batch = defaults.global_batch or max(1, round(DEFAULT_TOKENS_PER_STEP / seq_len))
    global_batch = _given(args.global_batch, default_batch)
    _need(global_batch >= 1, f"--global-batch {global_batch} must be at least 1")
    _need(0 <= args.headroom < 1, f"--headroom {args.headroom} must be a fraction in [0, 1), e.g. 0.1")
    _need(args.pp_virtual >= 1, f"--pp-virtual {args.pp_virtual} must be at least 1")
    return PlanRequest(
        global_batch=global_batch, seq_len=seq_len, precision=PRECISIONS[args.precision or defaults.precision],
        optimizer=args.optimizer or defaults.optimizer, strategies=strategies or STRATEGIES, tp=tp, pp=pp,
        cp=_int_list(getattr(args, "cp", None), "--cp") or (1,), ep=_int_list(getattr(args, "ep", None), "--ep"),
        micro_batches=_int_list(args.micro_batch, "--micro-batch"),
        ac=_choice_list(args.ac, "--ac", AC_MODES) or AC_MODES,
        offload=SWITCHES[args.offload], fused_loss=_fused_loss(args, defaults),
        pp_schedule=args.pp_schedule, pp_virtual=args.pp_virtual,
        sequence_parallel=not args.no_sequence_parallel, headroom=args.headroom, overlap=args.overlap,
    )


def _fused_loss(args: argparse.Namespace, defaults: _Defaults) -> tuple[bool, ...]:
    """--fused-loss, else 'on' where the config sets train.fused_linear_loss, else both."""
    choice = getattr(args, "fused_loss", None) or ("on" if defaults.fused_loss else "auto")
    return SWITCHES[choice]


def pricing_from_args(args: argparse.Namespace, cluster: Cluster) -> Pricing | None:
    """The price of the cluster's GPU (--gpu-hour-price, else the price table's), the tokens
    to cost (--tokens) and the restarts measured in --restarts RUN_DIR."""
    for option, value in (("--gpu-hour-price", args.gpu_hour_price), ("--spot-hour-price", args.spot_hour_price)):
        _need(value is None or value >= 0, f"{option} {value} must be a price of at least 0 US dollars per "
                                           "GPU-hour, e.g. 2.5 (0 takes the price table's)")
    try:
        tokens = parse_count(args.tokens) if args.tokens else DEFAULT_TOKENS
    except ValueError as exc:
        raise PlanInputError(f"--tokens: {exc}") from None
    price = resolve_price(args.gpu_hour_price or 0.0, args.spot_hour_price or 0.0, cluster.gpu.name,
                          option="--gpu-hour-price")
    measured = None
    if args.restarts:
        run_dir = Path(args.restarts)
        _need(run_dir.is_dir(), f"--restarts {run_dir} is not a run directory; give the folder of a run whose "
                                f"{RunDir.RESTARTS} measured its restarts")
        measured = MeasuredRestarts.read(run_dir)
    return Pricing(price, tokens, measured) if price else None


def resolve_inputs(args: argparse.Namespace) -> PlanInputs:
    """Validate every option and build what the planner needs."""
    defaults = _config_defaults(args.config)
    seq_len = _given(args.seq_len, defaults.seq_len)
    _need(seq_len >= 1, f"--seq-len {seq_len} must be at least 1")
    desc = describe_from_args(args, defaults, seq_len)
    scale_sizes = list(_int_list(args.scale, "--scale"))
    _need(args.gpus_per_node >= 1, f"--gpus-per-node {args.gpus_per_node} must be at least 1")
    for n in scale_sizes or [args.gpus]:
        _check_gpus(n, args.gpus_per_node, "--scale size" if scale_sizes else "--gpus")
    cluster = cluster_from_args(args, scale_sizes[0] if scale_sizes else args.gpus)
    strategies = strategies_from_args(args)
    tp, pp = _int_list(args.tp, "--tp"), _int_list(args.pp, "--pp")
    per_rank = 0
    if scale_sizes:
        strategies, tp, pp, per_rank = _scale_layout(args, strategies, tp, pp)
    request = _request(args, defaults, seq_len, strategies, tp, pp)
    _need(max(request.ep, default=1) == 1 or desc.moe is not None,
          f"--ep {getattr(args, 'ep', None)} splits experts over ranks, but model '{desc.name}' has none; give it experts with "
          "--moe-experts (or model.moe_experts in --config), or leave --ep out")
    _need(False in request.fused_loss or desc.fuses_head_loss,
          f"--fused-loss on (or train.fused_linear_loss = true in --config) needs meshyard's GPT, whose forward "
          f"computes the loss from its hidden states; model '{desc.name}' returns logits: give --fused-loss off")
    return PlanInputs(desc=desc, cluster=cluster, request=request, scale_sizes=scale_sizes, per_rank_batch=per_rank,
                      pricing=pricing_from_args(args, cluster))
