"""What a run is: the typed facts ``build_trainer`` returns beside the Trainer.

They are written once to run.json (``RunFacts.record``; its keys are the run directory's
contract, listed in the README) and the rank log, and their data-parallel part goes into
every checkpoint manifest (``RunFacts.manifest``).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

from meshyard.metrics.cost import Price


@dataclass(frozen=True)
class Resumed:
    """The checkpoint a run resumed from and what loading it cost."""

    checkpoint: str
    step: int
    load_s: float
    verify_s: float


@dataclass(frozen=True)
class Throughput:
    """What MFU is computed from (absent when ``metrics.mfu`` is off)."""

    training_flops_per_token: float
    peak_flops_per_rank: float | None
    peak_source: str


@dataclass(frozen=True)
class RunFacts:
    """One rank's view of the run (the same on every rank but ``hosts`` order, which is by rank)."""

    # the model
    parameters: int
    model_init: str  # "meta" (built on the meta device, materialized after sharding) or "device"
    compiled: str  # what torch.compile compiled ("nothing" when off)
    # the job and its layout
    world_size: int
    local_world_size: int
    backend: str
    device: str
    strategy: str
    dp_replicate: int
    dp_shard: int
    tp: int
    pp: int
    activation_checkpointing: str
    cpu_offload: bool
    hosts: tuple[str, ...]
    # batch and numerics
    global_batch: int
    micro_batch: int
    grad_accum: int
    dtype: str
    peak_lr: float
    optimizer_step: str  # "fused", "foreach" or "for-loop"
    # data and the device
    data: str
    train_samples: int
    memory_capacity_bytes: int
    cp: int = 1  # context-parallel degree: ranks splitting each sequence
    tokenizer_file: str = ""  # the subword tokenizer the text was tokenized with, copied into the run directory
    throughput: Throughput | None = None
    resumed_from: Resumed | None = None
    price: Price | None = None
    """What a device-hour costs (``metrics.cost``); None: the run shows no cost."""
    ep: int = 1
    """Expert-parallel degree (within dp_shard)."""

    @property
    def dp_size(self) -> int:
        return self.dp_replicate * self.dp_shard

    def record(self) -> dict[str, Any]:
        """The facts as run.json holds them: flat, the throughput figures only when measured,
        ``resumed_from`` only after a resume."""
        record = {key: value for key, value in asdict(self).items()
                  if key not in ("throughput", "resumed_from", "price")}
        record["hosts"] = list(self.hosts)
        if self.throughput is not None:
            record.update(asdict(self.throughput))
        if self.resumed_from is not None:
            record["resumed_from"] = asdict(self.resumed_from)
        if self.price is not None:
            record.update(self.price.facts())
        return record

    def manifest(self) -> dict[str, Any]:
        """What every checkpoint manifest records of the run: the layout a reshard starts from."""
        return {"world_size": self.world_size, "strategy": self.strategy, "dp_replicate": self.dp_replicate,
                "dp_shard": self.dp_shard, "global_batch": self.global_batch, "micro_batch": self.micro_batch}
