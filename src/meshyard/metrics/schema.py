"""The step record: every key a line of ``metrics.jsonl`` may hold, with type, unit and meaning.

One JSON object per optimizer step is written by rank 0 (``Trainer._one_step``) and read
back by the doctor, the report, the exporters, ``verify`` and ``bench``. The record is
assembled from several producers (named in each field's ``source``): the trainer's own
figures, the step timer's phases, the meter's throughput and MFU, the memory probe, the
per-rank window, gradient compression accounting, the pipeline runner and the checkpoint
manager's outcomes. This module is where those keys are written down once, so that a
producer and its readers cannot drift apart without a test noticing.

Keys that look dynamic are generated from constants here: one ``<phase>_s`` per entry of
``PHASES``, and under ``ranks`` one list (indexed by rank) per entry of ``RANK_FIELDS``.

It imports nothing but the standard library: tools that only read a run's records need
neither torch nor the rest of meshyard.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Mapping

# Where a step's time goes, in the order the phases happen. The single definition: the
# timer fills these, the meter subtracts them from the step time, the doctor divides by it.
PHASES: tuple[str, ...] = ("data", "forward", "backward", "comm", "optimizer")
OTHER = "other"  # whatever the phases leave uncovered, reported beside them


def phase_key(phase: str) -> str:
    """The record key of a phase's seconds: ``forward`` -> ``forward_s``."""
    return f"{phase}_s"


PHASE_KEYS: tuple[str, ...] = tuple(phase_key(phase) for phase in PHASES)
OTHER_KEY = phase_key(OTHER)

# JSON has one number type: a measured quantity may come back as an int (NVML's integer
# readings, a round 0), a count never comes back as a float.
NUMBER: tuple[type, ...] = (float, int)
COUNT: tuple[type, ...] = (int,)

# The units fields may declare ("1": a plain number; "": a structure whose parts say theirs).
UNITS = frozenset({"1", "", "nats", "step", "s", "unix s", "tokens", "tokens/s", "samples/s", "bytes",
                   "fraction", "TFLOP/s", "%", "W", "degC", "rank", "USD"})


@dataclass(frozen=True)
class Field:
    """One key of the step record.

    ``required``: present in every record; otherwise the description says when it is.
    ``source``: the module that produces it. ``exported``: sent to Prometheus and
    TensorBoard as a scalar. ``items``: the types of a list's entries.
    """

    types: tuple[type, ...]
    required: bool
    unit: str
    description: str
    source: str
    exported: bool = False
    items: tuple[type, ...] = ()


_PHASE_MEANING = {
    "data": "waiting for the step's micro-batches",
    "forward": "forward compute (FSDP's exposed forward all-gather wait counts as comm)",
    "backward": "backward compute, without the exposed wait for the last gradient buckets",
    "comm": "exposed (not overlapped) communication: last gradient buckets, FSDP forward all-gathers, the "
            "step's loss all-reduce, and a pipeline stage's wait for its neighbours",
    "optimizer": "unscaling, gradient clipping, the optimizer and scaler steps, the LR schedule",
}
_BREAKDOWN = "with metrics.breakdown"


def _phase_fields() -> dict[str, Field]:
    return {phase_key(phase): Field(NUMBER, False, "s", f"{_PHASE_MEANING[phase]} ({_BREAKDOWN})",
                                    "metrics.timing", exported=True)
            for phase in PHASES}


