"""``model.init_from`` in a run: the source checked against the data before the model is
built, and the weights read (``checkpoint.initialize``) after it is parallelized and
materialized, unless the run resumed a checkpoint of its own.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

from torch import nn

from meshyard.checkpoint.init_source import InitSource, InitSourceError, find_source, kind_problem
from meshyard.checkpoint.initialize import NameMap, load_initial_weights
from meshyard.config.load import ConfigError
from meshyard.config.sections import DataConfig, ModelConfig
from meshyard.models.gpt import GPT_PRESETS
from meshyard.train.facts import Resumed


@dataclass(frozen=True)
class StartFrom:
    """Where a new run's weights come from, and how the model's names map onto it."""

    source: InitSource
    gpt2: bool

    def names(self, ties: list[set[str]]) -> NameMap:
        return NameMap(gpt2=self.gpt2, ties=ties)


def start_from(model: ModelConfig, data: DataConfig, data_vocab: int, data_description: str) -> StartFrom | None:
    """The checked source of ``model.init_from`` (None when it is empty). Raises the
    ``ConfigError`` of a source that is missing or of no known kind, or whose vocabulary
    is not the data's."""
    if not model.init_from:
        return None
    try:
        source = find_source(model.init_from)
    except InitSourceError as exc:
        raise ConfigError([str(exc)], "model.init_from") from None
    problem = kind_problem(model.name, source) or vocabulary_problem(source, data, data_vocab, data_description)
    if problem:
        raise ConfigError([problem], "model.init_from")
    gpt = model.name == "gpt" or model.name in GPT_PRESETS
    return StartFrom(source, gpt2=gpt and source.kind == "hf")


def vocabulary_problem(source: InitSource, data: DataConfig, data_vocab: int, description: str) -> str | None:
    """A source whose vocabulary is not the data's: its token ids would mean other tokens.
    Token files without ``data.vocab_size`` only bound it from below (their largest id)."""
    vocab = source.vocab_size
    if vocab is None or not data_vocab or vocab == data_vocab:
        return None
    inferred = data.source == "tokens" and not data.vocab_size
    if inferred and data_vocab <= vocab:
        return None
    return (f"model.init_from = '{source.path}' has a vocabulary of {vocab} token ids (vocab_size in its config.json) "
            f"but the data ({description}) has {data_vocab}; the model would read the data's ids as other tokens. "
            f"Tokenize the data with the model's own tokenizer (data.source = 'tokens' with data.vocab_size = "
            f"{vocab}), or start from a model of the data's vocabulary")


def initialize(model: nn.Module, start: StartFrom | None, ties: list[set[str]], resumed: Resumed | None,
               report: Callable[[str], None], note: Callable[[str], None]) -> None:
    """Read the weights of ``start`` into ``model`` unless the run resumed its own
    checkpoint (``resumed``), which wins: said once in the log."""
    if start is None:
        return
    if resumed is not None:
        report(f"model.init_from = '{start.source.path}' ignored: the run resumed from its own checkpoint "
               f"{resumed.checkpoint} (step {resumed.step})")
        return
    load_initial_weights(model, start.source, start.names(ties), note)
