"""From a path a user gave to a served model: what it is (``describe``, cheap) and the
loaded engine (``load_engine``).

A path is one of:

- a run directory: its ``config.toml`` and its newest valid checkpoint (and a chat template
  beside its tokenizer, ``meshyard.inference.chat_template``);
- a checkpoint (``.../checkpoints/step-N``) or a folder of them: that checkpoint, or the
  folder's newest valid one, with the config of the run directory that holds them (else
  the config the checkpoint's manifest recorded);
- a file: a model written by ``meshyard export``, described and loaded by
  ``meshyard.inference.runtimes``;
- a Hugging Face model folder (``meshyard ckpt export --format hf`` writes one), described
  and loaded by ``meshyard.inference.hf_folder``.

``describe`` reads configs and manifests only, so a server can list and route every
model before loading any. Its version names exactly the checkpoint it found, and
``load_engine`` loads that checkpoint, not a newer one saved in between.
"""

from __future__ import annotations

import hashlib
import json
import logging
import tomllib
from pathlib import Path
from typing import Any

import torch
from torch.distributed.checkpoint.metadata import TensorStorageMetadata

from meshyard.checkpoint.locate import KINDS as LOCATE_KINDS
from meshyard.checkpoint.locate import CheckpointRef, LocationError, locate
from meshyard.checkpoint.tools import model_state, model_tensor_metadata
from meshyard.config.load import ConfigError, config_from_dict, load_config
from meshyard.config.sections import Config, DataConfig, ModelConfig
from meshyard.data.corpus import BYTE_VOCAB
from meshyard.inference.chat_template import read_chat_template
from meshyard.inference.engine import EagerEngine, Engine
from meshyard.inference.hf_folder import describe_hf_folder, is_hf_folder, load_hf_engine
from meshyard.inference.placement import resolve, resolve_for_export
from meshyard.inference.runtimes import describe_export, load_export_engine
from meshyard.inference.source import KINDS, ModelSource, ModelSourceError, build_served_model
from meshyard.inference.tokenizer import BYTE_SOURCES, Tokenizer, tokenizer_for
from meshyard.run_dir import RunDir

log = logging.getLogger(__name__)

CONFIG_FILE = RunDir.CONFIG


def describe(path: str, name: str | None = None) -> ModelSource:
    """What ``path`` serves (see the module docstring), under ``name`` or its run's name.

    Raises ``ModelSourceError`` when the path does not exist, holds no valid checkpoint,
    or has no config to build the model from.
    """
    target = Path(path).expanduser()
    if target.is_file():
        return describe_export(path, name)
    if not target.exists():
        raise ModelSourceError(f"{path} does not exist; {KINDS}")
    if is_hf_folder(target):
        return describe_hf_folder(path, name)
    ref = _checkpoint_of(path)
    config, run_dir = _config_of(target, ref)
    tokenizer = tokenizer_for(config.data, run_dir)
    return ModelSource(
        path=path, name=name or config.run.name, version=version_of(ref),
        vocab_size=_vocab_size(config.model, config.data, tokenizer, ref, path),
        context_length=config.model.context_length or config.data.seq_len, tokenizer=tokenizer,
        estimated_bytes=_estimated_bytes(ref, config.model.tie_embeddings), config=config, checkpoint=ref.location,
        chat_template=read_chat_template(run_dir) if run_dir is not None and tokenizer is not None else None,
    )


