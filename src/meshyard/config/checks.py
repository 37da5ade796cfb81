"""Checks of a config on its own fields: ranges, and combinations one section or two decide.

Types and choices are checked on load (``meshyard.config.load``); these are the checks
that need nothing but the config. What needs more (the model registry, plugins, the
world size) is checked by ``meshyard.validate``, which runs these too, so that one
message lists every problem of a run. Nothing here raises: each check returns messages.
"""

from __future__ import annotations

import ipaddress
import math
import re
from typing import Any, Callable, Iterable

from meshyard.config.sections import (CheckpointConfig, CommConfig, Config, DataConfig, FaultConfig, GuardConfig,
                                      MetricsConfig, ModelConfig, OptimConfig, ParallelConfig, PrecisionConfig,
                                      RunConfig, ServeConfig, TrainConfig)

SIGNALS = ("SIGTERM", "SIGINT", "SIGUSR1", "SIGUSR2", "SIGHUP")
"""Signals a run may treat as preemption."""
TP_STYLES = ("colwise", "rowwise", "sequence_parallel", "replicate")
"""Styles a ``parallel.tp_plan`` entry may name (``meshyard.parallel.tp_plans`` applies them)."""


def field_problems(cfg: Config) -> list[str]:
    """Every problem the config's own fields show, section by section."""
    return [
        *_model_problems(cfg.model, cfg.data),
        *_data_problems(cfg.data),
        *_lanes_problems(cfg.data, cfg.train),
        *_train_problems(cfg.train),
        *_optim_problems(cfg.optim),
        *_parallel_problems(cfg.parallel),
        *_pipeline_problems(cfg.parallel),
        *_comm_problems(cfg.comm, cfg.parallel),
        *_combination_problems(cfg.parallel, cfg.comm, cfg.data),
        *_moe_problems(cfg.model),
        *fused_loss_problems(cfg.train, cfg.model, cfg.parallel),
        *_expert_parallel_problems(cfg.model, cfg.parallel),
        *_precision_problems(cfg.precision),
        *_checkpoint_problems(cfg.checkpoint),
        *_fault_problems(cfg.fault),
        *_guard_problems(cfg.guard, cfg.checkpoint),
        *_metrics_problems(cfg.metrics),
        *_profile_problems(cfg.metrics, cfg.train),
        *_run_problems(cfg.run),
        *_serve_problems(cfg.serve),
    ]


def section_problems(section_name: str, section: Any) -> list[str]:
    """The problems of one section checked alone: its own ranges, for a command that reads
    that section only (``meshyard.config.load.load_section``); ``field_problems`` checks a
    whole config, combinations of sections included."""
    return SECTION_CHECKS[section_name](section)


def _failed(checks: Iterable[tuple[bool, str]]) -> list[str]:
    """The messages of the checks whose condition does not hold."""
    return [message for holds, message in checks if not holds]


def _model_problems(m: ModelConfig, d: DataConfig) -> list[str]:
    sizes = [(getattr(m, key) >= 0, f"model.{key} = {getattr(m, key)} must not be negative (0 means default)")
             for key in ("n_layer", "n_head", "d_model", "context_length", "vocab_size", "pad_vocab_multiple")]
    return _failed([
        *sizes,
        (not m.context_length or m.context_length >= d.seq_len,
         f"model.context_length = {m.context_length} is shorter than data.seq_len = {d.seq_len}; "
         "raise the context or shorten the samples"),
        (0.0 <= m.dropout < 1.0, f"model.dropout = {m.dropout} must be in [0, 1)"),
        (m.name != "hf" or bool(m.init_from.strip()),
         "model.name = 'hf' builds the model from the config.json of a Hugging Face model folder, but "
         "model.init_from is empty; set model.init_from to that folder (config.json and *.safetensors)"),
    ])


