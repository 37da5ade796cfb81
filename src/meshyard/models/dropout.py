"""Dropout a model applies in training, found and switched off on the model as built.

Dropout draws its masks from the random stream of each rank, so two layouts of one job
(or one process against several) train on different masks: their losses differ by
design, not by error. ``meshyard verify`` therefore compares with dropout off
(``model.no_dropout``). meshyard's GPT takes ``model.dropout``; a model brought by its
user holds its rates itself, in three places this module reads and zeroes:

- ``nn.Dropout`` (and its 1d/2d/3d, alpha and feature-alpha kin) modules, by ``p``;
- float rates a module holds as attributes and passes to ``F.dropout`` or to
  ``scaled_dot_product_attention`` in its forward (Hugging Face OPT's decoder layers keep
  ``self.dropout = config.dropout``; attention modules ``attention_dropout``), any
  attribute whose name holds "drop" (``dropout``, ``resid_pdrop``, ``layerdrop``);
- the same names on a Hugging Face model's ``config``, so that what is read from it
  later (and what is saved with the model) agrees.

Nothing here needs tensor values: it works on the meta device.
"""

from __future__ import annotations

import re

from torch import nn

_RATE = re.compile(r"drop", re.IGNORECASE)


def active_dropout(model: nn.Module) -> list[str]:
    """What in ``model``'s modules applies dropout in training, as ``name = rate``
    (repeated blocks said once: ``model.decoder.layers.*.dropout = 0.1``); [] when
    nothing does. Config entries are not listed: a config holds rates for heads the
    model may not have (a classifier's), which its forward never applies."""
    return list(dict.fromkeys(f"{_pattern(name)} = {rate:g}" for name, rate, _ in _rates(model)
                              if rate > 0 and not name.startswith("config.")))


def switch_off_dropout(model: nn.Module) -> list[str]:
    """Set every dropout rate of ``model`` (and of its config) to 0; returns what was on
    in its modules (``active_dropout``)."""
    found = active_dropout(model)
    for _, _, zero in _rates(model):
        zero()
    return found


def _rates(model: nn.Module) -> list[tuple[str, float, object]]:
    """(qualified name, rate, a function that zeroes it) for every dropout rate found."""
    found: list[tuple[str, float, object]] = []
    for path, module in model.named_modules():
        if isinstance(module, nn.modules.dropout._DropoutNd):
            found.append((_join(path, "p"), float(module.p), _setter(module, "p")))
            continue
        found += [(_join(path, key), value, _setter(module, key)) for key, value in _float_rates(vars(module))]
    config = getattr(model, "config", None)
    if config is not None and not isinstance(config, nn.Module):
        found += [(f"config.{key}", value, _setter(config, key)) for key, value in _float_rates(vars(config))]
    return found


def _float_rates(attributes: dict) -> list[tuple[str, float]]:
    """Attributes named like a dropout rate whose value is a probability."""
    return [(key, float(value)) for key, value in attributes.items()
            if not key.startswith("_") and _RATE.search(key) and isinstance(value, float) and 0.0 <= value < 1.0]


def _setter(owner: object, key: str) -> object:
    def zero() -> None:
        setattr(owner, key, 0.0)
    return zero


def _pattern(name: str) -> str:
    """``model.layers.3.dropout`` -> ``model.layers.*.dropout``: one entry for all blocks."""
    return re.sub(r"(?<=\.)\d+(?=\.|$)", "*", name)


def _join(path: str, name: str) -> str:
    return f"{path}.{name}" if path else name