def load_engine(source: ModelSource, runtime: str = "eager", device: str = "cpu", dtype: str = "auto") -> Engine:
    """The engine of ``source``: an export through its runtime (on the CPU, see
    ``placement.resolve_for_export``), a checkpoint or Hugging Face folder as an
    ``EagerEngine`` whose weights are on ``device`` in ``dtype`` (``serve.device`` and
    ``serve.dtype`` settings, resolved by ``meshyard.inference.placement``)."""
    if not source.checkpoint and Path(source.path).expanduser().is_file():
        resolve_for_export(device, dtype, f"{source.path} (a file written by meshyard export)")
        return load_export_engine(source, runtime)
    hf_folder = not source.checkpoint and is_hf_folder(Path(source.path).expanduser())
    if hf_folder and runtime == "eager":
        return load_hf_engine(source, resolve(device, dtype))
    if hf_folder:
        raise ModelSourceError(f"{source.path} is a Hugging Face model folder, which runs only in the 'eager' runtime, "
                               f"not '{runtime}'; serve it with --runtime eager")
    if runtime != "eager":
        raise ModelSourceError(
            f"{source.path} is a checkpoint, which runs only in the 'eager' runtime, not '{runtime}'; export "
            f"the model first with meshyard export {source.path} --format torchscript --out MODEL.pt (or "
            "--format onnx for onnxruntime) and serve that file, or serve this path with --runtime eager")
    if source.config is None:
        raise ModelSourceError(f"{source.path}: no run config is known, so the model cannot be built; {KINDS}")
    placement = resolve(device, dtype)
    ref = _checkpoint_of(source.checkpoint or source.path)
    module = build_served_model(source.config, source.vocab_size, source.path,
                                "serve from where its model file can be found (the run's model.name is resolved "
                                "from the current directory unless absolute)", placement.device)
    _load_weights(module, model_state(ref), ref)
    # Loaded in the checkpoint's fp32, then cast: the copy from the checkpoint stays exact.
    return EagerEngine(module.to(placement.dtype), source.vocab_size, source.context_length)


def version_of(ref: CheckpointRef) -> str:
    """``step-<N>.<6 hex>``: the checkpoint's step and a digest of its manifest, which
    records every file's checksum, so two runs' checkpoints of one step differ."""
    step = ref.manifest.get("step", int(ref.name.rpartition("-")[2]))
    digest = hashlib.sha256(json.dumps(ref.manifest, sort_keys=True).encode()).hexdigest()
    return f"step-{step}.{digest[:6]}"


def _checkpoint_of(location: str) -> CheckpointRef:
    """The newest valid checkpoint ``location`` names (or that one checkpoint). Why newer
    checkpoints were skipped is logged, and is part of the error when none is valid."""
    skipped: list[str] = []

    def report(message: str) -> None:
        skipped.append(message)
        log.warning("%s", message)

    try:
        return locate(location, {}, report=report)
    except LocationError as exc:
        # locate's own advice speaks of resuming; the server's takes its place.
        problem = str(exc).removesuffix(f"; {LOCATE_KINDS}").removesuffix("; give a checkpoint kept elsewhere")
        reasons = "; ".join(message.removesuffix("; trying the previous one") for message in skipped)
        problem = problem.replace("(the reasons are above)", f"({reasons})" if reasons else "")
        raise ModelSourceError(f"{problem}; to serve a model {KINDS}") from None


def _config_of(target: Path, ref: CheckpointRef) -> tuple[Config, Path | None]:
    """The run's config: ``config.toml`` of the run directory given or holding the
    checkpoint folder, else the config the checkpoint's manifest recorded; and that run
    directory (None for a manifest's config)."""
    for candidate in (target / CONFIG_FILE, Path(ref.root).parent / CONFIG_FILE):
        if candidate.is_file():
            try:
                return load_config(candidate), candidate.parent
            except ConfigError as exc:
                raise ModelSourceError(f"{candidate} cannot be read as a meshyard config ({'; '.join(exc.problems)}); "
                                       "fix it, or serve a checkpoint whose run config is readable") from None
    recorded = ref.manifest.get("config")
    if isinstance(recorded, str):
        try:
            return config_from_dict(tomllib.loads(recorded)), None
        except (ValueError, ConfigError):
            pass  # reported below, as no config at all
    raise ModelSourceError(f"{target}: found the checkpoint {ref.location} but no run config beside it (no "
                           f"{CONFIG_FILE} in the run directory, none recorded in its manifest), so the model "
                           f"cannot be built; {KINDS}")