def _data_problems(d: DataConfig) -> list[str]:
    return _failed([
        (d.source not in ("text", "tokens") or bool(d.paths),
         f"data.source = '{d.source}' needs data.paths (files or glob patterns)"),
        (d.source != "shards" or bool(d.url.strip()),
         "data.source = 'shards' needs data.url, the folder or URL 'meshyard data prepare' wrote"),
        (d.cache_bytes >= 1, f"data.cache_bytes = {d.cache_bytes} must be at least 1"),
        (d.shuffle_span_shards >= 0, f"data.shuffle_span_shards = {d.shuffle_span_shards} must be 0 (shuffle over the "
         "whole corpus) or more"),
        (d.shuffle_lanes >= 0, f"data.shuffle_lanes = {d.shuffle_lanes} must be 0 (the default lanes) or more"),
        (all(isinstance(path, str) for path in d.paths),
         f"data.paths = {d.paths} must list files or glob patterns as strings"),
        (d.seq_len >= 1, f"data.seq_len = {d.seq_len} must be at least 1"),
        (0.0 <= d.val_fraction < 1.0, f"data.val_fraction = {d.val_fraction} must be in [0, 1)"),
        (d.num_workers >= 0, f"data.num_workers = {d.num_workers} must not be negative"),
        (d.prefetch_factor >= 1, f"data.prefetch_factor = {d.prefetch_factor} must be at least 1"),
        (d.max_tokens >= 0 and d.vocab_size >= 0, "data.max_tokens and data.vocab_size must not be negative"),
        (d.random_tokens > d.seq_len, f"data.random_tokens = {d.random_tokens} must exceed data.seq_len"),
        # The random source is drawn in memory, 8 bytes a token: 2^31 of them already take 16 GiB.
        (d.random_tokens <= 2 ** 31, f"data.random_tokens = {d.random_tokens} must be at most 2147483648"),
        (bool(d.text_field.strip()), "data.text_field is empty; name the field of each .jsonl record holding its "
         "text, e.g. 'text'"),
    ]) + _tokenizer_problems(d)


BYTES, BPE_PREFIX = "bytes", "bpe:"
"""``data.tokenizer``'s byte-level value, and how a BPE to train begins ('bpe:N')."""
SMALLEST_BPE = 257
"""A byte-level BPE holds the 256 bytes and an end-of-text token, before any merge."""
TEXT_SOURCES = ("text", "stdlib")
"""The built-in sources that read text, and so use ``data.tokenizer``."""


def bpe_vocab(tokenizer: str) -> int | None:
    """N of ``'bpe:N'``; None for any other ``data.tokenizer`` (-1 when N is no whole number)."""
    if not tokenizer.startswith(BPE_PREFIX):
        return None
    size = tokenizer[len(BPE_PREFIX):].strip()
    return int(size) if size.isdigit() else -1


def _tokenizer_problems(d: DataConfig) -> list[str]:
    """'bytes', 'bpe:N' with room for the bytes and end-of-text, or a path (whether it holds a
    tokenizer is the corpus's question, ``meshyard.data.tokenizer``); only for text sources."""
    size = bpe_vocab(d.tokenizer)
    return _failed([
        (bool(d.tokenizer.strip()),
         "data.tokenizer is empty; use 'bytes', 'bpe:N' or the path of a Hugging Face tokenizer"),
        (size is None or SMALLEST_BPE <= size <= 2 ** 32,
         f"data.tokenizer = '{d.tokenizer}' must be 'bpe:N' with a whole N from {SMALLEST_BPE} (the 256 bytes and "
         "an end-of-text token) to 4294967296, e.g. 'bpe:8192'"),
        (d.tokenizer == BYTES or d.source in TEXT_SOURCES,
         f"data.tokenizer = '{d.tokenizer}' tokenizes text, but data.source = '{d.source}' reads none; use "
         "data.source = 'text' (or leave data.tokenizer at 'bytes')"),
    ])


def _lanes_problems(d: DataConfig, t: TrainConfig) -> list[str]:
    return _failed([
        (d.shuffle_lanes <= 0 or t.global_batch % d.shuffle_lanes == 0,
         f"data.shuffle_lanes = {d.shuffle_lanes} does not divide train.global_batch = {t.global_batch}: every global "
         "batch takes the same number of samples from each lane; choose a divisor, or 0 for the default"),
    ])


def _train_problems(t: TrainConfig) -> list[str]:
    return _failed([
        (t.steps >= 1, f"train.steps = {t.steps} must be at least 1"),
        (t.grad_clip >= 0, f"train.grad_clip = {t.grad_clip} must not be negative (0 disables clipping)"),
        (t.eval_every >= 0, f"train.eval_every = {t.eval_every} must not be negative (0 disables evaluation)"),
        (t.eval_batches >= 1, f"train.eval_batches = {t.eval_batches} must be at least 1"),
        (t.seed >= 0,
         f"train.seed = {t.seed} must not be negative (NumPy's generators take only non-negative seeds)"),
    ])


