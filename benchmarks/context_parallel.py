"""Activation memory per rank against sequence length, with context parallelism cp = 1, 2, 4.

For each cp, that many gloo ranks build the same GPT, ``apply_cp`` takes over its
attention and positions (cp > 1), and each rank runs one forward of its share of a batch
of sequences (``SequenceSplit.local``) and the split loss, then the backward. What the
forward saves for backward is counted as it is saved (``torch.autograd.graph.
saved_tensors_hooks``): the bytes of every distinct storage saved, parameters left out.
That is the activation memory at its peak, the start of backward. The ring's own saved
tensors (queries, keys, values, output, log-sum-exp) count like any others. Expected:
about 1/cp of cp = 1's at every length.

    python benchmarks/context_parallel.py [--model gpt-mini] [--seq 512,1024,2048,4096] [--batch 2]
"""

from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch.distributed.device_mesh import init_device_mesh

from meshyard.config.sections import ModelConfig
from meshyard.models.outputs import logits_of
from meshyard.models.registry import build_model
from meshyard.parallel.context_parallel import apply_cp
from meshyard.train.loss import next_token_loss, split_sequence_loss

VOCAB = 256


class SavedBytes:
    """Bytes of the distinct storages autograd saves while active (parameters excluded)."""

    def __init__(self, parameters: set[int]) -> None:
        self.parameters, self.storages = parameters, {}

    def pack(self, tensor: torch.Tensor) -> torch.Tensor:
        storage = tensor.untyped_storage()
        if storage.data_ptr() not in self.parameters:
            self.storages[storage.data_ptr()] = storage.nbytes()
        return tensor

    @property
    def total(self) -> int:
        return sum(self.storages.values())


def _measure(model: torch.nn.Module, tokens: torch.Tensor, split) -> tuple[int, float]:
    """(bytes saved for backward by one forward and loss, seconds of forward + backward)."""
    parameters = {p.untyped_storage().data_ptr() for p in model.parameters()}
    saved = SavedBytes(parameters)
    inputs, targets = tokens[:, :-1], tokens[:, 1:]
    start = time.perf_counter()
    with torch.autograd.graph.saved_tensors_hooks(saved.pack, lambda tensor: tensor):
        if split is None:
            loss = next_token_loss(logits_of(model(inputs)), targets)
        else:
            loss = split_sequence_loss(logits_of(model(split.local(inputs))), split.local(targets),
                                       split.ring.group, split.size)
    loss.backward()
    return saved.total, time.perf_counter() - start


def _rank(rank: int, world: int, folder: str, model_name: str, lengths: list[int], batch: int) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", store=dist.FileStore(str(Path(folder) / "store"), world), rank=rank,
                            world_size=world)
    try:
        mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("cp",))
        torch.manual_seed(0)
        model = build_model(ModelConfig(name=model_name), VOCAB, max(lengths))
        split = apply_cp(model, mesh["cp"]) if world > 1 else None
        figures = {}
        for length in lengths:
            tokens = torch.randint(0, VOCAB, (batch, length + 1), generator=torch.Generator().manual_seed(length))
            model.zero_grad(set_to_none=True)
            figures[length] = _measure(model, tokens, split)
        torch.save(figures, Path(folder) / f"rank{rank}.pt")
        dist.barrier()
    finally:
        dist.destroy_process_group()


def measure(model_name: str, cp: int, lengths: list[int], batch: int) -> dict[int, tuple[int, float]]:
    """Per length: the largest rank's saved bytes and the slowest rank's seconds."""
    with tempfile.TemporaryDirectory() as folder:
        mp.spawn(_rank, args=(cp, folder, model_name, lengths, batch), nprocs=cp, join=True)
        per_rank = [torch.load(Path(folder) / f"rank{r}.pt") for r in range(cp)]
    return {length: (max(r[length][0] for r in per_rank), max(r[length][1] for r in per_rank))
            for length in lengths}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="gpt-mini")
    parser.add_argument("--seq", default="512,1024,2048,4096", help="sequence lengths (multiples of 8)")
    parser.add_argument("--batch", type=int, default=2)
    parser.add_argument("--cp", default="1,2,4")
    args = parser.parse_args()
    lengths = [int(n) for n in args.seq.split(",")]
    degrees = [int(n) for n in args.cp.split(",")]
    results = {cp: measure(args.model, cp, lengths, args.batch) for cp in degrees}
    print(f"{args.model}, batch {args.batch}: activation memory per rank (bytes saved for backward), "
          "ratio to cp=1, and forward+backward seconds of the slowest rank")
    header = f"{'seq':>6} " + " ".join(f"{'cp=' + str(cp):>22}" for cp in degrees)
    print(header)
    for length in lengths:
        cells = []
        for cp in degrees:
            size, seconds = results[cp][length]
            ratio = size / results[degrees[0]][length][0]
            cells.append(f"{size / 2**20:8.1f} MiB {ratio:5.3f} {seconds:5.2f}s")
        print(f"{length:>6} " + " ".join(f"{cell:>22}" for cell in cells))


if __name__ == "__main__":
    main()
