"""Whole-run checks: a config against the models, plugins and world size it will run with.

Two roles, one per kind of process:

- the launching process (``meshyard run``, ``meshyard.run``) calls ``validate`` (or
  ``validate_local_launch``) once. It gathers every problem before raising one
  ``ConfigError``: the config's own checks (``meshyard.config.checks``), names of models
  and data sources, a built-in GPT's shape against its parallel degrees, optional extras,
  the layout of the job, and whether the model can take that layout: where the layout
  asks something of the model (tensor or pipeline parallelism, FSDP or activation
  checkpointing of a model meshyard does not know, ``parallel.fsdp_units``), the model
  is built on the meta device and inspected (``meshyard.parallel.inspect``);
- a worker calls ``derive_layout``, which only derives the ``Layout`` and ``BatchPlan``
  for the world size the worker sees (an external torchrun may start another one) and
  refuses one that does not fit, with the message the launching process would give.

Both return a ``ValidatedLayout``, so the rest of the run uses exactly what was checked.
"""

from __future__ import annotations

import dataclasses
import io
import logging
import re
import sys
import warnings
from contextlib import contextmanager, redirect_stderr
from dataclasses import dataclass
from pathlib import Path
from typing import Iterable, Iterator

import torch
from torch import nn

from meshyard.config.checks import bpe_vocab, field_problems, node_range
from meshyard.config.load import ConfigError, collect_config, did_you_mean
from meshyard.config.sections import Config
from meshyard.data.corpus import BYTE_VOCAB
from meshyard.extras import config_problems as extras_problems
from meshyard.fault.failure import describe
from meshyard.models.gpt import GPT_PRESETS
from meshyard.checkpoint.init_source import InitSourceError, find_source, kind_problem
from meshyard.models.hf_auto import HF_MODEL, HFModelError
from meshyard.models.linear_cross_entropy import fused_loss_refusal
from meshyard.models.registry import MODEL_NAMES, build_model
from meshyard.parallel.inspect import layout_problems as model_layout_problems
from meshyard.parallel.layout import Layout
from meshyard.parallel.pipeline import example_micro_batch
from meshyard.plugins import PluginError, is_custom_reference, load_callable, unaccepted_keywords
from meshyard.runtime.batch_plan import BatchPlan, BatchPlanError
from meshyard.runtime.devices import default_nproc, local_launch_problem, visible_gpu_count
from meshyard.runtime.parallel_dims import ParallelDims, ParallelDimsError

DATA_SOURCES = ("stdlib", "text", "tokens", "shards", "random")


@dataclass(frozen=True)
class ValidatedLayout:
    """The parallel layout and the batch arithmetic of a job, as checked."""

    layout: Layout
    batch: BatchPlan

    @property
    def dims(self) -> ParallelDims:
        return self.layout.dims


def validate(cfg: Config, world_size: int, earlier_problems: Iterable[str] = ()) -> ValidatedLayout:
    """Check ``cfg`` for a job of ``world_size`` ranks; raise one ``ConfigError`` listing all
    problems, ``earlier_problems`` (e.g. those found on load) first."""
    problems: list[str] = list(earlier_problems)
    problems.extend(_reference_problems(cfg))
    problems.extend(field_problems(cfg))
    problems.extend(extras_problems(cfg.metrics, cfg.checkpoint))
    layout, layout_problems = _derive(cfg, world_size)
    problems.extend(layout_problems)
    if layout is not None:
        problems.extend(_micro_batch_problems(layout))
        problems.extend(_cuda_graph_problems(cfg, layout))
    shape_problems = _gpt_shape_problems(cfg) + _init_from_problems(cfg)
    problems.extend(shape_problems)
    if layout is not None and not shape_problems:
        problems.extend(_model_problems(cfg, layout))
    if problems:
        raise ConfigError(problems)
    assert layout is not None  # every reason for none was a problem above
    return layout


def derive_layout(cfg: Config, world_size: int) -> ValidatedLayout:
    """The layout of a job of ``world_size`` ranks, for a process whose launcher validated
    ``cfg`` in full: only what depends on the world size is derived here. Raises the
    ``ConfigError`` ``validate`` would when the degrees or the batch do not fit it."""
    layout, problems = _derive(cfg, world_size)
    if layout is None:
        # Degrees out of range derive nothing and name no problem of their own: list the
        # config's (only a config that was never validated gets here).
        raise ConfigError(problems or field_problems(cfg))
    return layout