def _optim_problems(o: OptimConfig) -> list[str]:
    betas_ok = len(o.betas) == 2 and all(isinstance(b, (int, float)) and 0 <= b < 1 for b in o.betas)
    return _failed([
        (o.lr > 0, f"optim.lr = {o.lr} must be positive"),
        (o.weight_decay >= 0, f"optim.weight_decay = {o.weight_decay} must not be negative"),
        (o.eps > 0, f"optim.eps = {o.eps} must be positive"),
        (o.momentum >= 0, f"optim.momentum = {o.momentum} must not be negative"),
        (betas_ok, f"optim.betas = {o.betas} must be two numbers in [0, 1)"),
        (o.warmup_steps >= 0, f"optim.warmup_steps = {o.warmup_steps} must not be negative"),
        (0.0 <= o.min_lr_ratio <= 1.0, f"optim.min_lr_ratio = {o.min_lr_ratio} must be in [0, 1]"),
        (o.reference_batch >= 1, f"optim.reference_batch = {o.reference_batch} must be at least 1"),
    ])


def _parallel_problems(p: ParallelConfig) -> list[str]:
    """Degrees, bucket and prefetch sizes: ranges only (whether the degrees fit a world
    size is ``ParallelDims``'s question)."""
    at_least_one = [(getattr(p, key) >= 1, f"parallel.{key} = {getattr(p, key)} must be at least 1")
                    for key in ("tp", "cp", "pp", "ep", "pp_virtual_stages", "ac_every")]
    derived = [(getattr(p, key) >= 0, f"parallel.{key} = {getattr(p, key)} must not be negative (0 derives it)")
               for key in ("dp_replicate", "dp_shard")]
    prefetch = [(getattr(p, key) >= 0,
                 f"parallel.{key} = {getattr(p, key)} must not be negative (0 keeps FSDP2's default)")
                for key in ("forward_prefetch", "backward_prefetch")]
    styles = ", ".join(f"'{s}'" for s in TP_STYLES)
    plan = [(isinstance(style, str) and style in TP_STYLES, f"parallel.tp_plan: '{pattern}' = {style!r} is not one "
             f"of {styles}") for pattern, style in p.tp_plan.items()]
    return _failed([
        *derived, *at_least_one, *prefetch, *plan,
        (p.microbatches >= 0, f"parallel.microbatches = {p.microbatches} must not be negative (0 uses parallel.pp)"),
        (not p.cpu_offload or p.strategy == "fsdp",
         f"parallel.cpu_offload = true offloads FSDP's shards, but parallel.strategy = '{p.strategy}'; set "
         "parallel.strategy = 'fsdp' (or cpu_offload = false)"),
        (all(isinstance(n, str) and n.strip() for n in p.fsdp_units),
         f"parallel.fsdp_units = {p.fsdp_units} must list module class names, e.g. [\"Block\"] (empty finds them)"),
        # DDP turns the size into a byte count held in 64 bits; no bucket needs more than 1 TiB.
        (0 < p.bucket_mb <= 2 ** 20,
         f"parallel.bucket_mb = {p.bucket_mb} must be positive and at most 1048576 (1 TiB)"),
    ])


def _pipeline_problems(p: ParallelConfig) -> list[str]:
    """Schedules and stage splits: which schedules run several stages per rank."""
    stages = p.pp * p.pp_virtual_stages
    split_ok = all(isinstance(n, int) and n >= 1 for n in p.pp_split) and len(p.pp_split) == stages
    return _failed([
        (not (p.pp > 1 and p.pp_schedule in ("interleaved1f1b", "zerobubble") and p.pp_virtual_stages < 2),
         f"parallel.pp_schedule = '{p.pp_schedule}' runs several stages per rank; set parallel.pp_virtual_stages "
         "to 2 or more (or use 'gpipe' / '1f1b')"),
        (not (p.pp > 1 and p.pp_schedule in ("gpipe", "1f1b") and p.pp_virtual_stages != 1),
         f"parallel.pp_virtual_stages = {p.pp_virtual_stages} needs parallel.pp_schedule = "
         "'interleaved1f1b' or 'zerobubble'; 'gpipe' and '1f1b' run one stage per rank"),
        (not p.pp_split or split_ok,
         f"parallel.pp_split = {p.pp_split} must list one positive block count per stage "
         f"({stages} stages = pp x pp_virtual_stages)"),
    ])