def _model_tensors(ref: CheckpointRef) -> dict[str, TensorStorageMetadata]:
    """The model's tensors in the checkpoint's DCP metadata (shapes and dtypes, no data);
    empty when the metadata cannot be read."""
    try:
        return model_tensor_metadata(ref)
    except Exception as exc:  # a damaged or foreign file: fall back to what else is known
        log.warning("cannot read the tensor metadata of %s: %s", ref.location, exc)
        return {}


def _estimated_bytes(ref: CheckpointRef, tied_embeddings: bool) -> int:
    """Bytes of the model's tensors, else of all the checkpoint's files. The checkpoint holds a
    tied output head under its own name too; it is counted once, as it is held once."""
    tensors = _model_tensors(ref)
    if tensors:
        if tied_embeddings and "tok_emb.weight" in tensors:
            tensors.pop("lm_head.weight", None)
        return sum(t.size.numel() * t.properties.dtype.itemsize for t in tensors.values())
    files: dict[str, Any] = ref.manifest.get("files", {})
    return sum(int(f.get("size", 0)) for f in files.values())


def _vocab_size(model: ModelConfig, data: DataConfig, tokenizer: Tokenizer | None, ref: CheckpointRef,
                path: str) -> int:
    """The ids the model is served with: ``model.vocab_size``, else the data's (its
    tokenizer's for text, 256 for unsized random tokens, else ``data.vocab_size``), else
    the rows of the checkpoint's token embedding. A vocabulary padded for speed
    (``model.pad_vocab_multiple``) is not: the padded ids are never served."""
    if model.vocab_size:
        return model.vocab_size
    if data.source in BYTE_SOURCES and tokenizer is not None:
        return tokenizer.vocab_size
    if data.vocab_size:
        return data.vocab_size
    if data.source == "random":
        return BYTE_VOCAB
    rows = vocab_from_shapes({key: tuple(t.size) for key, t in _model_tensors(ref).items()})
    if rows is None:
        raise ModelSourceError(f"{path}: the vocabulary size is not in the run's config (model.vocab_size, "
                               "data.vocab_size) and no token embedding was found in the checkpoint; set "
                               f"model.vocab_size in the run's {RunDir.CONFIG} and serve it again")
    return rows


def vocab_from_shapes(shapes: dict[str, tuple[int, ...]]) -> int | None:
    """The vocabulary of a language model's state from its tensor shapes: the rows of its
    token embedding (a 2-D ``*emb*`` weight that is not a position embedding), else of its
    output head; None when neither is found."""
    matrices = {key: shape for key, shape in shapes.items() if len(shape) == 2 and key.endswith("weight")}
    embeddings = [shape[0] for key, shape in matrices.items() if "emb" in key and "pos" not in key]
    heads = [shape[0] for key, shape in matrices.items() if key.rpartition(".")[0].endswith(("head", "output"))]
    found = embeddings or heads
    return found[0] if found else None


def _load_weights(module: torch.nn.Module, state: dict[str, torch.Tensor], ref: CheckpointRef) -> None:
    """Copy the checkpoint's tensors into ``module``; every key and shape must match."""
    fix = f"serve the run directory that saved this checkpoint, with its own {RunDir.CONFIG}"
    try:
        result = module.load_state_dict(state, strict=False)
    except RuntimeError as exc:  # a shape that differs
        raise ModelSourceError(f"{ref.location} does not fit the model its run's config builds "
                               f"({str(exc).splitlines()[-1].strip()}); {fix}") from None
    if result.missing_keys or result.unexpected_keys:
        raise ModelSourceError(
            f"{ref.location} does not fit the model its run's config builds: missing {result.missing_keys[:5]}, "
            f"unexpected {result.unexpected_keys[:5]}; {fix}")
