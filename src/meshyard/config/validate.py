"""Cross-field checks: the combinations a type check cannot see.

``validate`` gathers every problem before raising, and returns the derived objects
(``ParallelDims``, ``BatchPlan``) so the rest of the run uses exactly what was checked.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Iterable

from meshyard.config.load import ConfigError, collect_config, did_you_mean
from meshyard.config.sections import Config
from meshyard.extras import config_problems
from meshyard.models.gpt import GPT_PRESETS
from meshyard.models.registry import MODEL_NAMES
from meshyard.plugins import is_custom_reference
from meshyard.runtime.parallel_dims import ParallelDims, ParallelDimsError
from meshyard.train.batching import BatchPlan, BatchPlanError

DATA_SOURCES = ("stdlib", "text", "tokens", "random")


@dataclass(frozen=True)
class ValidatedLayout:
    dims: ParallelDims
    batch: BatchPlan


def _check_ranges(cfg: Config, problems: list[str]) -> None:
    def need(condition: bool, message: str) -> None:
        if not condition:
            problems.append(message)

    m, d, t, o = cfg.model, cfg.data, cfg.train, cfg.optim
    if not is_custom_reference(m.name) and m.name not in MODEL_NAMES:
        problems.append(
            f"model.name = '{m.name}' is not a known model{did_you_mean(m.name, MODEL_NAMES)}; known: "
            f"{', '.join(MODEL_NAMES)}, or 'module:function' / 'file.py:function' for your own"
        )
    for key in ("n_layer", "n_head", "d_model", "context_length", "vocab_size"):
        need(getattr(m, key) >= 0, f"model.{key} = {getattr(m, key)} must not be negative (0 means default)")
    if m.context_length and m.context_length < d.seq_len:
        problems.append(
            f"model.context_length = {m.context_length} is shorter than data.seq_len = {d.seq_len}; "
            "raise the context or shorten the samples"
        )
    need(0.0 <= m.dropout < 1.0, f"model.dropout = {m.dropout} must be in [0, 1)")

    if not is_custom_reference(d.source) and d.source not in DATA_SOURCES:
        problems.append(
            f"data.source = '{d.source}' is not known{did_you_mean(d.source, DATA_SOURCES)}; known: "
            f"{', '.join(DATA_SOURCES)}, or 'module:function' / 'file.py:function' for your own dataset"
        )
    if d.source in ("text", "tokens") and not d.paths:
        problems.append(f"data.source = '{d.source}' needs data.paths (files or glob patterns)")
    need(all(isinstance(path, str) for path in d.paths),
         f"data.paths = {d.paths} must list files or glob patterns as strings")
    need(d.seq_len >= 1, f"data.seq_len = {d.seq_len} must be at least 1")
    need(0.0 <= d.val_fraction < 1.0, f"data.val_fraction = {d.val_fraction} must be in [0, 1)")
    need(d.num_workers >= 0, f"data.num_workers = {d.num_workers} must not be negative")
    need(d.prefetch_factor >= 1, f"data.prefetch_factor = {d.prefetch_factor} must be at least 1")
    need(d.max_tokens >= 0 and d.vocab_size >= 0, "data.max_tokens and data.vocab_size must not be negative")
    need(d.random_tokens > d.seq_len, f"data.random_tokens = {d.random_tokens} must exceed data.seq_len")
    # The random source is drawn in memory, 8 bytes a token: 2^31 of them already take 16 GiB.
    need(d.random_tokens <= 2 ** 31, f"data.random_tokens = {d.random_tokens} must be at most 2147483648")

    need(t.steps >= 1, f"train.steps = {t.steps} must be at least 1")
    need(t.grad_clip >= 0, f"train.grad_clip = {t.grad_clip} must not be negative (0 disables clipping)")
    need(t.eval_every >= 0, f"train.eval_every = {t.eval_every} must not be negative (0 disables evaluation)")
    need(t.eval_batches >= 1, f"train.eval_batches = {t.eval_batches} must be at least 1")
    need(t.seed >= 0, f"train.seed = {t.seed} must not be negative (NumPy's generators take only non-negative seeds)")

    need(o.lr > 0, f"optim.lr = {o.lr} must be positive")
    need(o.weight_decay >= 0, f"optim.weight_decay = {o.weight_decay} must not be negative")
    need(o.eps > 0, f"optim.eps = {o.eps} must be positive")
    need(o.momentum >= 0, f"optim.momentum = {o.momentum} must not be negative")
    betas_ok = len(o.betas) == 2 and all(isinstance(b, (int, float)) and 0 <= b < 1 for b in o.betas)
    need(betas_ok, f"optim.betas = {o.betas} must be two numbers in [0, 1)")
    need(o.warmup_steps >= 0, f"optim.warmup_steps = {o.warmup_steps} must not be negative")
    need(0.0 <= o.min_lr_ratio <= 1.0, f"optim.min_lr_ratio = {o.min_lr_ratio} must be in [0, 1]")
    need(o.reference_batch >= 1, f"optim.reference_batch = {o.reference_batch} must be at least 1")

    # DDP turns the size into a byte count held in 64 bits; no bucket needs more than 1 TiB.
    need(0 < cfg.parallel.bucket_mb <= 2 ** 20,
         f"parallel.bucket_mb = {cfg.parallel.bucket_mb} must be positive and at most 1048576 (1 TiB)")
    need(cfg.precision.loss_scale_growth_interval >= 1,
         f"precision.loss_scale_growth_interval = {cfg.precision.loss_scale_growth_interval} must be at least 1")
    _check_comm(cfg, problems)
    need(cfg.checkpoint.interval >= 0, f"checkpoint.interval = {cfg.checkpoint.interval} must not be negative")
    need(cfg.checkpoint.interval_minutes >= 0,
         f"checkpoint.interval_minutes = {cfg.checkpoint.interval_minutes} must not be negative")
    need(cfg.fault.max_restarts >= 0, f"fault.max_restarts = {cfg.fault.max_restarts} must not be negative")
    need(cfg.fault.grace_period_s > 0, f"fault.grace_period_s = {cfg.fault.grace_period_s} must be positive")
    # Process groups hold their timeout as a timedelta, which overflows far beyond any useful wait.
    need(0 < cfg.fault.collective_timeout_s <= 365 * 86400,
         f"fault.collective_timeout_s = {cfg.fault.collective_timeout_s} must be positive and at most a year (31536000)")
    for name in cfg.fault.signals:
        if name not in ("SIGTERM", "SIGINT", "SIGUSR1", "SIGUSR2", "SIGHUP"):
            problems.append(f"fault.signals: '{name}' is not one of SIGTERM, SIGINT, SIGUSR1, SIGUSR2, SIGHUP")
    need(cfg.checkpoint.keep_last >= 1, f"checkpoint.keep_last = {cfg.checkpoint.keep_last} must be at least 1")
    need(cfg.metrics.log_every >= 1, f"metrics.log_every = {cfg.metrics.log_every} must be at least 1")
    need(cfg.metrics.gather_every >= 0, f"metrics.gather_every = {cfg.metrics.gather_every} must not be negative")
    need(cfg.metrics.straggler_factor > 1.0,
         f"metrics.straggler_factor = {cfg.metrics.straggler_factor} must be above 1 (e.g. 1.25)")
    need(0 <= cfg.metrics.prometheus_port < 65536,
         f"metrics.prometheus_port = {cfg.metrics.prometheus_port} is not a port number (0-65535)")
    need(cfg.fault.hang_timeout_s >= 0, f"fault.hang_timeout_s = {cfg.fault.hang_timeout_s} must not be negative")
    need(cfg.fault.startup_timeout_s >= 0,
         f"fault.startup_timeout_s = {cfg.fault.startup_timeout_s} must not be negative (0 disables it)")
    need(cfg.run.nproc >= 0, f"run.nproc = {cfg.run.nproc} must not be negative (0 starts one per visible GPU)")
    need(0 <= cfg.run.threads_per_rank < 2 ** 31,  # torch.set_num_threads takes a C int
         f"run.threads_per_rank = {cfg.run.threads_per_rank} must be in [0, 2147483647]")


def _check_comm(cfg: Config, problems: list[str]) -> None:
    """Gradient-communication options: ranges, and compression only where DDP syncs gradients."""
    c, p = cfg.comm, cfg.parallel
    for key in ("forward_prefetch", "backward_prefetch"):
        if getattr(p, key) < 0:
            problems.append(f"parallel.{key} = {getattr(p, key)} must not be negative (0 keeps FSDP2's default)")
    if c.warmup_steps < 0:
        problems.append(f"comm.warmup_steps = {c.warmup_steps} must not be negative")
    if c.powersgd_rank < 1:
        problems.append(f"comm.powersgd_rank = {c.powersgd_rank} must be at least 1")
    if not 0.0 < c.topk_ratio <= 1.0:
        problems.append(f"comm.topk_ratio = {c.topk_ratio} must be in (0, 1]")
    if c.compression == "powersgd" and 0 <= c.warmup_steps < 2:
        problems.append(
            f"comm.warmup_steps = {c.warmup_steps} is too short for comm.compression = 'powersgd': PyTorch's "
            "PowerSGD needs at least 2 uncompressed steps (DDP regroups its buckets after the first); use 2 or more"
        )
    if c.compression != "none" and p.strategy == "fsdp":
        problems.append(
            f"comm.compression = '{c.compression}' does not apply to parallel.strategy = 'fsdp': compression "
            "is a DDP communication hook on the gradient all-reduce, and FSDP reduce-scatters sharded "
            "gradients instead; use parallel.strategy = 'ddp' or 'zero1' to compress, or keep fsdp with "
            "comm.compression = 'none' (precision.reduce_fp32 = false halves FSDP's reduce traffic in bf16)"
        )


def _check_gpt_shape(cfg: Config, problems: list[str]) -> None:
    """A built-in GPT's shape as it will be built (preset values where the config says 0)
    against its heads and the tp/pp degrees: otherwise every worker fails building it."""
    m, p = cfg.model, cfg.parallel
    if m.name != "gpt" and m.name not in GPT_PRESETS:  # other models: only what the config itself says
        if m.n_head > 0 and m.d_model and m.d_model % m.n_head:
            problems.append(f"model.d_model = {m.d_model} is not divisible by model.n_head = {m.n_head}")
        return
    preset = GPT_PRESETS.get(m.name, GPT_PRESETS["gpt-tiny"])
    size = {key: getattr(m, key) or preset[key] for key in ("n_layer", "n_head", "d_model")}

    def shown(key: str) -> str:
        return f"model.{key} = {size[key]}" + ("" if getattr(m, key) else f" (from '{m.name}')")

    if size["n_head"] > 0 and size["d_model"] % size["n_head"]:
        problems.append(f"{shown('d_model')} is not divisible by {shown('n_head')}")
    if p.tp > 1:
        problems.extend(f"{shown(key)} is not divisible by parallel.tp = {p.tp}"
                        for key in ("n_head", "d_model") if size[key] % p.tp)
    stages = p.pp * p.pp_virtual_stages
    if p.pp > 1 and not p.pp_split and size["n_layer"] < stages:
        problems.append(f"{shown('n_layer')} blocks are fewer than the {stages} pipeline stages "
                        "(parallel.pp x pp_virtual_stages); lower them or use more layers")
    if p.pp > 1 and p.pp_split and all(isinstance(n, int) for n in p.pp_split) and sum(p.pp_split) != size["n_layer"]:
        problems.append(f"parallel.pp_split = {p.pp_split} sums to {sum(p.pp_split)} blocks, not the "
                        f"{size['n_layer']} of {shown('n_layer')}")


def _check_model_parallel(cfg: Config, batch: BatchPlan | None, problems: list[str]) -> None:
    """Tensor/pipeline degrees, schedules, activation checkpointing: ranges and combinations."""
    p = cfg.parallel
    for key in ("tp", "pp", "pp_virtual_stages", "ac_every"):
        if getattr(p, key) < 1:
            problems.append(f"parallel.{key} = {getattr(p, key)} must be at least 1")
    if p.microbatches < 0:
        problems.append(f"parallel.microbatches = {p.microbatches} must not be negative (0 uses parallel.pp)")
    if p.pp > 1 and p.pp_schedule in ("interleaved1f1b", "zerobubble") and p.pp_virtual_stages < 2:
        problems.append(
            f"parallel.pp_schedule = '{p.pp_schedule}' runs several stages per rank; set parallel.pp_virtual_stages "
            "to 2 or more (or use 'gpipe' / '1f1b')"
        )
    if p.pp > 1 and p.pp_schedule in ("gpipe", "1f1b") and p.pp_virtual_stages != 1:
        problems.append(f"parallel.pp_virtual_stages = {p.pp_virtual_stages} needs parallel.pp_schedule = "
                        "'interleaved1f1b' or 'zerobubble'; 'gpipe' and '1f1b' run one stage per rank")
    if p.pp_split and (not all(isinstance(n, int) and n >= 1 for n in p.pp_split)
                       or len(p.pp_split) != p.pp * p.pp_virtual_stages):
        problems.append(f"parallel.pp_split = {p.pp_split} must list one positive block count per stage "
                        f"({p.pp * p.pp_virtual_stages} stages = pp x pp_virtual_stages)")
    if p.pp > 1 and batch is not None:
        microbatches = p.microbatches or p.pp
        if batch.micro_batch % microbatches:
            problems.append(f"parallel.microbatches = {microbatches} does not divide the {batch.micro_batch} samples "
                            "of each train.micro_batch; each pipeline micro-batch must hold whole samples")
    if p.pp > 1 and cfg.comm.compression != "none":
        problems.append(f"comm.compression = '{cfg.comm.compression}' is not supported with parallel.pp > 1")
    if p.tp > 1 and p.pp == 1 and p.strategy == "ddp" and cfg.comm.compression != "none":
        problems.append(
            f"comm.compression = '{cfg.comm.compression}' does not combine with parallel.tp = {p.tp}: DDP cannot "
            "wrap a tensor-parallel model, so 'ddp' replicates it with FSDP2, whose gradient all-reduce takes no "
            "DDP communication hook; use comm.compression = 'none' (or parallel.tp = 1 to compress)"
        )
    if p.tp > 1 and cfg.data.seq_len % p.tp and p.sequence_parallel:
        problems.append(f"data.seq_len = {cfg.data.seq_len} is not divisible by parallel.tp = {p.tp} "
                        "(sequence parallelism splits the sequence); change one or set parallel.sequence_parallel = false")
    if p.tp > 1 and p.strategy == "zero1":
        problems.append("parallel.strategy = 'zero1' does not combine with parallel.tp > 1; use 'fsdp' (FSDP x TP)")
    if p.pp > 1 and p.strategy == "zero1":
        problems.append("parallel.strategy = 'zero1' does not combine with parallel.pp > 1; use 'ddp' or 'fsdp'")


def load_and_validate(
    path: str | Path | None, overrides: Iterable[str], world_size: int | None = None
) -> tuple[Config, ValidatedLayout]:
    """Load and check a config in one pass, so type errors and impossible combinations
    are reported together. ``world_size`` defaults to ``run.nproc``."""
    cfg, problems = collect_config(path, overrides)
    return cfg, validate(cfg, world_size or cfg.run.nproc, problems)


def validate(cfg: Config, world_size: int, earlier_problems: Iterable[str] = ()) -> ValidatedLayout:
    """Check ``cfg`` for a job of ``world_size`` ranks; raise one ``ConfigError`` listing all problems."""
    problems: list[str] = list(earlier_problems)
    _check_ranges(cfg, problems)
    problems.extend(config_problems(cfg.metrics, cfg.checkpoint))
    dims = batch = None
    p = cfg.parallel
    for key in ("dp_replicate", "dp_shard"):
        if getattr(p, key) < 0:
            problems.append(f"parallel.{key} = {getattr(p, key)} must not be negative (0 derives it)")
    model_parallel = max(p.tp, 1) * max(p.pp, 1)
    if p.strategy == "none" and world_size > model_parallel:
        problems.append(
            f"parallel.strategy = 'none' runs one process{model_parallel > 1 and f' per tp x pp = {model_parallel}' or ''}"
            f" but the world size is {world_size}; use --nproc {model_parallel} or choose 'ddp', 'fsdp' or 'zero1'"
        )
    elif p.dp_replicate >= 0 and p.dp_shard >= 0 and p.tp >= 1 and p.pp >= 1:
        try:
            dims = ParallelDims.resolve(p.strategy, world_size, p.dp_replicate, p.dp_shard, p.tp, p.pp)
        except ParallelDimsError as exc:
            problems.extend(exc.problems)
    if dims is not None:
        try:
            batch = BatchPlan.derive(cfg.train.global_batch, dims.dp, cfg.train.micro_batch, cfg.train.grad_accum)
        except BatchPlanError as exc:
            problems.append(str(exc))
    _check_model_parallel(cfg, batch, problems)
    _check_gpt_shape(cfg, problems)
    if problems:
        raise ConfigError(problems)
    assert dims is not None and batch is not None
    return ValidatedLayout(dims=dims, batch=batch)
