"""What in a model keeps a layout from running on it, found before any worker starts.

``meshyard.validate`` builds the configured model on the meta device (structure and
shapes, no memory, no values) and asks ``layout_problems``. Each parallelism answers
for itself, in the module that also applies it, so the check and the application
cannot drift apart:

- units (FSDP, activation checkpointing): ``units.unit_problems`` (classes named in
  ``parallel.fsdp_units`` that the model lacks) and ``units.ac_problems`` (nothing to
  checkpoint);
- tensor parallel: ``tp_plans.tp_problems`` (no plan; heads or widths not divisible);
- pipeline: ``pipeline.pp_problems`` (cannot be cut or traced, fewer blocks than stages);
- context parallel: ``context_parallel.cp_problems`` (attention the ring cannot take over).

Every answer is one line naming the fix; the caller joins them into its one message.
"""

from __future__ import annotations

import dataclasses

import torch
from torch import nn

from meshyard.config.sections import ParallelConfig
from meshyard.parallel.context_parallel import cp_problems
from meshyard.parallel.pipeline import pp_problems
from meshyard.parallel.tp_plans import tp_problems
from meshyard.parallel.units import ac_problems, unit_problems
from meshyard.runtime.parallel_dims import ParallelDims


def layout_problems(model: nn.Module, cfg: ParallelConfig, dims: ParallelDims,
                    example_tokens: torch.Tensor | None = None, *, shape_checked: bool = False,
                    seq_len: int | None = None) -> list[str]:
    """Why ``model`` (built on the meta device or anywhere) cannot run under ``cfg`` on
    ``dims``: one line per problem, [] when it can.

    ``example_tokens``: token ids shaped as one pipeline micro-batch, as each rank traces
    a pipelined model (``pipeline.example_micro_batch``; default one sample of 8 tokens).
    ``shape_checked``: the tensor and pipeline fit were already checked from the config
    (meshyard's GPT, whose shape the config holds): only the units are inspected.
    ``seq_len``: the training sequence length, which context parallelism judges an
    attention's sliding window against (None: windows are left to the workers).
    """
    problems = [*unit_problems(model, cfg.fsdp_units), *ac_problems(model, cfg.ac, cfg.fsdp_units)]
    if dims.cp > 1:
        problems.extend(cp_problems(model, dims.cp, seq_len))
    if shape_checked:
        return problems
    if dims.tp > 1:
        problems.extend(tp_problems(model, cfg, dims.tp))
    if dims.pp > 1:
        if example_tokens is None:
            example_tokens = torch.zeros(1, 8, dtype=torch.long)
        # tp_problems has already said whether tp inside pipeline stages fits this model.
        pp_cfg = dataclasses.replace(cfg, tp=1) if dims.tp > 1 else cfg
        problems.extend(pp_problems(model, pp_cfg, dims.pp, example_tokens))
    return problems