def with_local_nproc(cfg: Config, nproc: int | None = None) -> Config:
    """``cfg`` with ``run.nproc`` set to the workers a launch on this machine starts:
    ``nproc`` when given, else ``run.nproc``, else (0) this machine's default: one per
    visible GPU where the run uses CUDA, else 2 (``runtime.devices.default_nproc``)."""
    resolved = nproc or cfg.run.nproc or default_nproc(cfg.run.device, visible_gpu_count())
    return dataclasses.replace(cfg, run=dataclasses.replace(cfg.run, nproc=resolved))


def validate_local_launch(cfg: Config, nproc: int | None = None,
                          earlier_problems: Iterable[str] = ()) -> tuple[Config, ValidatedLayout]:
    """Check ``cfg`` for workers started on this machine (how many: ``with_local_nproc``),
    including whether this machine can hold them (no more ranks than GPUs unless
    ``run.share_gpus``). Returns the config carrying that count, and its layout.

    With ``run.nnodes`` above one, the job is checked at the largest world size it can
    have, and its layout derived at every other node count it may shrink or grow to
    (an elastic job must fit each)."""
    cfg = with_local_nproc(cfg, nproc)
    run = cfg.run
    launch_problem = local_launch_problem(run.nproc, run.device, visible_gpu_count(), run.share_gpus)
    problems = [*earlier_problems, *([launch_problem] if launch_problem else [])]
    low, high = node_range(run.nnodes) or (1, 1)
    checked = validate(cfg, high * run.nproc, problems)
    unfit = [f"with {count} node(s) ({count * run.nproc} ranks): {problem}" for count in range(low, high)
             for problem in _derive(cfg, count * run.nproc)[1]]
    if unfit:
        raise ConfigError([f"run.nnodes = '{run.nnodes}' lets the job run on fewer nodes, where its layout does "
                           "not fit; narrow the range or change the layout", *unfit])
    return cfg, checked


def load_and_validate(
    path: str | Path | None, overrides: Iterable[str], world_size: int | None = None
) -> tuple[Config, ValidatedLayout]:
    """Load and check a config in one pass, so type errors and impossible combinations
    are reported together. Without ``world_size``, for a launch on this machine
    (``validate_local_launch``); the returned config then carries its ``run.nproc``."""
    cfg, problems = collect_config(path, overrides)
    if world_size is None:
        return validate_local_launch(cfg, earlier_problems=problems)
    return cfg, validate(cfg, world_size, problems)


def _reference_problems(cfg: Config) -> list[str]:
    """Model and data-source names: a registered one, or a plugin reference."""
    problems = []
    name, source = cfg.model.name, cfg.data.source
    if not is_custom_reference(name) and name not in MODEL_NAMES:
        problems.append(
            f"model.name = '{name}' is not a known model{did_you_mean(name, MODEL_NAMES)}; known: "
            f"{', '.join(MODEL_NAMES)}, or 'module:function' / 'file.py:function' for your own"
        )
    if not is_custom_reference(source) and source not in DATA_SOURCES:
        problems.append(
            f"data.source = '{source}' is not known{did_you_mean(source, DATA_SOURCES)}; known: "
            f"{', '.join(DATA_SOURCES)}, or 'module:function' / 'file.py:function' for your own dataset"
        )
    return problems


def _derive(cfg: Config, world_size: int) -> tuple[ValidatedLayout | None, list[str]]:
    """ParallelDims and BatchPlan for ``world_size`` ranks, or the problems that prevent them.

    Degrees out of range (negative, or tp/pp below 1) derive nothing and add no problem:
    ``meshyard.config.checks`` names them, and ``ParallelDims`` would name them again.
    """
    p, t = cfg.parallel, cfg.train
    model_parallel = max(p.tp, 1) * max(p.pp, 1) * max(p.cp, 1)
    if p.strategy == "none" and world_size > model_parallel:
        per = f" per tp x pp = {model_parallel}" if model_parallel > 1 else ""
        return None, [f"parallel.strategy = 'none' runs one process{per} but the world size is {world_size}; "
                      f"use --nproc {model_parallel} or choose 'ddp', 'fsdp' or 'zero1'"]
    if min(p.dp_replicate, p.dp_shard) < 0 or min(p.tp, p.pp, p.cp) < 1:
        return None, []
    try:
        layout = Layout.resolve(p, world_size)
    except ParallelDimsError as exc:
        return None, list(exc.problems)
    try:
        batch = BatchPlan.derive(t.global_batch, layout.dims.dp, t.micro_batch, t.grad_accum)
    except BatchPlanError as exc:
        return None, [str(exc)]
    return ValidatedLayout(layout=layout, batch=batch), []


