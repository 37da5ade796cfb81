"""``meshyard ckpt export --format hf``: a checkpoint as a folder ``transformers`` loads.

The folder holds ``config.json``, the weights as safetensors (one ``model.safetensors``, or
shards of at most ``max_shard_bytes`` with ``model.safetensors.index.json``, as
``save_pretrained`` writes them), ``generation_config.json`` and the run's tokenizer
(``tokenizer.json``, when it trained with one, and a chat template kept beside it). meshyard's own GPT is written as
``GPT2LMHeadModel`` (``models.hf_gpt2``); a run of a Hugging Face architecture
(``model.name = "hf"``, or a builder returning a ``transformers`` model) keeps it: its own
config, its own tensor names, a tied head stored once. The weights are read from the DCP
checkpoint one shard's tensors at a time, each tensor whole whatever layout saved it, so
the process never holds more than one output shard of the model.
"""

from __future__ import annotations

import json
import shutil
import tomllib
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import torch
from torch.distributed.checkpoint.metadata import TensorStorageMetadata

from meshyard.checkpoint.locate import CheckpointRef
from meshyard.checkpoint.manifest import verify
from meshyard.checkpoint.tools import CheckpointToolError, model_tensor_metadata, read_full_state
from meshyard.config.load import ConfigError, config_from_dict
from meshyard.config.sections import Config
from meshyard.extras import require
from meshyard.models.hf_auto import HF_MODEL
from meshyard.models.hf_gpt2 import NotGPT2, gpt2_config, gpt2_name
from meshyard.models.registry import build_model, gpt_shape
from meshyard.parallel.tp_modules import tied_groups
from meshyard.plugins import is_custom_reference
from meshyard.run_dir import RunDir

MAX_SHARD_BYTES = 5 * 10**9  # transformers' default for save_pretrained
WEIGHTS, INDEX = "model.safetensors", "model.safetensors.index.json"


@dataclass(frozen=True)
class _Target:
    """What the folder describes: its config.json, and each checkpoint tensor's name there
    with whether it is transposed (None: not stored, e.g. a tied head)."""

    config: dict[str, Any]
    names: dict[str, tuple[str, bool] | None]


def export_hugging_face(ref: CheckpointRef, out: Path, report: Callable[[str], None] = print,
                        max_shard_bytes: int = MAX_SHARD_BYTES) -> Path:
    """Write checkpoint ``ref`` as a Hugging Face model folder ``out``; returns ``out``."""
    save_file = require("safetensors.torch", "exporting a Hugging Face folder").save_file
    store = ref.store()
    manifest, problem = verify(store, store.path(ref.name))
    if problem:
        raise CheckpointToolError(f"{store.url_of(ref.name)} is not valid: {problem}")
    shapes = model_tensor_metadata(ref)
    target = _target(_recorded_config(ref, manifest), shapes)
    stored = {name: renamed for name, renamed in target.names.items() if renamed is not None}
    shards = _shards(stored, shapes, max_shard_bytes)
    out.mkdir(parents=True, exist_ok=True)
    weight_map: dict[str, str] = {}
    for index, names in enumerate(shards, start=1):
        file = WEIGHTS if len(shards) == 1 else f"model-{index:05d}-of-{len(shards):05d}.safetensors"
        tensors = read_full_state(ref, {f"model.{name}" for name in names})["model"]
        renamed = {}
        for name in names:
            new_name, transposed = stored[name]
            tensor = tensors.pop(name)
            renamed[new_name] = (tensor.t() if transposed else tensor).contiguous()
            weight_map[new_name] = file
        save_file(renamed, str(out / file), metadata={"format": "pt"})
    if len(shards) > 1:
        total = sum(_bytes(shapes[name]) for name in stored)
        (out / INDEX).write_text(json.dumps({"metadata": {"total_size": total},
                                             "weight_map": dict(sorted(weight_map.items()))}, indent=2))
    (out / "config.json").write_text(json.dumps({**target.config, "torch_dtype": _dtype_name(shapes)}, indent=2))
    generation = {key: target.config[key] for key in ("bos_token_id", "eos_token_id")
                  if target.config.get(key) is not None}
    (out / "generation_config.json").write_text(json.dumps({**generation, "_from_model_config": True}, indent=2))
    tokenizer = _run_tokenizer(ref)
    if tokenizer is not None:
        for name in (RunDir.TOKENIZER, RunDir.TOKENIZER_CONFIG, RunDir.CHAT_TEMPLATE):  # the chat template goes along
            if (tokenizer.parent / name).is_file():
                shutil.copyfile(tokenizer.parent / name, out / name)
    report(f"exported {len(weight_map)} tensors of step {manifest['step']} as {target.config['architectures'][0]} "
           f"to {out} ({len(shards)} safetensors file{'s' if len(shards) > 1 else ''})")
    return out


