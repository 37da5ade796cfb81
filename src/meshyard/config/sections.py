"""Typed configuration sections.

Every field carries a one-line description in its metadata (``doc``); those lines are
what ``meshyard config show`` prints as comments and what validation quotes. Each
component of meshyard receives only its own section, never the whole ``Config``.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Literal

from meshyard.run_dir import RunDir


def option(default: Any, doc: str, **kwargs: Any) -> Any:
    """A dataclass field with its documentation attached."""
    if isinstance(default, (list, dict)):
        return field(default_factory=lambda: type(default)(default), metadata={"doc": doc, **kwargs})
    return field(default=default, metadata={"doc": doc, **kwargs})


@dataclass
class ModelConfig:
    """Which network to train."""

    name: str = option(
        "gpt-mini",
        "Preset (gpt-tiny, gpt-mini, gpt-small, gpt-medium, gpt2-124m), 'gpt' for a custom "
        "size, 'mlp', 'hf' (a Hugging Face causal LM built from the config.json of the folder in model.init_from), "
        "or your own builder as 'package.module:function' or 'path/file.py:function'.",
    )
    init_from: str = option(
        "", "Start training (at step 0, with a fresh optimizer) from these weights: a Hugging Face model folder "
        "(config.json and *.safetensors; meshyard's GPT reads GPT2LMHeadModel folders), a meshyard run directory "
        "or checkpoint, or a .safetensors file of 'meshyard ckpt export' / 'meshyard export'. Each rank reads "
        "only its own shards and stages. A run resuming its own checkpoint ignores it. Empty: random weights.",
    )
    n_layer: int = option(0, "Transformer blocks (MLP: hidden layers); 0 keeps the preset's value.")
    n_head: int = option(0, "Attention heads; 0 keeps the preset's value.")
    d_model: int = option(0, "Hidden width; 0 keeps the preset's value.")
    context_length: int = option(0, "Longest sequence the model accepts; 0 uses data.seq_len.")
    vocab_size: int = option(0, "Vocabulary size; 0 takes it from the data's tokenizer.")
    pad_vocab_multiple: int = option(
        0, "Round the model's vocabulary up to a multiple of this (64 suits GPU matmuls and tensor parallelism); "
        "the padded ids never occur in the data and are never sampled when serving. 0 keeps it as it is.")
    dropout: float = option(0.0, "Dropout probability in attention and MLP outputs.")
    tie_embeddings: bool = option(True, "Share the token embedding with the output head (GPT-2 style).")
    no_dropout: bool = option(
        False, "Switch off every dropout of the built model, a custom model's own rates included (nn.Dropout "
        "modules, dropout attributes of its modules and of its Hugging Face config); meshyard verify sets it.")
    options: dict = option({}, "Extra keyword arguments passed to a custom builder function.")
    moe_experts: int = option(
        0, "Mixture of experts (meshyard's GPT): routed experts in every block's feed-forward, each as wide as the "
        "dense one; 0 keeps the dense feed-forward.")
    moe_top_k: int = option(2, "Experts each token is routed to (token-choice top-k; with more than one, their weights are "
                           "renormalised to sum to 1; top-1 keeps the router probability, its only gradient).")
    moe_shared_experts: int = option(
        0, "Experts every token passes through besides its routed ones (one feed-forward this many times wider).")
    moe_capacity_factor: float = option(
        0.0, "Tokens an expert takes per training micro-batch, as a multiple of an even share (tokens x top_k / "
        "experts), first choices before second ones; the tokens beyond it skip the expert (dropped, counted in "
        "the records). 0 is dropless: no limit. Evaluation and inference are always dropless.")
    moe_aux_loss_weight: float = option(
        0.01, "Weight of the load-balancing loss (Switch Transformer's: experts x sum of each expert's share of "
        "tokens times its mean router probability; 1 when balanced) added to the training loss.")
    moe_z_loss_weight: float = option(
        0.001, "Weight of the router z-loss (mean squared log-sum-exp of the router logits, ST-MoE's) added to the "
        "training loss; it keeps the router logits small.")


@dataclass
class DataConfig:
    """Where tokens come from and how they are cut into samples."""

    source: str = option(
        "stdlib",
        "'stdlib' (this Python's standard-library sources, no download), 'text' (files in "
        "data.paths), 'tokens' (pre-tokenized .npy/.bin in data.paths), 'shards' (a corpus written by "
        "'meshyard data prepare' at data.url), 'random', or your own dataset builder as 'module:function' / "
        "'file.py:function'.",
    )
    paths: list = option([], "Files or glob patterns for the 'text' and 'tokens' sources: for 'text', .txt files "
                         "(each a document) and .jsonl files (each record a document, its data.text_field).")
    tokenizer: str = option(
        "bytes", "How the 'text' and 'stdlib' sources become tokens: 'bytes' (one token per UTF-8 byte), "
        "'bpe:N' (a byte-level BPE of N tokens trained once on the files, cached by their digest), or the path "
        f"of a Hugging Face tokenizer (a {RunDir.TOKENIZER} file or a folder holding one). The run directory keeps "
        f"a copy ({RunDir.TOKENIZER}), which 'meshyard serve' and exports encode and decode text with.",
    )
    text_field: str = option("text", "The field of each .jsonl record that holds its text.")
    token_dtype: Literal["uint8", "uint16", "uint32", "int32", "int64"] = option(
        "uint16", "Element type of raw .bin token files."
    )
    vocab_size: int = option(0, "Vocabulary of the 'tokens'/'random' sources; 0 infers it from the data.")
    seq_len: int = option(128, "Tokens per training sample.")
    val_fraction: float = option(0.02, "Share of samples held out for evaluation (taken from the end).")
    max_tokens: int = option(0, "Use at most this many tokens of the corpus; 0 uses all.")
    random_tokens: int = option(1_048_576, "Corpus length of the 'random' source.")
    num_workers: int = option(0, "Loader worker processes per rank (0 loads in the training process).")
    prefetch_factor: int = option(2, "Batches each loader worker prepares ahead (needs num_workers > 0).")
    cache_dir: str = option("", "Where tokenized corpora are cached; empty uses ~/.cache/meshyard.")
    url: str = option("", "For data.source = 'shards': the folder or fsspec URL (s3://, gs://) that "
                      "'meshyard data prepare' wrote.")
    cache_bytes: int = option(1 << 30, "For data.source = 'shards': the most bytes of shards each rank keeps in its "
                              "local cache (under data.cache_dir), evicting the least recently used.")
    shuffle_span_shards: int = option(
        2, "For data.source = 'shards': samples are shuffled within spans of this many consecutive shards, and the "
        "spans into a new order every epoch; each lane of the global batch (data.shuffle_lanes) reads its own "
        "stretch of spans, one span at a time. Larger spans mix samples from further apart and need a larger "
        "cache. 0 shuffles over the whole corpus, as the other sources do: a rank then fetches a shard for nearly "
        "every sample.")
    shuffle_lanes: int = option(
        0, "For data.source = 'shards' read in spans: how many stretches of the corpus every global batch draws "
        "from side by side, each global batch / lanes samples in a row; a divisor of train.global_batch, 0 takes "
        "its largest divisor up to 64. A rank fetches only its share of the corpus when the data-parallel size "
        "divides it, and holds about (lanes / data-parallel size + 1) x (shuffle_span_shards + 1) shards at once "
        "(a warning at start says when data.cache_bytes holds fewer). Part of the sample order: keep it when "
        "resuming.")
    storage_options: dict = option({}, "For data.source = 'shards': fsspec options of data.url's storage, e.g. "
                                   "{ client_kwargs = { endpoint_url = \"http://...\" } }; credentials are best "
                                   "left to the environment.")


@dataclass
class TrainConfig:
    """Steps, batch arithmetic, evaluation and reproducibility."""

    steps: int = option(200, "Optimizer steps to run.")
    global_batch: int = option(32, "Samples per optimizer step across all data-parallel ranks.")
    micro_batch: int = option(0, "Samples per forward/backward on one rank; 0 derives it from grad_accum.")
    grad_accum: int = option(0, "Micro-steps accumulated per optimizer step; 0 derives it from micro_batch.")
    grad_clip: float = option(1.0, "Clip gradients to this global L2 norm; 0 disables clipping.")
    eval_every: int = option(50, "Evaluate on the held-out split every this many steps; 0 disables.")
    eval_batches: int = option(4, "Micro-batches per rank in each evaluation.")
    seed: int = option(1234, "Seed for model initialisation, data order and dropout.")
    deterministic: bool = option(False, "Use deterministic kernels only (slower, bit-reproducible).")
    compile: Literal["auto", True, False] = option(
        "auto", "torch.compile the model: the model and its loss as one region on one rank without model "
        "parallelism, each transformer block under DDP, FSDP, TP and PP. 'auto' compiles on CUDA and not on CPU "
        "(a first compile costs tens of seconds) and trains a model that does not compile eagerly, with one "
        "warning; true compiles everywhere and stops at the first step if the model does not compile.")
    compile_tuning: bool = option(
        False, "Tune the launch of every Triton kernel torch.compile generates (Inductor's coordinate-descent "
        "tuning of block sizes and warps; CUDA): steps may run faster, and the first compile takes about twice "
        "as long (GPT-2 124M on an H100: 72 s against 32 s to the first step). No effect when nothing compiles.")
    cuda_graphs: bool = option(
        False, "Replay the compiled forward and backward of the model and its loss as CUDA graphs (torch.compile's "
        "CUDAGraph trees, what mode 'reduce-overhead' turns on): the GPU no longer idles between kernels while "
        "the host launches them. Needs a CUDA device, train.compile not false, the model and its loss compiled as "
        "one region (one rank: no DDP, FSDP, TP or PP) and one micro-batch per step (train.grad_accum = 1). The "
        "graphs' memory pool comes on top of the eager peak; 'auto' on a machine without CUDA trains without them.")
    fused_linear_loss: bool = option(
        False, "Compute the output head and the cross-entropy together, a block of tokens at a time, so the (tokens "
        "x vocabulary) logits never exist whole: the loss holds one block's logits and fp32 gradients of the hidden "
        "states and the head's weight instead of three logit-sized fp32 tensors (see "
        "meshyard.models.linear_cross_entropy; 'meshyard plan' counts it). The same losses and gradients within "
        "rounding; the step breakdown counts the head's gradient in the forward. meshyard's GPT models; not with "
        "parallel.tp > 1 (the head is split over the vocabulary there) or parallel.pp > 1.")


@dataclass
class OptimConfig:
    """Optimizer, learning-rate schedule and batch-size scaling."""

    name: Literal["adamw", "sgd"] = option("adamw", "Optimizer: 'adamw' or 'sgd'.")
    lr: float = option(3e-3, "Peak learning rate at the reference batch size.")
    weight_decay: float = option(0.1, "Decoupled weight decay (AdamW) or L2 penalty (SGD).")
    betas: list = option([0.9, 0.95], "AdamW beta1 and beta2.")
    eps: float = option(1e-8, "AdamW epsilon.")
    momentum: float = option(0.9, "SGD momentum.")
    warmup_steps: int = option(20, "Steps of linear warmup from 0 to the peak learning rate.")
    schedule: Literal["cosine", "constant"] = option("cosine", "Shape after warmup: 'cosine' decay or 'constant'.")
    min_lr_ratio: float = option(0.1, "Cosine floor as a fraction of the peak learning rate.")
    lr_scaling: Literal["none", "linear", "sqrt"] = option(
        "none", "Scale lr with global_batch / reference_batch: 'none', 'linear' or 'sqrt'."
    )
    reference_batch: int = option(32, "Global batch at which optim.lr was tuned (for lr_scaling).")


@dataclass
class ParallelConfig:
    """How the model and the batch are spread over ranks."""

    strategy: Literal["ddp", "fsdp", "zero1", "none"] = option(
        "ddp",
        "'ddp' (replicate), 'fsdp' (FSDP2 sharding: ZeRO-3, or ZeRO-2 with reshard_after_forward "
        "= false; HSDP when dp_replicate > 1), 'zero1' (DDP + sharded optimizer) or 'none' (no data parallelism: one rank, or tp x pp ranks).",
    )
    dp_replicate: int = option(0, "Replicated data-parallel degree; 0 derives it from the world size.")
    dp_shard: int = option(0, "Sharded data-parallel degree (fsdp); 0 derives it from the world size.")
    reshard_after_forward: bool = option(
        True, "fsdp: free gathered parameters after forward (ZeRO-3); false keeps them (ZeRO-2)."
    )
    bucket_mb: float = option(25.0, "DDP gradient bucket size in MiB.")
    gradient_as_bucket_view: bool = option(
        True, "ddp/zero1: gradients are views into the communication buckets (saves one gradient-sized copy)."
    )
    static_graph: bool = option(
        False, "ddp/zero1: promise the same parameters get gradients every step, letting DDP skip per-step checks."
    )
    forward_prefetch: int = option(
        0, "fsdp: explicitly prefetch the all-gathers of the next N blocks in forward; 0 keeps FSDP2's implicit overlap."
    )
    backward_prefetch: int = option(
        0, "fsdp: explicitly prefetch the all-gathers of the previous N blocks in backward; 0 keeps FSDP2's default (1)."
    )
    cpu_offload: bool = option(
        False, "fsdp: keep the sharded parameters, gradients and optimizer states in host memory (FSDP2 "
        "CPUOffloadPolicy, pinned on GPUs); each block's parameters are copied to the device for its forward and "
        "backward and the optimizer steps on the CPU: less device memory, slower steps."
    )
    tp: int = option(1, "Tensor-parallel degree: attention heads and MLP split Megatron-style over this many ranks.")
    sequence_parallel: bool = option(
        True, "tp: also split norms and dropout along the sequence (less activation memory, same result); "
        "meshyard's GPT only, other models run without it."
    )
    loss_parallel: bool = option(
        True, "tp: compute the loss on vocabulary-sharded logits instead of gathering them (not under pp)."
    )
    tp_plan: dict = option(
        {}, "tp: how to split a model without a plan of its own (a tensor_parallel_plan(tp_mesh) method; "
        "meshyard's GPT has one): module-name patterns "
        "(globs over qualified names, e.g. 'transformer.h.*.attn.c_attn'; a module takes the first it matches) "
        "mapped to 'colwise', 'rowwise', 'sequence_parallel' (runs as 'replicate') or 'replicate'; unnamed modules "
        "are replicated. Empty uses the built-in plans (GPT-2-style and Llama-style modules, found by name).",
    )
    cp: int = option(
        1, "Context-parallel degree: each sequence is split over this many ranks (ring attention), which read the "
        "same samples; its 2 x cp chunks are dealt so that rank r holds chunks r and 2 x cp - 1 - r, balancing the "
        "causal work. Activation memory per rank falls about 1/cp. Needs strategy 'fsdp' (sharding over dp_shard x "
        "cp) or 'ddp', data.seq_len divisible by 2 x cp, and meshyard's GPT or a Llama-style Hugging Face model."
    )
    ep: int = option(
        1, "Expert-parallel degree (model.moe_experts > 0, strategy 'fsdp'): each group of ep data-parallel ranks "
        "splits the experts between them and exchanges tokens all-to-all; must divide the sharded data-parallel "
        "degree and model.moe_experts. Expert weights are sharded by FSDP over the remaining data-parallel ranks.")
    pp: int = option(1, "Pipeline-parallel degree: the model is cut into this many stages, one group of ranks each.")
    microbatches: int = option(
        0, "pp: pipeline micro-batches per train.micro_batch (must divide it); 0 uses the number of stages."
    )
    pp_schedule: Literal["gpipe", "1f1b", "interleaved1f1b", "zerobubble"] = option(
        "1f1b", "pp: schedule: 'gpipe', '1f1b', 'interleaved1f1b' (pp_virtual_stages per rank) or 'zerobubble'."
    )
    pp_virtual_stages: int = option(
        1, "pp: stages per rank for 'interleaved1f1b'/'zerobubble' (>= 2 there; total stages = pp x this)."
    )
    pp_split: list = option(
        [], "pp: transformer blocks per stage, e.g. [3, 5]; empty balances the blocks by count."
    )
    ac: Literal["none", "full", "selective"] = option(
        "none", "Activation checkpointing: 'none', 'full' (every block) or 'selective' (every ac_every-th block)."
    )
    ac_every: int = option(2, "ac = 'selective': recompute every this many blocks in backward instead of storing.")
    fsdp_units: list = option(
        [], "Class names of the modules to shard (fsdp) and checkpoint (ac) one by one, e.g. [\"Block\"]; "
        "empty finds the repeated block class (the most parameters among classes occurring more than once)."
    )


@dataclass
class PrecisionConfig:
    """Numeric formats of compute, parameters and gradients."""

    dtype: Literal["auto", "fp32", "bf16", "fp16"] = option(
        "auto", "Compute precision; 'auto' is bf16 on GPUs that support it and fp32 on CPU."
    )
    reduce_fp32: bool = option(True, "fsdp: reduce gradients in fp32 even when computing in bf16/fp16.")
    loss_scale_growth_interval: int = option(
        2000, "fp16: steps without inf/NaN gradients before the loss scale doubles (it halves on one that has them)."
    )


@dataclass
class CommConfig:
    """Gradient communication of data-parallel training (DDP and ZeRO-1): compression."""

    compression: Literal["none", "fp16", "bf16", "powersgd", "topk"] = option(
        "none",
        "Gradient compression of ddp/zero1 syncs: 'none', 'fp16' or 'bf16' (cast), 'powersgd' (low rank) "
        "or 'topk' (largest entries only); fsdp accepts only 'none'.",
    )
    warmup_steps: int = option(
        10, "Steps synced uncompressed before compression starts (powersgd needs at least 2)."
    )
    powersgd_rank: int = option(4, "powersgd: rank of the low-rank approximation of each gradient matrix.")
    topk_ratio: float = option(0.01, "topk: share of each bucket's entries sent per step, in (0, 1].")
    error_feedback: bool = option(
        True, "powersgd/topk: keep what compression dropped and add it back next step (keeps convergence)."
    )


@dataclass
class CheckpointConfig:
    """When and where training state is saved, and how much of it is kept."""

    enabled: bool = option(True, "Save checkpoints (needed for resume, preemption and elastic restarts).")
    interval: int = option(100, "Save every this many steps; 0 disables step-based saving.")
    interval_minutes: float = option(0.0, "Also save when this many minutes passed since the last save; 0 disables.")
    save_final: bool = option(True, "Save at the end of the run.")
    dir: str = option("", "Local path or fsspec URL (s3:// with meshyard[s3], memory://); empty uses "
                      f"<run dir>/{RunDir.CHECKPOINTS}.")
    storage_options: dict = option(
        {}, "fsspec options for remote storage, e.g. { client_kwargs = { endpoint_url = '...' } } for S3. "
        f"Credential-like entries (key, secret, token, password, ...) are recorded as '<redacted>' in {RunDir.CONFIG} "
        "and manifests; a run started from such a record takes credentials from the environment or fsspec's "
        "usual sources (AWS_ACCESS_KEY_ID, ~/.aws/credentials, GOOGLE_APPLICATION_CREDENTIALS, ...).",
        secret_entries=True,
    )
    keep_last: int = option(2, "Newest committed checkpoints to keep; older ones go after a newer one commits.")
    keep_best: bool = option(True, "Also keep the checkpoint with the lowest evaluation loss.")
    async_save: bool = option(True, "Write in the background while training continues (at most one in flight).")
    verify_checksums: bool = option(True, "Check every file's SHA-256 against the manifest before resuming.")


@dataclass
class FaultConfig:
    """Preemption and crash handling."""

    max_restarts: int = option(0, "Times the elastic agent restarts the workers after a failure (resuming each time).")
    max_requeues: int = option(
        3, "Times a Slurm job written by 'meshyard slurm' requeues itself after saving on its time-limit or "
        "preemption signal (counted by SLURM_RESTART_COUNT); 0 never requeues.",
    )
    grace_period_s: float = option(60.0, "Seconds from a preemption signal to the forced stop; the save must fit in it.")
    signals: list = option(["SIGTERM", "SIGINT", "SIGUSR1"], "Signals that mean 'save and stop' (on any rank).")
    hang_timeout_s: float = option(
        300.0, "Dump every rank's stacks when a rank makes no progress in a step for this long; 0 disables."
    )
    startup_timeout_s: float = option(
        1800.0, "The same for start-up (data, model, checkpoint load) until the first step; 0 disables."
    )
    hang_abort: bool = option(False, "After a hang dump, exit so an elastic restart (fault.max_restarts) can recover.")
    collective_timeout_s: float = option(
        600.0, "Seconds a collective (and the start-up rendezvous) waits for the slowest rank before failing; "
        "raise it when ranks may legitimately wait longer, e.g. verifying large checkpoints on slow storage.",
    )
    on_nonfinite: Literal["warn", "stop"] = option(
        "warn", "A NaN/inf loss or gradient norm: 'warn' (report step and rank, keep the update, go on) or 'stop' "
        "the run before that update is applied (checked before each optimizer step: one host sync per step on GPUs)."
    )


@dataclass
class GuardConfig:
    """The spike and NaN guard: bad steps are dropped; several in a row roll back and skip their samples."""

    enabled: bool = option(
        False, "Judge every step before its update (one host synchronisation per step on GPUs, as with "
        "fault.on_nonfinite = 'stop'); a bad step's update is dropped.",
    )
    window: int = option(50, "Kept steps whose losses make the running reference (their median and MAD).")
    warmup_steps: int = option(
        20, "Kept steps before a loss spike is judged at all (non-finite values are judged from the first step).")
    spike_mads: float = option(
        6.0, "A loss above median + spike_mads x MAD of the window is a spike (the MAD is floored at 0.1% of "
        "the median, so a flat loss does not make every wobble a spike).",
    )
    bad_in_a_row: int = option(2, "Bad steps in a row that make the run roll back and skip their samples.")
    snapshot_every: int = option(
        10, "Copy model, optimizer and schedule state to host memory every this many steps: where a rollback "
        "returns to. 0 keeps no snapshot: a rollback loads the run's newest checkpoint from before the bad "
        "steps (needs checkpoint.enabled; no host memory, but it goes back as far as checkpoint.interval).",
    )
    max_rollbacks: int = option(3, "Rollbacks allowed in a run; one more stops it with a message.")
    lr_factor: float = option(1.0, "After a rollback, the learning rate is multiplied by this for lr_steps steps.")
    lr_steps: int = option(0, "Steps after a rollback that train at the lowered learning rate (guard.lr_factor).")


@dataclass
class MetricsConfig:
    """What is recorded and shown while training."""

    log_every: int = option(10, "Print a progress line every this many steps when not on a terminal.")
    progress_bar: bool = option(True, "Show a live progress bar on rank 0 when stdout is a terminal.")
    jsonl: bool = option(True, f"Write every step's figures to <run dir>/{RunDir.METRICS}.")
    breakdown: bool = option(True, "Split each step into data, forward, backward, exposed communication, optimizer.")
    gather_every: int = option(10, "Gather every rank's figures to rank 0 every this many steps; 0 disables.")
    straggler_factor: float = option(1.25, "Name a rank whose busy time exceeds the median rank's by this factor.")
    mfu: bool = option(True, "Report model FLOPs utilisation (CPU: against a measured matmul peak).")
    profile_steps: list = option(
        [], f"Steps to record with torch.profiler, [first, last] (e.g. [20, 22]; []: none). Every rank writes "
        f"<run dir>/{RunDir.PROFILE}/rank-<r>.txt (the operators and kernels that took the most time, by device "
        "time on CUDA) and rank-<r>.trace.json (a Chrome trace, for Perfetto or chrome://tracing). Profiled steps "
        "run slower: their records carry profiled = true and the doctor leaves them out. A few steps are enough: "
        "a trace holds every operator and kernel (about 1 MB per step of the default job on the CPU). Once per "
        "run: not for a run resumed past the first step; a guard rollback inside the window ends the profile there.")
    prometheus: bool = option(False, "Serve metrics for Prometheus from rank 0.")
    prometheus_host: str = option("127.0.0.1", "Address of the Prometheus endpoint (loopback unless you open it).")
    prometheus_port: int = option(
        9464, f"Port of the Prometheus endpoint; 0 lets the OS choose (see {RunDir.PROMETHEUS}).")
    tensorboard: bool = option(False, f"Write TensorBoard event files to <run dir>/{RunDir.TENSORBOARD}.")
    wandb: bool = option(
        False, f"Log the step records to a Weights & Biases run as well, its files under <run dir>/{RunDir.WANDB} "
        "(needs pip install 'meshyard[wandb]'); the run's config and run facts are its W&B config.",
    )
    wandb_project: str = option("meshyard", "Weights & Biases project the run belongs to (with metrics.wandb).")
    wandb_mode: Literal["offline", "online"] = option(
        "offline", "'offline' writes the W&B run to disk only, with no network (upload it later with 'wandb sync "
        f"<run dir>/{RunDir.WANDB}/offline-run-*'); 'online' streams it to the W&B server (needs 'wandb login').",
    )
    waste_window: int = option(
        50, "Steps the live progress judges waste over (idle GPU, data stall, exposed communication); the flags "
        "are checked every metrics.log_every steps.",
    )
    idle_gpu_util: float = option(
        0.5, "GPU utilisation (0-1, NVML's reading on GPU runs) below which a step counts as idle.")
    idle_span_steps: int = option(
        20, "Consecutive idle steps that make an idle span; the time of such spans is reported as idle-GPU waste "
        "(shorter dips are ignored). At most metrics.waste_window.",
    )
    data_stall_share: float = option(
        0.2, "Share of step time spent waiting for data above which data loading is flagged as a stall (and the "
        "doctor calls the run data-bound).",
    )
    exposed_comm_share: float = option(
        0.25, "Share of step time spent in exposed (not overlapped) communication above which it is flagged (and "
        "the doctor calls the run communication-bound).",
    )


@dataclass
class RunConfig:
    """Identity of the run, its directory and its local processes."""

    name: str = option("meshyard", "Run name; the run directory is <dir>/<name>-<job id> in a job with an id (run.rdzv_id, the scheduler's), else <dir>/<name>-<timestamp>.")
    dir: str = option("runs", "Parent folder of run directories.")
    run_dir: str = option("", "Exact run directory to use (overrides dir/name); reused if it exists.")
    nproc: int = option(
        0, "Worker processes 'meshyard run' starts on this node (torchrun's --nproc-per-node; ignored under "
        "torchrun/Slurm); 0 starts one per visible GPU when the run uses CUDA, else 2.",
    )
    nnodes: str = option(
        "1", "Nodes of the job: 'N', or 'MIN:MAX' to let nodes leave and join while it runs (elastic). Above 1, "
        "every node runs the same 'meshyard run' with run.rdzv_endpoint and run.rdzv_id.",
    )
    rdzv_endpoint: str = option(
        "", "HOST[:PORT] where the nodes meet (port 29400 by default): an address every node reaches; the node "
        "that owns it serves the rendezvous. Needed for more than one node.",
    )
    rdzv_id: str = option(
        "", "Id of the job, the same on every node and every restart: it names the run directory "
        "(<dir>/<name>-<id>), so a restarted job finds its checkpoints. Empty: the scheduler's job id.",
    )
    node_rank: int = option(
        -1, "This node's rank (0 serves the rendezvous) for a fixed node count, as torchrun's --node-rank; -1 "
        "lets the rendezvous number the nodes as they arrive, which elastic ranges need.",
    )
    rdzv_timeout_s: float = option(
        900.0, "Seconds a node waits for the others to join, at the start and after a failure, before giving up.")
    rdzv_last_call_s: float = option(
        30.0, "With MIN:MAX nodes: seconds the rendezvous waits for more nodes once MIN have joined.")
    device: Literal["auto", "cpu", "cuda"] = option("auto", "Device: 'auto' picks CUDA when present, else CPU.")
    share_gpus: bool = option(
        False, "Let several ranks compute on one GPU (more ranks than GPUs); their collectives then go through "
        "gloo, since NCCL refuses two ranks on one GPU: slow, for trying a layout only.",
    )
    threads_per_rank: int = option(1, "CPU threads per rank (torch.set_num_threads); 0 leaves torch's default.")
    gpu_hour_price: float = option(
        0.0, "US dollars per device-hour (a GPU, or a CPU rank) to cost the run at: each step costs price / 3600 x "
        "world size x step time, shown as cost so far and projected to the last step on the progress line, in "
        f"{RunDir.METRICS}, {RunDir.SUMMARY}, Prometheus and the report. 0 takes the GPU model's on-demand price "
        "from the price table (meshyard.metrics.cost.PRICES, examples to edit); no price, no cost shown.",
    )
    spot_hour_price: float = option(
        0.0, "US dollars per preemptible (spot) device-hour: the summary and the report say what spot capacity "
        f"would have cost, with the restart overhead measured in {RunDir.RESTARTS}. 0 takes the price table's "
        "spot price of the GPU model; none, no spot estimate.",
    )


@dataclass
class ServeConfig:
    """How 'meshyard serve' answers requests for a trained model."""

    host: str = option("127.0.0.1", "Address the server binds (loopback unless you open it, e.g. 0.0.0.0 in a pod).")
    port: int = option(8000, "Port of the server; 0 lets the OS choose (printed, and written to --ready-file).")
    max_batch_size: int = option(16, "Requests run together in one forward pass; 1 turns batching off.")
    max_wait_ms: float = option(
        5.0, "How long a batch waits for more requests, counted from the first request entering an empty "
        "queue; a full batch leaves at once.",
    )
    max_queue: int = option(256, "Requests waiting per model version; more are answered 503 with Retry-After.")
    scheduler: Literal["auto", "dynamic", "continuous"] = option(
        "auto", "Generation batching: 'dynamic' (a batch runs to its longest completion), 'continuous' "
        "(requests join and leave the running batch between decoding steps; models with a KV cache, others "
        "batch dynamically) or 'auto': continuous for models on a CUDA device, where its decoding step is "
        "replayed from a CUDA graph (1.3 ms against a dynamic batch's 5.6 ms for a gpt2-124m shape on an "
        "H100), unless its KV cache (max_batch_size sequences of the whole context) would take over a "
        "quarter of the device's memory; dynamic on the CPU, where no KV cache is held between batches and "
        "batches of equal lengths decode more tokens/s.",
    )
    runtime: Literal["eager", "torchscript", "onnxruntime"] = option(
        "eager", "What runs the model: eager PyTorch, a TorchScript export or an ONNX export in ONNX Runtime.")
    request_timeout_s: float = option(30.0, "Deadline of a request from arrival; later it is answered 504.")
    max_new_tokens: int = option(256, "Largest max_new_tokens a generate request may ask for.")
    max_body_bytes: int = option(1_048_576, "Largest request body; a bigger one is answered 413.")
    read_timeout_s: float = option(
        10.0, "Seconds a client has to send a request's line and headers (counted from its first byte, or "
        "from connecting), and again for its body; a slower one is answered 408 and its connection closed, "
        "so half-sent requests cannot hold connections for ever.",
    )
    max_connections: int = option(
        512, "Open connections the server keeps; a connection beyond them is answered 503 (Retry-After) on "
        "its first request and closed. Keep it under the process's open-file limit (ulimit -n).",
    )
    keep_alive_timeout_s: float = option(
        5.0, "Seconds an idle kept-alive connection waits for its next request before the server closes it.")
    device: str = option(
        "auto", "Where eager models, their KV caches and sampling run: 'auto' (the first CUDA device when torch "
        "sees one, else the CPU), 'cpu', 'cuda' (the current CUDA device) or 'cuda:N'. Exports (torchscript, "
        "onnxruntime) run on the CPU only.",
    )
    dtype: Literal["auto", "fp32", "bf16", "fp16"] = option(
        "auto", "Precision of served weights and KV caches: 'auto' (bf16 on a CUDA device that supports it, "
        "else fp32), 'fp32', 'bf16' or 'fp16'. Sampling always reads the logits in fp32.",
    )
    memory_budget_bytes: int = option(
        0, "Bytes the loaded models may take together, in the memory of serve.device (parameters and buffers "
        "in serve.dtype, and for a model that batches continuously (scheduler 'continuous', or 'auto' on a "
        "GPU) the KV cache its batch keeps: "
        "max_batch_size sequences of its context); above it, idle models are evicted (longest idle and "
        "cheapest to load again first; pinned ones never). 0: no limit.",
    )
    pinned: list = option([], "Model names loaded at start-up and never evicted; /readyz waits for them.")
    cache: str = option(
        "memory", "Prediction cache for deterministic requests: 'memory' (in-process LRU), 'off', or a Redis "
        "URL such as redis://127.0.0.1:6379/0 shared by replicas.",
    )
    cache_entries: int = option(4096, "Entries of the in-process prediction cache.")
    cache_ttl_s: float = option(3600.0, "Seconds a Redis cache entry lives; 0 keeps it until Redis evicts it.")
    threads: int = option(0, "CPU threads for inference (torch.set_num_threads); 0 leaves torch's default.")
    chat_template: str = option(
        "", "Path of a Jinja chat template (Hugging Face's kind) for POST /v1/chat/completions, used for the "
        f"models whose tokenizer carries none ({RunDir.CHAT_TEMPLATE} or the chat_template of "
        f"{RunDir.TOKENIZER_CONFIG} beside it); empty: such models answer chat requests with 400.",
    )
    chat_template_overrides: bool = option(
        False, "Use serve.chat_template for every served model, also those whose tokenizer carries a template "
        "(their bos_token and eos_token still apply).",
    )


SECTIONS: dict[str, type] = {
    "model": ModelConfig,
    "data": DataConfig,
    "train": TrainConfig,
    "optim": OptimConfig,
    "parallel": ParallelConfig,
    "precision": PrecisionConfig,
    "comm": CommConfig,
    "checkpoint": CheckpointConfig,
    "fault": FaultConfig,
    "guard": GuardConfig,
    "metrics": MetricsConfig,
    "run": RunConfig,
    "serve": ServeConfig,
}


@dataclass
class Config:
    """The whole configuration of a run: one typed section per concern."""

    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    precision: PrecisionConfig = field(default_factory=PrecisionConfig)
    comm: CommConfig = field(default_factory=CommConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    fault: FaultConfig = field(default_factory=FaultConfig)
    guard: GuardConfig = field(default_factory=GuardConfig)
    metrics: MetricsConfig = field(default_factory=MetricsConfig)
    run: RunConfig = field(default_factory=RunConfig)
    serve: ServeConfig = field(default_factory=ServeConfig)