def _comm_problems(c: CommConfig, p: ParallelConfig) -> list[str]:
    """Gradient-compression options: ranges, and compression only where DDP syncs gradients."""
    return _failed([
        (c.warmup_steps >= 0, f"comm.warmup_steps = {c.warmup_steps} must not be negative"),
        (c.powersgd_rank >= 1, f"comm.powersgd_rank = {c.powersgd_rank} must be at least 1"),
        (0.0 < c.topk_ratio <= 1.0, f"comm.topk_ratio = {c.topk_ratio} must be in (0, 1]"),
        (not (c.compression == "powersgd" and 0 <= c.warmup_steps < 2),
         f"comm.warmup_steps = {c.warmup_steps} is too short for comm.compression = 'powersgd': PyTorch's "
         "PowerSGD needs at least 2 uncompressed steps (DDP regroups its buckets after the first); use 2 or more"),
        (c.compression == "none" or p.strategy != "fsdp",
         f"comm.compression = '{c.compression}' does not apply to parallel.strategy = 'fsdp': compression "
         "is a DDP communication hook on the gradient all-reduce, and FSDP reduce-scatters sharded "
         "gradients instead; use parallel.strategy = 'ddp' or 'zero1' to compress, or keep fsdp with "
         "comm.compression = 'none' (precision.reduce_fp32 = false halves FSDP's reduce traffic in bf16)"),
    ])