def _micro_batch_problems(checked: ValidatedLayout) -> list[str]:
    """Pipeline micro-batches must split each train.micro_batch into whole samples."""
    batch, microbatches = checked.batch, checked.layout.microbatches
    if checked.layout.pipelined and microbatches > 0 and batch.micro_batch % microbatches:
        return [f"parallel.microbatches = {microbatches} does not divide the {batch.micro_batch} samples "
                "of each train.micro_batch; each pipeline micro-batch must hold whole samples"]
    return []


def _cuda_graph_problems(cfg: Config, checked: ValidatedLayout) -> list[str]:
    """``train.cuda_graphs`` replays the model-and-loss region, one micro-batch per step."""
    if not cfg.train.cuda_graphs:
        return []
    problems = []
    if cfg.train.compile is False:
        problems.append("train.cuda_graphs = true replays the compiled step, but train.compile = false: set "
                        "train.compile = 'auto' (or true), or train.cuda_graphs = false")
    if cfg.run.device == "cpu":
        problems.append("train.cuda_graphs = true needs a CUDA device, but run.device = 'cpu': set run.device = "
                        "'auto' or 'cuda' on a GPU machine, or train.cuda_graphs = false")
    if not checked.layout.compiles_whole:
        dims = checked.dims
        problems.append(
            "train.cuda_graphs = true needs the model and its loss compiled as one region, on one rank without "
            f"a wrapper or a model split; this layout (strategy '{cfg.parallel.strategy}', dp {dims.dp}, tp "
            f"{dims.tp}, pp {dims.pp}, cp {dims.cp}{', CPU offload' if cfg.parallel.cpu_offload else ''}) "
            "compiles each block instead: run one rank with parallel.strategy = 'none', or set "
            "train.cuda_graphs = false")
    if cfg.model.moe_experts > 0:
        problems.append(
            f"train.cuda_graphs = true does not take a mixture of experts (model.moe_experts = "
            f"{cfg.model.moe_experts}): its routing splits tokens by counts read on the host, which a graph "
            "cannot replay; set train.cuda_graphs = false")
    if checked.batch.grad_accum > 1:
        problems.append(
            f"train.cuda_graphs = true takes one micro-batch per step, but this batch accumulates "
            f"{checked.batch.grad_accum} (train.global_batch = {checked.batch.global_batch}, micro-batches of "
            f"{checked.batch.micro_batch}), and gradients that outlive a replay of the graphs (the earlier "
            "micro-batches' are still being summed) are not supported; set train.micro_batch = "
            f"{checked.batch.global_batch // checked.batch.dp_size} "
            "(train.grad_accum = 1), or train.cuda_graphs = false")
    return problems


def _gpt_shape_problems(cfg: Config) -> list[str]:
    """A built-in GPT's shape as it will be built (preset values where the config says 0)
    against its heads and the tp/pp degrees: otherwise every worker fails building it."""
    m, p = cfg.model, cfg.parallel
    if m.moe_experts > 0 and not _is_gpt(m.name):
        return [f"model.moe_experts = {m.moe_experts} gives meshyard's GPT experts, but model.name = '{m.name}'; "
                "use a GPT preset or 'gpt' (a model of your own brings its own MoE layers, e.g. "
                "meshyard.models.moe.MoEFeedForward)"]
    if m.name != "gpt" and m.name not in GPT_PRESETS:  # other models: only what the config itself says
        if m.n_head > 0 and m.d_model and m.d_model % m.n_head:
            return [f"model.d_model = {m.d_model} is not divisible by model.n_head = {m.n_head}"]
        return []
    preset = GPT_PRESETS.get(m.name, GPT_PRESETS["gpt-tiny"])
    size = {key: getattr(m, key) or preset[key] for key in ("n_layer", "n_head", "d_model")}

    def shown(key: str) -> str:
        return f"model.{key} = {size[key]}" + ("" if getattr(m, key) else f" (from '{m.name}')")

    problems = []
    if size["n_head"] > 0 and size["d_model"] % size["n_head"]:
        problems.append(f"{shown('d_model')} is not divisible by {shown('n_head')}")
    if p.tp > 1:
        problems.extend(f"{shown(key)} is not divisible by parallel.tp = {p.tp}"
                        for key in ("n_head", "d_model") if size[key] % p.tp)
    stages = p.pp * p.pp_virtual_stages
    if p.pp > 1 and not p.pp_split and size["n_layer"] < stages:
        problems.append(f"{shown('n_layer')} blocks are fewer than the {stages} pipeline stages "
                        "(parallel.pp x pp_virtual_stages); lower them or use more layers")
    split = p.pp_split
    if p.pp > 1 and split and all(isinstance(n, int) for n in split) and sum(split) != size["n_layer"]:
        problems.append(f"parallel.pp_split = {split} sums to {sum(split)} blocks, not the "
                        f"{size['n_layer']} of {shown('n_layer')}")
    return problems


