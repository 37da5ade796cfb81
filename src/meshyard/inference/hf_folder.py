"""A Hugging Face model folder as a served model: what ``meshyard ckpt export --format hf``
writes, or any causal language model saved with ``save_pretrained`` (config.json, safetensors
weights, optionally its ``tokenizer.json`` and chat template). It is loaded with ``transformers``
(``AutoModelForCausalLM.from_pretrained``, local files only) and runs in the eager runtime.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import torch

from meshyard.data.tokenizer import TextTokenizer
from meshyard.extras import require
from meshyard.inference.chat_template import read_chat_template
from meshyard.inference.engine import EagerEngine, Engine
from meshyard.inference.placement import CPU, Placement
from meshyard.inference.source import ModelSource, ModelSourceError
from meshyard.models.hf_auto import CONFIG_FILE, hf_config, hf_vocab_size
from meshyard.run_dir import RunDir

WEIGHT_SUFFIXES = (".safetensors", ".bin")
CONTEXT_KEYS = ("n_positions", "max_position_embeddings", "n_ctx", "seq_length")


def is_hf_folder(path: Path) -> bool:
    """A folder with a Hugging Face config.json and weights, and no meshyard run config."""
    return (path.is_dir() and (path / CONFIG_FILE).is_file() and not (path / RunDir.CONFIG).is_file()
            and any(child.suffix in WEIGHT_SUFFIXES for child in path.iterdir()))


def describe_hf_folder(path: str, name: str | None = None) -> ModelSource:
    """The folder's served name (its own name unless given), a version digest of its config
    and weight files, vocabulary, context length, tokenizer and chat template, without
    loading weights."""
    folder = Path(path).expanduser()
    config = hf_config(folder)
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    context = next((int(getattr(text, key)) for key in CONTEXT_KEYS if isinstance(getattr(text, key, None), int)), 0)
    vocab = hf_vocab_size(config)
    if not vocab or not context:
        raise ModelSourceError(f"{folder / CONFIG_FILE} names no vocabulary size or context length "
                               f"({', '.join(CONTEXT_KEYS)}); give a causal language model folder")
    weights = sorted(child for child in folder.iterdir() if child.suffix in WEIGHT_SUFFIXES)
    digest = hashlib.sha256((folder / CONFIG_FILE).read_bytes())
    digest.update(json.dumps([(child.name, child.stat().st_size, child.stat().st_mtime_ns)
                              for child in weights]).encode())
    tokenizer_file = folder / RunDir.TOKENIZER
    tokenizer = TextTokenizer.from_str(tokenizer_file.read_text()) if tokenizer_file.is_file() else None
    return ModelSource(path=path, name=name or folder.name, version=f"hf.{digest.hexdigest()[:6]}", vocab_size=vocab,
                       context_length=context, tokenizer=tokenizer,
                       estimated_bytes=sum(child.stat().st_size for child in weights), config=None,
                       chat_template=read_chat_template(folder) if tokenizer is not None else None)


def load_hf_engine(source: ModelSource, placement: Placement = CPU) -> Engine:
    """The folder's model in eval mode, on the placement's device in its dtype."""
    transformers = require("transformers", "serving a Hugging Face model folder")
    try:
        module = transformers.AutoModelForCausalLM.from_pretrained(str(Path(source.path).expanduser()),
                                                                   local_files_only=True, dtype=placement.dtype)
    except (OSError, ValueError) as exc:
        raise ModelSourceError(f"{source.path} cannot be loaded as a Hugging Face causal language model "
                               f"({(str(exc).splitlines() or [type(exc).__name__])[0]})") from None
    return EagerEngine(module.to(placement.device).eval(), source.vocab_size, source.context_length)
