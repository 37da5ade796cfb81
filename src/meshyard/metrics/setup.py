"""Building the measurement pieces of a run from its ``[metrics]`` section."""

from __future__ import annotations

from pathlib import Path
from typing import Any, Callable, Sequence

import torch
from torch import nn

from meshyard.config.sections import MetricsConfig
from meshyard.metrics.cost import CostMeter, NullCostMeter, resolve_price
from meshyard.metrics.exporters import PrometheusExporter, TensorBoardExporter, WandbExporter
from meshyard.metrics.memory import MemoryProbe
from meshyard.metrics.meter import StepMeter
from meshyard.metrics.ranks import RankWindow
from meshyard.metrics.throughput import device_model, device_peak, training_flops_per_token
from meshyard.metrics.timing import CommTracker, NullStepTimer, StepTimer


def build_timer(cfg: MetricsConfig, device: torch.device, mark: Callable[[str], None]) -> StepTimer | NullStepTimer:
    if not cfg.breakdown:
        return NullStepTimer(mark)
    return StepTimer(device, CommTracker(device.type == "cuda"), mark)


def build_meter(cfg: MetricsConfig, timer: StepTimer | NullStepTimer, model: nn.Module, seq_len: int,
                device: torch.device, dtype: torch.dtype, world_size: int,
                hosts: Sequence[str] = ()) -> tuple[StepMeter, dict[str, Any]]:
    """The step meter, and facts for run.json (FLOPs per token, peak and its source).
    ``hosts``: every rank's host label, indexed by rank, to name stragglers' hosts."""
    flops = peak = None
    facts: dict[str, Any] = {}
    if cfg.mfu:
        flops = training_flops_per_token(model, seq_len)
        peak, source = device_peak(device, dtype)
        facts = {"training_flops_per_token": flops, "peak_flops_per_rank": peak, "peak_source": source}
    window = RankWindow(cfg.gather_every, cfg.straggler_factor, hosts) if cfg.gather_every else None
    return StepMeter(timer, MemoryProbe(device, nvml_every=cfg.log_every), window, flops, peak, world_size), facts


def build_exporters(cfg: MetricsConfig, run_dir: Path) -> list[Any]:
    exporters: list[Any] = []
    if cfg.prometheus:
        exporters.append(PrometheusExporter(run_dir, cfg.prometheus_host, cfg.prometheus_port))
    if cfg.tensorboard:
        exporters.append(TensorBoardExporter(run_dir))
    if cfg.wandb:
        exporters.append(WandbExporter(run_dir, cfg.wandb_project, cfg.wandb_mode))
    return exporters


def build_cost(gpu_hour_price: float, spot_hour_price: float, device: torch.device, world_size: int,
               total_steps: int) -> CostMeter | NullCostMeter:
    """The cost of each step at ``gpu_hour_price`` (run.gpu_hour_price), else at the price
    table's for this GPU model; a meter without figures where neither gives a price."""
    price = resolve_price(gpu_hour_price, spot_hour_price, device_model(device))
    return CostMeter(price, world_size, total_steps) if price else NullCostMeter()