def _run_tokenizer(ref: CheckpointRef) -> Path | None:
    """The tokenizer the run trained with, kept in its run directory (a local checkpoint
    folder's parent); None for byte-level runs and remote checkpoints."""
    if "://" in ref.root:
        return None
    path = RunDir(Path(ref.root).parent).tokenizer
    return path if path.is_file() else None


def _recorded_config(ref: CheckpointRef, manifest: dict[str, Any]) -> Config:
    """The run's config as the checkpoint's manifest recorded it."""
    recorded = manifest.get("config")
    try:
        return config_from_dict(tomllib.loads(recorded)) if isinstance(recorded, str) else Config()
    except (ValueError, ConfigError) as exc:
        raise CheckpointToolError(f"{ref.location}: the run config its manifest recorded cannot be read ({exc}); "
                                  "export a checkpoint written by this version of meshyard") from None


def _target(cfg: Config, shapes: dict[str, TensorStorageMetadata]) -> _Target:
    """meshyard's GPT becomes GPT2LMHeadModel; a Hugging Face model keeps its architecture;
    other models are refused with the reason."""
    name = cfg.model.name
    if name == HF_MODEL or is_custom_reference(name):
        return _hugging_face_target(cfg, shapes)
    if name == "mlp" or "tok_emb.weight" not in shapes or "pos_emb.weight" not in shapes:
        raise CheckpointToolError(_NOT_EXPORTABLE.format(name=name))
    shape = gpt_shape(cfg.model, int(shapes["tok_emb.weight"].size[0]), int(shapes["pos_emb.weight"].size[0]))
    try:
        return _Target(gpt2_config(shape), {key: gpt2_name(key, shape.tie_embeddings) for key in shapes})
    except NotGPT2 as exc:
        raise CheckpointToolError(f"this checkpoint's GPT cannot be written as GPT2LMHeadModel: {exc}") from None


_NOT_EXPORTABLE = ("--format hf writes meshyard's GPT (as GPT2LMHeadModel) and Hugging Face architectures; this "
                   "checkpoint's model is '{name}'. Export it as one file instead (--out model.safetensors), which "
                   "any PyTorch code can load")


def _hugging_face_target(cfg: Config, shapes: dict[str, TensorStorageMetadata]) -> _Target:
    """The run's model built on the meta device (from ``model.init_from``'s config.json, or
    by the run's builder); exportable when it is a ``transformers`` model, whose config
    and tensor names the folder keeps."""
    try:
        with torch.device("meta"):
            model = build_model(cfg.model, _vocab_of(cfg, shapes), cfg.model.context_length or cfg.data.seq_len)
    except Exception as exc:  # a builder that cannot run here (file moved, missing package)
        reason = (str(exc).splitlines() or [type(exc).__name__])[0]
        raise CheckpointToolError(f"the run's model '{cfg.model.name}' cannot be built here to read its architecture "
                                  f"({reason}); export it as one file instead (--out model.safetensors)") from None
    config = getattr(model, "config", None)
    if config is None or not hasattr(config, "to_dict"):
        raise CheckpointToolError(_NOT_EXPORTABLE.format(name=cfg.model.name))
    record = config.to_dict()
    record["architectures"] = [type(model).__name__]
    record.pop("use_cache", None)  # training switched it off; a loaded model decides for itself
    tied = {name for names in tied_groups(model) for name in names[1:]}  # stored once, under the first
    return _Target(record, {key: (None if key in tied else (key, False)) for key in shapes})


def _vocab_of(cfg: Config, shapes: dict[str, TensorStorageMetadata]) -> int:
    """The vocabulary the run built its model with: configured, or the rows of its token
    embedding (the first 2-D tensor whose name says it embeds tokens)."""
    if cfg.model.vocab_size or cfg.data.vocab_size:
        return cfg.model.vocab_size or cfg.data.vocab_size
    for name, meta in shapes.items():
        if len(meta.size) == 2 and any(part in name for part in ("embed_tokens", "wte", "embed_in", "tok")):
            return int(meta.size[0])
    return 256


def _bytes(meta: TensorStorageMetadata) -> int:
    return int(torch.Size(meta.size).numel()) * meta.properties.dtype.itemsize


def _shards(stored: dict[str, Any], shapes: dict[str, TensorStorageMetadata], max_bytes: int) -> list[list[str]]:
    """The stored tensors in checkpoint order, cut into runs of at most ``max_bytes`` (a
    larger tensor gets a shard of its own)."""
    shards: list[list[str]] = [[]]
    size = 0
    for name in stored:
        nbytes = _bytes(shapes[name])
        if shards[-1] and size + nbytes > max_bytes:
            shards.append([])
            size = 0
        shards[-1].append(name)
        size += nbytes
    return shards


def _dtype_name(shapes: dict[str, TensorStorageMetadata]) -> str:
    dtypes = {meta.properties.dtype for meta in shapes.values()}
    return str(dtypes.pop()).removeprefix("torch.") if len(dtypes) == 1 else "float32"

