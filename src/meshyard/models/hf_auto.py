"""``model.name = "hf"``: a Hugging Face causal language model built from the
``config.json`` of the folder in ``model.init_from`` (no builder file, no download).

The model is built with random weights (``AutoModelForCausalLM.from_config``), in fp32
whatever dtype the folder was saved in (meshyard keeps fp32 master weights and casts
for compute), and without a generation cache (training never reuses one); its weights
are then read from the folder by ``meshyard.checkpoint.initialize``, each rank its own
shards, after the model is parallelized.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from torch import nn

from meshyard.extras import require

HF_MODEL = "hf"
CONFIG_FILE = "config.json"


class HFModelError(ValueError):
    """The folder's config.json describes no causal language model transformers can build."""


def hf_config(folder: str | Path) -> Any:
    """The folder's config as ``transformers.AutoConfig`` reads it (local files only)."""
    transformers = require("transformers", "model.name = 'hf'")
    try:
        return transformers.AutoConfig.from_pretrained(str(folder), local_files_only=True)
    except (OSError, ValueError, KeyError) as exc:
        raise HFModelError(f"{Path(folder) / CONFIG_FILE} cannot be read as a Hugging Face model config "
                           f"({str(exc).splitlines()[0] if str(exc) else type(exc).__name__})") from None


def build_hf_model(folder: str | Path) -> nn.Module:
    """The causal LM the folder's config.json describes, randomly initialised, in fp32."""
    transformers = require("transformers", "model.name = 'hf'")
    config = hf_config(folder)
    config.use_cache = False
    try:
        return transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    except ValueError as exc:
        architectures = ", ".join(getattr(config, "architectures", None) or [type(config).__name__])
        raise HFModelError(f"{Path(folder) / CONFIG_FILE} describes {architectures}, which transformers "
                           f"{transformers.__version__} cannot build as a causal language model "
                           f"(AutoModelForCausalLM): {str(exc).splitlines()[0]}") from None


def hf_vocab_size(config: Any) -> int | None:
    """The vocabulary of a Hugging Face config (of its text model, for composite ones)."""
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    vocab = getattr(text, "vocab_size", None)
    return int(vocab) if isinstance(vocab, int) else None


def hf_ties_embeddings(config: Any) -> bool:
    """Whether the model shares its token embedding with its output head."""
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    return bool(getattr(text, "tie_word_embeddings", getattr(config, "tie_word_embeddings", False)))