def _init_from_problems(cfg: Config) -> list[str]:
    """``model.init_from``: a path of a kind meshyard starts from, and for ``model.name =
    'hf'`` a Hugging Face folder (its config.json builds the model). Whether its tensors
    fit the model is known once the model is built: the workers check that."""
    m = cfg.model
    if not m.init_from.strip():
        return []
    try:
        source = find_source(m.init_from)
    except InitSourceError as exc:
        return [str(exc)]
    problem = kind_problem(m.name, source)
    if problem is None and m.name == HF_MODEL:
        try:
            _build_on_meta(cfg)
        except HFModelError as exc:
            problem = f"model.init_from: {exc}"
    return [problem] if problem else []


def _is_gpt(name: str) -> bool:
    return name == "gpt" or name in GPT_PRESETS


def _inspects_model(cfg: Config, layout: Layout) -> bool:
    """Whether the layout asks something of the model that only the model can answer:
    meshyard's GPT fits every layout its shape allows (checked from the config), so only
    the unit classes named for it, and its attention dropout under context parallelism;
    other models, under anything but plain replication."""
    p, dims = cfg.parallel, layout.dims
    if _is_gpt(cfg.model.name):
        return bool(p.fsdp_units) or dims.cp > 1
    return (bool(p.fsdp_units) or dims.cp > 1 or dims.tp > 1 or dims.pp > 1 or layout.data_parallel == "fsdp"
            or p.ac != "none" or cfg.train.fused_linear_loss)


def _model_problems(cfg: Config, validated: ValidatedLayout) -> list[str]:
    """The model's own problems with the layout, found on a build on the meta device
    (``meshyard.parallel.inspect``), or the builder's failure; none when the layout asks
    nothing of the model or its builder cannot run on the meta device (then the workers
    find the problems, and a note says so)."""
    layout, m = validated.layout, cfg.model
    if not _inspects_model(cfg, layout) or not _builds_as_configured(m.name, m.options):
        return []
    try:
        model = _build_on_meta(cfg)
    except Exception as exc:  # the user's builder: anything
        if not re.search(r"\bmeta\b", str(exc), re.IGNORECASE):
            return [f"model.name = '{m.name}': building the model failed: {describe(exc)}; fix the builder "
                    "(or model.options) and run again"]
        print(f"meshyard: note: the layout was not checked against the model before starting, because its "
              f"builder cannot run on the meta device ({describe(exc)}); the workers check it as they build it",
              file=sys.stderr, flush=True)
        return []
    # One sample per pipeline micro-batch is all the inspection traces: a micro-batch of the
    # configured size may be too large to allocate here (it is checked against the data later).
    tokens = example_micro_batch(min(validated.batch.micro_batch, layout.microbatches), layout.microbatches,
                                 cfg.data.seq_len)
    refusal = fused_loss_refusal(model) if cfg.train.fused_linear_loss else None
    with _torch_quiet():
        return [*([refusal] if refusal else []),
                *model_layout_problems(model, cfg.parallel, layout.dims, tokens, shape_checked=_is_gpt(m.name),
                                       seq_len=cfg.data.seq_len)]


@contextmanager
def _torch_quiet() -> Iterator[None]:
    """Nothing on the console while the model is inspected: a trace that fails prints the
    whole graph it got as far as (torch.export) and logs warnings about it, and the
    problem it found is in the message."""
    disabled = logging.root.manager.disable
    logging.disable(logging.WARNING)
    try:
        with warnings.catch_warnings(), redirect_stderr(io.StringIO()):
            warnings.simplefilter("ignore")
            yield
    finally:
        logging.disable(disabled)


def _builds_as_configured(name: str, options: dict) -> bool:
    """A builder that does not import, or takes no keyword given in ``model.options``, is
    reported by ``meshyard.api.prepare_inputs``, with the data's problems: not built here."""
    if not is_custom_reference(name):
        return True
    try:
        return not unaccepted_keywords(load_callable(name), options)
    except PluginError:
        return False


def _build_on_meta(cfg: Config) -> nn.Module:
    """The configured model on the meta device. The data's vocabulary is not read here:
    the configured one, else the size of a BPE to train, else that of the byte-level
    sources (a layout asks nothing of the vocabulary but that tp divides it)."""
    vocab = cfg.model.vocab_size or cfg.data.vocab_size or max(0, bpe_vocab(cfg.data.tokenizer) or 0) or BYTE_VOCAB
    with torch.device("meta"):
        return build_model(cfg.model, vocab, cfg.data.seq_len)
