"""Counting the bytes a rank puts into gradient collectives, and what they cost on the wire.

Convention (the one used in every figure meshyard reports): ``comm_bytes`` is the
payload each rank contributes to the collectives of one step, i.e. the size of its
input buffer to each all-reduce plus its own share of each all-gather.
``comm_bytes_uncompressed`` is what the same step would contribute with a plain fp32
(or whatever the gradient dtype is) all-reduce of every bucket, so
``compression_ratio = comm_bytes_uncompressed / comm_bytes``.

The payload does not depend on the number of ranks, the traffic does: a ring
all-reduce of S bytes sends 2(n-1)/n x S per rank, an all-gather of a share of S
bytes sends (n-1) x S per rank. ``comm_wire_bytes`` applies those factors, which is
why top-k (exchanged by all-gather) loses its edge as ranks are added while
PowerSGD and casting (all-reduce) keep theirs.
"""

from __future__ import annotations

from dataclasses import dataclass, field

# nccl-tests' bus-bandwidth factors: the share of the message each rank must send or
# receive over the slowest link, so that busbw is comparable with the hardware's peak.
BUS_FACTORS = {
    "all_reduce": lambda n: 2 * (n - 1) / n,
    "all_gather": lambda n: (n - 1) / n,
    "reduce_scatter": lambda n: (n - 1) / n,
    "broadcast": lambda n: 1.0,
}


def wire_bytes(payload_by_kind: dict[str, int], world_size: int) -> int:
    """Bytes one rank sends for the given payloads under ring algorithms.

    An all-reduce payload is the whole buffer (2(n-1)/n of it is sent); an all-gather
    payload is the rank's own share, which it sends to each of the n-1 others.
    """
    n = max(world_size, 1)
    total = 2 * (n - 1) / n * payload_by_kind.get("all_reduce", 0)
    total += (n - 1) * payload_by_kind.get("all_gather", 0)
    return int(round(total))


@dataclass
class ByteCounter:
    """Accumulates one step's payload by collective kind; ``take`` reads and resets it."""

    world_size: int = 1
    uncompressed: int = 0
    by_kind: dict[str, int] = field(default_factory=dict)

    def add(self, kind: str, payload: int, uncompressed: int) -> None:
        """Record a collective of ``kind`` ('all_reduce' or 'all_gather') carrying ``payload``
        bytes from this rank, standing in for ``uncompressed`` bytes of plain all-reduce."""
        self.by_kind[kind] = self.by_kind.get(kind, 0) + int(payload)
        self.uncompressed += int(uncompressed)

    def take(self) -> dict[str, int | float]:
        """The step's figures (see the module docstring), then zero the counts."""
        sent = sum(self.by_kind.values())
        stats = {
            "comm_bytes": sent,
            "comm_bytes_uncompressed": self.uncompressed,
            "compression_ratio": self.uncompressed / sent if sent else 1.0,
            "comm_wire_bytes": wire_bytes(self.by_kind, self.world_size),
        }
        self.uncompressed = 0
        self.by_kind = {}
        return stats
