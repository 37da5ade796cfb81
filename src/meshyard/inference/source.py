"""What a served model is before its weights are loaded (``ModelSource``), the error of a
path that cannot be served, and building the run's model for its weights.

Both ways to a model stand on this module: a run's checkpoint (``meshyard.inference.loading``)
and a file written by ``meshyard export`` (``meshyard.inference.runtimes``).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from meshyard.config.sections import Config
from meshyard.errors import BadInput
from meshyard.inference.chat_template import ChatTemplate
from meshyard.inference.tokenizer import Tokenizer
from meshyard.models.registry import build_model
from meshyard.plugins import PluginError
from meshyard.run_dir import RunDir

KINDS = (f"give a run directory (it holds {RunDir.CONFIG} and {RunDir.CHECKPOINTS}/), one of its checkpoints "
         f"(.../{RunDir.CHECKPOINTS}/step-NNNNNNNN), a file written by 'meshyard export', or a Hugging Face model "
         "folder (config.json and safetensors weights)")


class ModelSourceError(BadInput, ValueError):
    """A path that cannot be served; the message names it and says what to give instead."""


@dataclass(frozen=True)
class ModelSource:
    """A model to serve, as far as it is known without loading its weights."""

    path: str  # what the user gave
    name: str  # served name (run.name unless NAME=PATH)
    version: str  # "step-<N>.<6 hex of the manifest's digest>"; an export: its own
    vocab_size: int
    context_length: int
    tokenizer: Tokenizer | None = field(compare=False)
    estimated_bytes: int  # the checkpoint's model tensors, or the export's size
    config: Config | None = field(compare=False, repr=False)  # the run's config, when there is one
    checkpoint: str = ""  # the checkpoint this version is (empty for an export)
    # How chat messages become its prompt, when its tokenizer folder carries a template
    # (``meshyard.inference.chat_template``); the server may set or replace it.
    chat_template: ChatTemplate | None = field(default=None, compare=False, repr=False)


def build_served_model(config: Config, vocab_size: int, where: object, fix: str,
                       device: str | torch.device = "cpu") -> torch.nn.Module:
    """The run's model, freshly built on ``device`` with the served vocabulary; a model that
    cannot be built here is a ModelSourceError naming ``where`` it came from and the ``fix``."""
    try:
        with torch.device(device):
            return build_model(config.model, vocab_size, config.data.seq_len)
    except (PluginError, TypeError) as exc:
        raise ModelSourceError(f"{where}: the model '{config.model.name}' cannot be built here ({exc}); "
                               f"{fix}") from None