# In the order a reader meets them; the exported ones in the order the exporters register them.
FIELDS: dict[str, Field] = {
    # every step
    "step": Field(COUNT, True, "step", "optimizer steps done, this one included", "train.trainer"),
    "loss": Field(NUMBER, True, "nats", "training loss, mean over the data-parallel ranks (NaN if any rank's "
                  "was not finite)", "train.trainer", exported=True),
    "eval_loss": Field(NUMBER, False, "nats", "validation loss, on evaluation steps (train.eval_every)",
                       "train.trainer", exported=True),
    "lr": Field(NUMBER, True, "1", "learning rate the step used", "train.trainer", exported=True),
    "grad_norm": Field(NUMBER, True, "1", "global L2 norm of the gradients before clipping", "train.trainer",
                       exported=True),
    "loss_scale": Field(NUMBER, False, "1", "fp16 loss scale after the step (with GradScaler on)",
                        "train.trainer", exported=True),
    "step_time_s": Field(NUMBER, True, "s", "wall-clock time of the step, data loading included",
                         "train.trainer", exported=True),
    "data_time_s": Field(NUMBER, True, "s", "host time waiting for the step's micro-batches", "train.trainer"),
    "tokens_per_s": Field(NUMBER, True, "tokens/s", "tokens of the global batch per second of step time",
                          "train.trainer", exported=True),
    "samples_per_s": Field(NUMBER, True, "samples/s", "samples of the global batch per second of step time",
                           "train.trainer", exported=True),
    "mfu": Field(NUMBER, False, "fraction", "model FLOPs utilisation of all ranks' peak (with metrics.mfu and "
                 "a known peak)", "metrics.meter", exported=True),
    "model_tflops": Field(NUMBER, False, "TFLOP/s", "model FLOP/s achieved by all ranks (with metrics.mfu and "
                          "a known peak)", "metrics.meter"),
    "tokens_seen": Field(COUNT, True, "tokens", "tokens trained on since the run began", "train.trainer"),
    "time": Field(NUMBER, True, "unix s", "when the step finished", "train.trainer"),
    # the breakdown
    **_phase_fields(),
    OTHER_KEY: Field(NUMBER, False, "s", f"step time the phases leave uncovered ({_BREAKDOWN})", "metrics.meter"),
    "busy_s": Field(NUMBER, False, "s", f"step time minus comm: what stragglers are found by ({_BREAKDOWN})",
                    "metrics.meter"),
    "allgather_wait_s": Field(NUMBER, False, "s", f"the part of comm_s spent waiting for FSDP's forward "
                              f"all-gathers (FSDP, {_BREAKDOWN})", "metrics.timing"),
    # memory and device health of rank 0
    "rss_bytes": Field(COUNT, False, "bytes", "resident set size now (CPU runs)", "metrics.memory", exported=True),
    "peak_rss_bytes": Field(COUNT, False, "bytes", "peak resident set size (CPU runs)", "metrics.memory"),
    "gpu_allocated_bytes": Field(COUNT, False, "bytes", "CUDA memory allocated now (GPU runs)", "metrics.memory"),
    "gpu_peak_allocated_bytes": Field(COUNT, False, "bytes", "peak CUDA memory allocated (GPU runs)",
                                      "metrics.memory", exported=True),
    "gpu_peak_reserved_bytes": Field(COUNT, False, "bytes", "peak CUDA memory reserved by the allocator (GPU "
                                     "runs)", "metrics.memory", exported=True),
    "gpu_utilization_pct": Field(NUMBER, False, "%", "GPU utilisation (GPU runs with NVML)", "metrics.memory",
                                 exported=True),
    "gpu_power_w": Field(NUMBER, False, "W", "GPU power draw (GPU runs with NVML)", "metrics.memory"),
    "gpu_temperature_c": Field(NUMBER, False, "degC", "GPU temperature (GPU runs with NVML)", "metrics.memory"),
    # gradient communication (DDP and single-process runs; not FSDP)
    "comm_bytes": Field(COUNT, False, "bytes", "payload rank 0 contributed to gradient collectives",
                        "comm.accounting", exported=True),
    "comm_bytes_uncompressed": Field(COUNT, False, "bytes", "what a plain all-reduce of every bucket would "
                                     "carry", "comm.accounting"),
    "compression_ratio": Field(NUMBER, False, "1", "comm_bytes_uncompressed / comm_bytes", "comm.accounting",
                               exported=True),
    "comm_wire_bytes": Field(COUNT, False, "bytes", "bytes rank 0 sends for that payload under ring algorithms",
                             "comm.accounting"),
    # compilation (train.compile on)
    "compiled_graphs": Field(COUNT, False, "1", "graphs torch.compile has built in rank 0's process so far; "
                             "a steady run stops adding (a rise later is a recompile)", "train.step"),
    # pipeline stages (pipelined runs)
    "pp_compute_s": Field(NUMBER, False, "s", "rank 0's stage compute time in the schedule", "train.pipeline_step"),
    "pp_wall_s": Field(NUMBER, False, "s", "rank 0's wall time in the schedule", "train.pipeline_step"),
    "pp_idle_fraction": Field(NUMBER, False, "fraction", "share of the schedule rank 0's stage was idle",
                              "train.pipeline_step"),
    "pp_bubble_theory": Field(NUMBER, False, "fraction", "the schedule's theoretical bubble",
                              "train.pipeline_step"),
    # mixture of experts (a model with MoE layers, e.g. model.moe_experts > 0)
    "moe_aux_loss": Field(NUMBER, False, "1", "load-balancing loss of the router (Switch Transformer's; 1 when the "
                          "load is even), unweighted, mean over layers and micro-batches; its weighted value is "
                          "added to the training loss, not to loss", "train.expert_load", exported=True),
    "moe_z_loss": Field(NUMBER, False, "1", "router z-loss (mean squared log-sum-exp of the router logits), "
                        "unweighted, mean over layers and micro-batches", "train.expert_load", exported=True),
    "moe_tokens_per_expert": Field((list,), False, "tokens", "token assignments each expert received on rank 0 "
                                   "in the step, before the capacity limit: one list per MoE layer",
                                   "train.expert_load", items=(list,)),
    "moe_dropped_tokens": Field(COUNT, False, "tokens", "token assignments the capacity limit turned away on "
                                "rank 0 in the step, all layers (0 when dropless)", "train.expert_load",
                                exported=True),
    "moe_imbalance": Field(NUMBER, False, "1", "the busiest expert's tokens over the mean expert's, in the "
                           "layer where that ratio is highest, on rank 0 (1 is even; the experts / top_k when every "
                           "token picks the same ones)", "train.expert_load", exported=True),
    # rare events and windows
    "nonfinite": Field((list,), False, "", "where a NaN/inf loss or gradient norm was seen: {rank, what, value} "
                       "entries (on such steps)", "train.trainer", items=(dict,)),
    "guard": Field((str,), False, "", "why the spike and NaN guard did not keep the step's update (only then; "
                   "details in guard.jsonl)", "train.trainer"),
    "replay": Field((bool,), False, "", "true on a step trained again after the spike and NaN guard rolled back "
                    "(only then): its number was recorded before, and this record supersedes that one",
                    "train.trainer"),
    "profiled": Field((bool,), False, "", "true on a step recorded by torch.profiler (metrics.profile_steps; only "
                      "then): it ran slower than the others, and the doctor leaves it out", "train.trainer"),
    "ranks": Field((dict,), False, "", "every rank's mean figures over the last window: RANK_FIELDS -> list by "
                   "rank (every metrics.gather_every steps)", "metrics.ranks"),
    "stragglers": Field((list,), False, "rank", "ranks whose busy time exceeds the median by "
                        "metrics.straggler_factor (with ranks)", "metrics.ranks", items=COUNT),
    "straggler_hosts": Field((list,), False, "", "the host of each straggler, in the order of stragglers: "
                             "'hostname (address that reaches the master)', or the hostname alone (with "
                             "stragglers, when the ranks' hosts are known)", "metrics.ranks", items=(str,)),
    "gc_s": Field(NUMBER, False, "s", "time Python's garbage collector ran, in any thread of rank 0's process, "
                  "since the previous record (present when it ran; what the job set up, and the first step "
                  "compiled, is frozen out of its reach: runtime.collector)", "train.trainer"),
    # checkpoints
    "checkpoint_stall_s": Field(NUMBER, False, "s", "time the previous step's save held training up (on the "
                                "step after a save)", "train.trainer"),
    "checkpoint_previous_wait_s": Field(NUMBER, False, "s", "the part of checkpoint_stall_s spent waiting for the "
                                        "previous save, still writing, to finish (at most one save is in flight)",
                                        "train.trainer"),
    "checkpoint_staging_wait_s": Field(NUMBER, False, "s", "time this step waited, before its optimizer step, for an "
                                       "async save's copy of the state to host memory (on the step after the save; "
                                       "the loop's stall of an async save is this plus checkpoint_stall_s)",
                                       "train.trainer"),
    "checkpoint_step": Field(COUNT, False, "step", "step of a save that finished since the last record",
                             "train.trainer"),
    "checkpoint_s": Field(NUMBER, False, "s", "that save's total time (in the background when async)",
                          "train.trainer"),
    "checkpoint_commit_s": Field(NUMBER, False, "s", "that save's commit on rank 0", "train.trainer"),
    "checkpoint_error": Field((str,), False, "", "why that save failed (only when it did)", "train.trainer"),
    # cost (with a price: run.gpu_hour_price or the price table's for the GPU model)
    "cost_per_step_usd": Field(NUMBER, False, "USD", "what the step cost: price per device-hour / 3600 x world "
                               "size x step_time_s (with a price)", "metrics.cost", exported=True),
    "cost_so_far_usd": Field(NUMBER, False, "USD", "cost of the recorded steps since the run began, this one "
                             "included (with a price)", "metrics.cost", exported=True),
    "cost_projected_usd": Field(NUMBER, False, "USD", "cost so far plus the steps left to train.steps at the mean "
                                "cost of the last few steps (metrics.cost.RECENT_STEPS; with a price)", "metrics.cost",
                                exported=True),
}

