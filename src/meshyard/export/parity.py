"""Whether an export computes what the eager model computes, on the run's held-out data.

The held-out samples are the ones evaluation uses during training: the run's data config
gives the same split (``data.val_fraction`` of the samples, from the end of the corpus, or
a custom dataset's "val" split) and ``eval_indices`` picks the batches. Two figures come
out: the largest absolute difference of any logit, and the eval loss of each side.
"""

from __future__ import annotations

import logging
import math
import statistics
import time
from dataclasses import dataclass
from typing import Callable

import torch
from torch.utils.data import Dataset, default_collate

from meshyard.config.sections import DataConfig
from meshyard.data.loader import custom_datasets, split_corpus
from meshyard.data.sampling import eval_indices
from meshyard.plugins import is_custom_reference
from meshyard.train.loss import next_token_loss

log = logging.getLogger(__name__)

Forward = Callable[[torch.Tensor], torch.Tensor]
Batch = tuple[torch.Tensor, torch.Tensor]


@dataclass(frozen=True)
class HeldOut:
    """Batches of (inputs, targets) to compare on, and where they come from (for the report)."""

    batches: list[Batch]
    description: str


@dataclass(frozen=True)
class Parity:
    """Eager against export on the same batches."""

    max_abs_diff: float  # largest |logit difference| over every position and token
    eager_loss: float
    export_loss: float

    @property
    def loss_change(self) -> float:
        """The export's eval loss minus the eager one."""
        return self.export_loss - self.eager_loss

    @property
    def relative_loss_change(self) -> float:
        """The loss change as a fraction of the eager loss (0.02 = 2% worse)."""
        return self.loss_change / self.eager_loss if self.eager_loss else math.inf

    def as_dict(self) -> dict[str, float]:
        return {"max_abs_logit_diff": self.max_abs_diff, "eager_loss": self.eager_loss,
                "export_loss": self.export_loss, "loss_change": self.loss_change,
                "relative_loss_change": self.relative_loss_change}


def held_out(data: DataConfig, batches: int, batch_size: int = 8) -> HeldOut:
    """Up to ``batches`` batches of the run's held-out samples (fewer when the split is
    smaller). A run without a held-out split (``data.val_fraction = 0``) is checked on the
    last samples of its training split instead, and the description says so."""
    if is_custom_reference(data.source):
        train, val, _, _ = custom_datasets(data)
    else:
        train, val, *_ = split_corpus(data)
    if val is not None and len(val) > 0:
        samples, where = val, "held-out"
    else:
        samples, where = _Tail(train, batches * batch_size), "last training (the run holds no held-out split)"
    size = min(batch_size, len(samples))
    count = max(1, min(batches, len(samples) // size))
    chosen = [default_collate([samples[i] for i in indices])
              for indices in eval_indices(len(samples), size, count, 0, 1)]
    return HeldOut([(inputs, targets) for inputs, targets in chosen],
                   f"{count} batch(es) of {size} {where} samples of {chosen[0][0].shape[1]} tokens")


class _Tail(Dataset):
    """The last ``count`` samples of a dataset."""

    def __init__(self, dataset: Dataset, count: int) -> None:
        self.dataset, self.first = dataset, max(0, len(dataset) - count)

    def __len__(self) -> int:
        return len(self.dataset) - self.first

    def __getitem__(self, index: int):
        return self.dataset[self.first + index]


def shape_probes(batches: list[Batch]) -> list[torch.Tensor]:
    """Inputs of other sizes cut from the first batch (one token of one row; an odd number
    of rows and positions): an export that fixed the example's shape fails on them."""
    inputs = batches[0][0]
    rows, width = inputs.shape
    return [inputs[:1, :1], inputs[: max(1, rows - 1), : max(1, width // 2 + 1)]]


@torch.inference_mode()
def compare(eager: Forward, export: Forward, held: HeldOut) -> Parity:
    """Run both on every held-out batch and on the shape probes; the largest absolute logit
    difference over all of them, and each side's mean eval loss over the batches."""
    worst, eager_losses, export_losses = 0.0, [], []
    for inputs, targets in held.batches:
        reference, candidate = eager(inputs).float(), export(inputs).float()
        worst = max(worst, _max_diff(reference, candidate))
        eager_losses.append(next_token_loss(reference, targets).item())
        export_losses.append(next_token_loss(candidate, targets).item())
    for probe in shape_probes(held.batches):
        try:
            candidate = export(probe).float()
        except Exception:  # noqa: BLE001 - an export that fixed the example's shape: refused, not a crash
            log.debug("the export failed on an input of shape %s", tuple(probe.shape), exc_info=True)
            return Parity(math.inf, statistics.fmean(eager_losses), statistics.fmean(export_losses))
        worst = max(worst, _max_diff(eager(probe).float(), candidate))
    return Parity(worst, statistics.fmean(eager_losses), statistics.fmean(export_losses))


def _max_diff(reference: torch.Tensor, candidate: torch.Tensor) -> float:
    """The largest absolute difference; infinite for another shape or a non-finite logit
    (NaN would otherwise lose every comparison and pass as no difference)."""
    if reference.shape != candidate.shape:
        return math.inf
    diff = (reference - candidate).abs().max().item()
    return diff if math.isfinite(diff) else math.inf


@torch.inference_mode()
def seconds_per_forward(forward: Forward, tokens: torch.Tensor, repeats: int = 5) -> float:
    """Median seconds of one forward over ``tokens``, after one call to warm up."""
    forward(tokens)
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        forward(tokens)
        times.append(time.perf_counter() - start)
    return statistics.median(times)