def _combination_problems(p: ParallelConfig, c: CommConfig, d: DataConfig) -> list[str]:
    """Strategies, compression and sequence lengths that tensor or pipeline parallelism rules out."""
    return _failed([
        (not (p.pp > 1 and c.compression != "none"),
         f"comm.compression = '{c.compression}' is not supported with parallel.pp > 1"),
        (not (p.tp > 1 and p.pp == 1 and p.strategy == "ddp" and c.compression != "none"),
         f"comm.compression = '{c.compression}' does not combine with parallel.tp = {p.tp}: DDP cannot "
         "wrap a tensor-parallel model, so 'ddp' replicates it with FSDP2 (or, when every rank is "
         "tensor-parallel, has nothing to replicate), and no DDP communication hook runs; use "
         "comm.compression = 'none' (or parallel.tp = 1 to compress)"),
        (not (p.tp > 1 and p.cp == 1 and d.seq_len % p.tp and p.sequence_parallel),
         f"data.seq_len = {d.seq_len} is not divisible by parallel.tp = {p.tp} (sequence parallelism splits "
         "the sequence); change one or set parallel.sequence_parallel = false"),
        # Under context parallelism each rank holds seq_len / cp tokens, and those are what
        # sequence parallelism splits over tp (a length cp does not divide is named apart).
        (not (p.tp > 1 and p.cp > 1 and d.seq_len % p.cp == 0 and (d.seq_len // p.cp) % p.tp
              and p.sequence_parallel),
         f"data.seq_len / parallel.cp = {d.seq_len} / {p.cp} = {d.seq_len // max(p.cp, 1)} tokens per rank are not "
         f"divisible by parallel.tp = {p.tp} (sequence parallelism splits each rank's part of the sequence); use a "
         f"data.seq_len that is a multiple of {math.lcm(2 * p.cp, p.cp * p.tp)}, or set parallel.sequence_parallel = "
         "false"),
        (not (p.tp > 1 and p.strategy == "zero1"),
         "parallel.strategy = 'zero1' does not combine with parallel.tp > 1; use 'fsdp' (FSDP x TP)"),
        (not (p.pp > 1 and p.strategy == "zero1"),
         "parallel.strategy = 'zero1' does not combine with parallel.pp > 1; use 'ddp' or 'fsdp'"),
    ]) + _context_parallel_problems(p, d)


def _context_parallel_problems(p: ParallelConfig, d: DataConfig) -> list[str]:
    """What context parallelism needs: gradients reduced over its ranks, whole chunks, no pipeline."""
    if p.cp <= 1:
        return []
    return _failed([
        (p.strategy in ("fsdp", "ddp"),
         f"parallel.cp = {p.cp} needs the gradients of the context-parallel ranks reduced together, which "
         f"parallel.strategy = '{p.strategy}' does not do; use 'fsdp' (sharded over dp_shard x cp) or 'ddp'"),
        (d.seq_len % (2 * p.cp) == 0,
         f"data.seq_len = {d.seq_len} is not divisible by 2 x parallel.cp = {2 * p.cp} (each sequence is cut "
         f"into 2 x cp chunks, two per rank); use a multiple of {2 * p.cp}"),
        (p.pp == 1,
         f"parallel.cp = {p.cp} does not combine with parallel.pp = {p.pp}; use one of them"),
    ])


def fused_loss_problems(t: TrainConfig, m: ModelConfig, p: ParallelConfig) -> list[str]:
    """``train.fused_linear_loss`` needs a model whose forward computes the loss from its
    hidden states (meshyard's GPT) and a whole head on each rank (a builder's model is
    checked when it is built)."""
    if not t.fused_linear_loss:
        return []
    return _failed([
        (m.name not in ("mlp", "hf"),
         f"train.fused_linear_loss = true needs meshyard's GPT (a preset or 'gpt'), whose forward computes the "
         f"loss from its hidden states; model.name = '{m.name}' returns logits only: set train.fused_linear_loss "
         "= false"),
        (p.tp == 1,
         f"train.fused_linear_loss = true does not combine with parallel.tp = {p.tp}: tensor parallelism splits "
         "the output head over the vocabulary (its loss runs under loss parallelism instead); set "
         "train.fused_linear_loss = false or parallel.tp = 1"),
        (p.pp == 1,
         f"train.fused_linear_loss = true does not combine with parallel.pp = {p.pp}: the pipeline's last stage "
         "computes the loss from the logits; set train.fused_linear_loss = false or parallel.pp = 1"),
    ])


def _moe_problems(m: ModelConfig) -> list[str]:
    """Experts, top-k, capacity and router-loss weights: ranges, and a model that has experts."""
    if m.moe_experts == 0:
        return []
    return _failed([
        (m.moe_experts > 0, f"model.moe_experts = {m.moe_experts} must not be negative (0 keeps the dense "
         "feed-forward)"),
        (1 <= m.moe_top_k <= max(m.moe_experts, 1),
         f"model.moe_top_k = {m.moe_top_k} must be between 1 and model.moe_experts = {m.moe_experts}"),
        (m.moe_shared_experts >= 0, f"model.moe_shared_experts = {m.moe_shared_experts} must not be negative"),
        (m.moe_capacity_factor >= 0,
         f"model.moe_capacity_factor = {m.moe_capacity_factor} must not be negative (0 is dropless)"),
        (m.moe_aux_loss_weight >= 0 and m.moe_z_loss_weight >= 0,
         "model.moe_aux_loss_weight and model.moe_z_loss_weight must not be negative"),
    ])


def _expert_parallel_problems(m: ModelConfig, p: ParallelConfig) -> list[str]:
    """What expert parallelism needs (experts to split, FSDP), and what MoE does not combine
    with: context parallelism (router losses on parts of sequences) and pipelining (the
    router losses of early stages would not reach the loss in the last one). Tensor
    parallelism combines: it splits the dense parts, and every tp rank routes the same
    tokens through whole experts (``parallel.tensor_parallel``)."""
    return _failed([
        (p.ep == 1 or m.moe_experts > 0,
         f"parallel.ep = {p.ep} splits experts over ranks, but the model has none; set model.moe_experts "
         "(a multiple of parallel.ep) or parallel.ep = 1"),
        (p.ep < 1 or m.moe_experts <= 0 or m.moe_experts % p.ep == 0,
         f"model.moe_experts = {m.moe_experts} is not divisible by parallel.ep = {p.ep}: each expert-parallel "
         "rank holds the same number of experts; change one of them"),
        (p.ep == 1 or p.strategy == "fsdp",
         f"parallel.ep = {p.ep} needs parallel.strategy = 'fsdp' (got '{p.strategy}'): the expert weights differ "
         "between the ranks of an expert-parallel group, and only FSDP can sync them over the other ranks apart "
         "from the dense ones; set parallel.strategy = 'fsdp'"),
        (not (m.moe_experts > 0 and p.cp > 1),
         f"model.moe_experts = {m.moe_experts} does not combine with parallel.cp = {p.cp}: the router losses "
         "would be computed on each rank's part of a sequence rather than on whole micro-batches; use fsdp with "
         "parallel.ep instead"),
        (not (m.moe_experts > 0 and p.pp > 1),
         f"model.moe_experts = {m.moe_experts} does not combine with parallel.pp = {p.pp}: the router losses of "
         "the early stages would not reach the loss computed in the last one; use fsdp with parallel.ep instead"),
    ])


def _precision_problems(p: PrecisionConfig) -> list[str]:
    return _failed([
        (p.loss_scale_growth_interval >= 1,
         f"precision.loss_scale_growth_interval = {p.loss_scale_growth_interval} must be at least 1"),
    ])


def _checkpoint_problems(c: CheckpointConfig) -> list[str]:
    return _failed([
        (c.interval >= 0, f"checkpoint.interval = {c.interval} must not be negative"),
        (c.interval_minutes >= 0, f"checkpoint.interval_minutes = {c.interval_minutes} must not be negative"),
        (c.keep_last >= 1, f"checkpoint.keep_last = {c.keep_last} must be at least 1"),
    ])


def _fault_problems(f: FaultConfig) -> list[str]:
    signals = [(name in SIGNALS, f"fault.signals: '{name}' is not one of {', '.join(SIGNALS)}")
               for name in f.signals]
    return _failed([
        (f.max_restarts >= 0, f"fault.max_restarts = {f.max_restarts} must not be negative"),
        (f.max_requeues >= 0, f"fault.max_requeues = {f.max_requeues} must not be negative (0 never requeues)"),
        (f.grace_period_s > 0, f"fault.grace_period_s = {f.grace_period_s} must be positive"),
        # Process groups hold their timeout as a timedelta, which overflows far beyond any useful wait.
        (0 < f.collective_timeout_s <= 365 * 86400,
         f"fault.collective_timeout_s = {f.collective_timeout_s} must be positive and at most a year (31536000)"),
        *signals,
        (f.hang_timeout_s >= 0, f"fault.hang_timeout_s = {f.hang_timeout_s} must not be negative"),
        (f.startup_timeout_s >= 0,
         f"fault.startup_timeout_s = {f.startup_timeout_s} must not be negative (0 disables it)"),
    ])


def _guard_problems(g: GuardConfig, c: CheckpointConfig) -> list[str]:
    return _failed([
        (g.window >= 3, f"guard.window = {g.window} must be at least 3 (a median and a spread need several losses)"),
        (g.warmup_steps >= 0, f"guard.warmup_steps = {g.warmup_steps} must not be negative"),
        (g.spike_mads > 0, f"guard.spike_mads = {g.spike_mads} must be positive"),
        (g.bad_in_a_row >= 1, f"guard.bad_in_a_row = {g.bad_in_a_row} must be at least 1"),
        (g.snapshot_every >= 0, f"guard.snapshot_every = {g.snapshot_every} must not be negative (0 rolls back "
                                "to the newest checkpoint)"),
        (not (g.enabled and g.snapshot_every == 0) or c.enabled,
         "guard.snapshot_every = 0 rolls back to the newest checkpoint of the run, but checkpoint.enabled = false; "
         "enable checkpoints or keep host snapshots (guard.snapshot_every >= 1)"),
        (g.max_rollbacks >= 0, f"guard.max_rollbacks = {g.max_rollbacks} must not be negative"),
        (0 < g.lr_factor <= 1, f"guard.lr_factor = {g.lr_factor} must be in (0, 1]"),
        (g.lr_steps >= 0, f"guard.lr_steps = {g.lr_steps} must not be negative"),
    ])


def _metrics_problems(m: MetricsConfig) -> list[str]:
    return _failed([
        (m.log_every >= 1, f"metrics.log_every = {m.log_every} must be at least 1"),
        (m.gather_every >= 0, f"metrics.gather_every = {m.gather_every} must not be negative"),
        (m.straggler_factor > 1.0, f"metrics.straggler_factor = {m.straggler_factor} must be above 1 (e.g. 1.25)"),
        (0 <= m.prometheus_port < 65536,
         f"metrics.prometheus_port = {m.prometheus_port} is not a port number (0-65535)"),
        (not m.wandb or bool(m.wandb_project.strip()), "metrics.wandb_project must name a project with metrics.wandb"),
        (m.waste_window >= 1, f"metrics.waste_window = {m.waste_window} must be at least 1"),
        (0 < m.idle_gpu_util <= 1, f"metrics.idle_gpu_util = {m.idle_gpu_util} must be in (0, 1] (e.g. 0.5)"),
        (1 <= m.idle_span_steps <= m.waste_window,
         f"metrics.idle_span_steps = {m.idle_span_steps} must be between 1 and metrics.waste_window "
         f"({m.waste_window})"),
        (0 < m.data_stall_share < 1, f"metrics.data_stall_share = {m.data_stall_share} must be in (0, 1)"),
        (0 < m.exposed_comm_share < 1, f"metrics.exposed_comm_share = {m.exposed_comm_share} must be in (0, 1)"),
    ])


def profile_window(m: MetricsConfig) -> tuple[int, int] | None:
    """``metrics.profile_steps`` as (first, last), or None when empty or not two whole steps."""
    steps = m.profile_steps
    if len(steps) != 2 or not all(isinstance(s, int) and not isinstance(s, bool) for s in steps):
        return None
    return steps[0], steps[1]


def _profile_problems(m: MetricsConfig, t: TrainConfig) -> list[str]:
    if not m.profile_steps:
        return []
    window = profile_window(m)
    if window is None:
        return [f"metrics.profile_steps = {m.profile_steps} is not [first, last]: give two step numbers, e.g. "
                "[20, 22] (or [] to profile nothing)"]
    first, last = window
    return _failed([
        (1 <= first <= last, f"metrics.profile_steps = [{first}, {last}] needs 1 <= first <= last"),
        (first <= t.steps, f"metrics.profile_steps starts at step {first}, after the run's last (train.steps = "
         f"{t.steps}): profile earlier steps, e.g. [{max(1, t.steps - 2)}, {t.steps}]"),
    ])


def _run_problems(r: RunConfig) -> list[str]:
    return _failed([
        (r.nproc >= 0, f"run.nproc = {r.nproc} must not be negative (0 starts one per visible GPU)"),
        (0 <= r.threads_per_rank < 2 ** 31,  # torch.set_num_threads takes a C int
         f"run.threads_per_rank = {r.threads_per_rank} must be in [0, 2147483647]"),
        *(_price_check(f"run.{name}", getattr(r, name)) for name in ("gpu_hour_price", "spot_hour_price")),
    ]) + _node_problems(r)


def _price_check(key: str, price: float) -> tuple[bool, str]:
    return (math.isfinite(price) and price >= 0,
            f"{key} = {price} must be a price of at least 0 US dollars per device-hour (e.g. 2.5); "
            "0 takes the price table's price for the GPU model")


CACHE_SCHEMES = ("redis://", "rediss://", "unix://")
"""How a Redis prediction cache's URL may begin (besides 'memory' and 'off')."""


SERVE_DEVICE = re.compile(r"auto|cpu|cuda(:\d+)?")
"""What serve.device may say (whether that device exists is asked when the server loads a model)."""


def _serve_problems(s: ServeConfig) -> list[str]:
    """Ranges of the server's settings; whether the models exist is 'meshyard serve''s question."""
    cache_ok = s.cache in ("memory", "off") or s.cache.startswith(CACHE_SCHEMES)
    return _failed([
        (bool(s.host.strip()), "serve.host is empty; give an address to bind, e.g. 127.0.0.1 (or 0.0.0.0 in a pod)"),
        (0 <= s.port < 65536, f"serve.port = {s.port} is not a port number (0-65535; 0 takes a free one)"),
        (s.max_batch_size >= 1, f"serve.max_batch_size = {s.max_batch_size} must be at least 1 (1 turns batching off)"),
        (0 <= s.max_wait_ms <= 60_000, f"serve.max_wait_ms = {s.max_wait_ms} must be in [0, 60000] milliseconds"),
        (s.max_queue >= 1, f"serve.max_queue = {s.max_queue} must be at least 1"),
        (s.request_timeout_s > 0, f"serve.request_timeout_s = {s.request_timeout_s} must be positive"),
        (s.max_new_tokens >= 1, f"serve.max_new_tokens = {s.max_new_tokens} must be at least 1"),
        (s.max_body_bytes >= 1024, f"serve.max_body_bytes = {s.max_body_bytes} must be at least 1024 (a small "
         "request's JSON)"),
        (s.read_timeout_s > 0, f"serve.read_timeout_s = {s.read_timeout_s} must be positive (seconds a client "
         "has to send a request)"),
        (s.max_connections >= 1, f"serve.max_connections = {s.max_connections} must be at least 1"),
        (s.keep_alive_timeout_s > 0,
         f"serve.keep_alive_timeout_s = {s.keep_alive_timeout_s} must be positive (seconds an idle connection is kept)"),
        (isinstance(s.device, str) and SERVE_DEVICE.fullmatch(s.device) is not None,
         f"serve.device = '{s.device}' is not 'auto', 'cpu', 'cuda' or 'cuda:N' (N a device index, e.g. cuda:0)"),
        (s.memory_budget_bytes >= 0,
         f"serve.memory_budget_bytes = {s.memory_budget_bytes} must not be negative (0 means no limit)"),
        (all(isinstance(n, str) and n.strip() for n in s.pinned),
         f"serve.pinned = {s.pinned} must list served model names, e.g. [\"tiny\"]"),
        (cache_ok, f"serve.cache = '{s.cache}' is not 'memory', 'off' or a Redis URL such as "
         "redis://127.0.0.1:6379/0"),
        (s.cache_entries >= 1, f"serve.cache_entries = {s.cache_entries} must be at least 1"),
        (s.cache_ttl_s >= 0, f"serve.cache_ttl_s = {s.cache_ttl_s} must not be negative (0 keeps entries until "
         "Redis evicts them)"),
        (0 <= s.threads < 2 ** 31, f"serve.threads = {s.threads} must be in [0, 2147483647] (0: torch's default)"),
        (bool(s.chat_template) or not s.chat_template_overrides,
         "serve.chat_template_overrides = true needs serve.chat_template, the path of the Jinja template that "
         "replaces the models' own"),
    ])


DEFAULT_RDZV_PORT = 29400
"""The rendezvous port when run.rdzv_endpoint names none (torchrun's default)."""


def node_range(nnodes: str) -> tuple[int, int] | None:
    """``"N"`` -> (N, N) and ``"MIN:MAX"`` -> (MIN, MAX); None when it is neither."""
    low, colon, high = str(nnodes).strip().partition(":")
    try:
        bounds = int(low), int(high if colon else low)  # '2:' is a range missing its end, not '2'
    except ValueError:
        return None
    return bounds if 1 <= bounds[0] <= bounds[1] else None


def split_endpoint(endpoint: str) -> tuple[str, int]:
    """``HOST[:PORT]`` (``[v6]:PORT`` for IPv6) -> (host, port); ValueError when malformed."""
    text = endpoint.strip()
    if text.startswith("["):
        host, _, rest = text[1:].partition("]")
        if rest and not rest.startswith(":"):
            raise ValueError(endpoint)
        port = rest[1:] if rest else None
        ipaddress.IPv6Address(host)  # ValueError unless an IPv6 address stands in the brackets
    elif text.count(":") == 1:
        host, port = text.split(":")
    else:  # no port, or a bare IPv6 address
        host, port = text, None
        if ":" in host:
            ipaddress.IPv6Address(host)
    number = DEFAULT_RDZV_PORT if port is None else int(port)  # 'host:' has an empty port: an error
    if not host or not 0 < number < 65536:
        raise ValueError(endpoint)
    return host, number


def _node_problems(r: RunConfig) -> list[str]:
    bounds = node_range(r.nnodes)
    if bounds is None:
        return [f"run.nnodes = '{r.nnodes}' is neither a node count ('2') nor a range 'MIN:MAX' ('1:4') of "
                "positive counts"]
    problems = []
    if r.rdzv_endpoint:
        try:
            split_endpoint(r.rdzv_endpoint)
        except ValueError:
            problems.append(f"run.rdzv_endpoint = '{r.rdzv_endpoint}' is not HOST[:PORT] (e.g. 10.0.0.1:29400, "
                            "[fd00::1]:29400) with a port in 1-65535")
    elif bounds[1] > 1:
        problems.append(f"run.nnodes = '{r.nnodes}' needs run.rdzv_endpoint (--rdzv-endpoint HOST:PORT): an "
                        "address of one of the nodes that every node reaches")
    if r.node_rank >= 0 and bounds[0] != bounds[1]:
        problems.append(f"run.node_rank = {r.node_rank} fixes the nodes' ranks, which an elastic range "
                        f"run.nnodes = '{r.nnodes}' cannot keep; leave run.node_rank at -1")
    elif r.node_rank >= bounds[1]:
        problems.append(f"run.node_rank = {r.node_rank} must be below run.nnodes = {bounds[1]}")
    return problems + _failed([
        (r.rdzv_timeout_s >= 1, f"run.rdzv_timeout_s = {r.rdzv_timeout_s} must be at least 1 (seconds)"),
        (r.rdzv_last_call_s >= 0, f"run.rdzv_last_call_s = {r.rdzv_last_call_s} must not be negative"),
    ])


SECTION_CHECKS: dict[str, Callable[[Any], list[str]]] = {
    "serve": _serve_problems,
}
"""Sections a command reads alone (``section_problems``), with the checks that need only that section."""