REQUIRED_KEYS: frozenset[str] = frozenset(key for key, field in FIELDS.items() if field.required)
EXPORTED_KEYS: tuple[str, ...] = tuple(key for key, field in FIELDS.items() if field.exported)

# What each rank averages over a window and rank 0 gathers under ``ranks``; these are
# record keys of the same meaning, except ``memory_bytes`` (the rank's peak reserved GPU
# memory, or its resident set on CPU) and ``pp_idle_fraction`` (0 off a pipeline).
RANK_FIELDS: tuple[str, ...] = ("step_time_s", "busy_s", *PHASE_KEYS, "memory_bytes", "pp_idle_fraction")


def keys_from(source: str) -> tuple[str, ...]:
    """The record keys one producer writes, e.g. ``keys_from("comm.accounting")``."""
    return tuple(key for key, field in FIELDS.items() if field.source == source)


def validate_record(record: Mapping[str, Any]) -> list[str]:
    """Problems of one step record: missing required keys, unknown keys, values of the
    wrong type (also inside ``ranks`` and list entries). Empty when the record is fine."""
    if not isinstance(record, Mapping):
        return [f"a step record is a JSON object, not {_type_name(record)}"]
    problems = [f"missing required key '{key}'" for key in FIELDS if key in REQUIRED_KEYS and key not in record]
    for key, value in record.items():
        field = FIELDS.get(key)
        if field is None:
            problems.append(f"unknown key '{key}'")
        elif not _is(value, field.types):
            problems.append(f"'{key}' is {_type_name(value)}, expected {_names(field.types)}")
        elif field.items:
            problems += [f"'{key}'[{index}] is {_type_name(item)}, expected {_names(field.items)}"
                         for index, item in enumerate(value) if not _is(item, field.items)]
    if isinstance(record.get("ranks"), dict):
        problems += _rank_problems(record["ranks"])
    return problems


def _rank_problems(ranks: Mapping[str, Any]) -> list[str]:
    problems = []
    for name, values in ranks.items():
        if name not in RANK_FIELDS:
            problems.append(f"unknown per-rank figure 'ranks.{name}'")
        elif not isinstance(values, list) or not all(_is(value, NUMBER) for value in values):
            problems.append(f"'ranks.{name}' is not a list of numbers (one per rank)")
    return problems


def _is(value: Any, types: tuple[type, ...]) -> bool:
    # JSON's true/false load as bool, a subclass of int: no count or number is a bool.
    if isinstance(value, bool):
        return bool in types
    return isinstance(value, types)


def _type_name(value: Any) -> str:
    return "null" if value is None else type(value).__name__


def _names(types: tuple[type, ...]) -> str:
    return " or ".join(kind.__name__ for kind in types)
