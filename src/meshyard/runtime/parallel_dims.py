"""Parallel degrees validated against the world size, and the one named DeviceMesh.

Mesh dimensions, outermost first: ``pp``, ``dp_replicate``, ``dp_shard``, ``cp``, ``tp``.
All five always exist (size 1 when unused) so code can slice any of them by name, and
``dp`` is the flattened ``dp_replicate x dp_shard`` dimension used by data loading and
loss averaging. The ``cp`` (context-parallel) ranks of one data-parallel index read the
same samples and split each sequence between them, so they are not part of ``dp``.

Expert parallelism takes its ranks from ``dp_shard``: with ``ep`` > 1 the mesh is built
with ``dp_shard`` split in two, ``dp_shard_mod_ep`` (outer) x ``ep`` (inner, neighbouring
ranks, where all-to-all is cheapest), and ``dp_shard`` is their flattened view, so every
dimension above still exists. Expert weights are split over ``ep`` and sharded by FSDP
over ``dp_shard_mod_ep`` (``expert_dp_mesh``); dense weights over the whole ``dp_shard``.
"""

from __future__ import annotations

from dataclasses import dataclass

from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

MESH_DIMS = ("pp", "dp_replicate", "dp_shard", "cp", "tp")
EP_MESH_DIMS = ("pp", "dp_replicate", "dp_shard_mod_ep", "ep", "cp", "tp")
"""The mesh's dimensions under expert parallelism; ``dp_shard`` is then a flattened view."""


class ParallelDimsError(ValueError):
    def __init__(self, problems: list[str]) -> None:
        self.problems = problems
        super().__init__("; ".join(problems))


@dataclass(frozen=True)
class ParallelDims:
    """Degrees of each kind of parallelism; their product is the world size."""

    dp_replicate: int
    dp_shard: int
    tp: int
    pp: int
    world_size: int
    cp: int = 1
    ep: int = 1

    def __post_init__(self) -> None:
        problems = []
        for name in ("dp_replicate", "dp_shard", "cp", "tp", "pp", "ep"):
            if getattr(self, name) < 1:
                problems.append(f"parallel.{name} = {getattr(self, name)} must be at least 1")
        if not problems and self.dp_shard % self.ep:
            problems.append(
                f"parallel.ep = {self.ep} does not divide the sharded data-parallel degree dp_shard = "
                f"{self.dp_shard}: the experts are split over ep of the data-parallel ranks and sharded over "
                "the rest; use a divisor of dp_shard for ep, or change the number of processes (--nproc)")
        product = self.dp_replicate * self.dp_shard * self.cp * self.tp * self.pp
        if not problems and product != self.world_size:
            context = f"cp={self.cp} x " if self.cp > 1 else ""
            problems.append(
                f"parallel degrees dp_replicate={self.dp_replicate} x dp_shard={self.dp_shard} x {context}"
                f"tp={self.tp} x pp={self.pp} = {product} do not multiply to the world size "
                f"{self.world_size}; change the degrees or the number of processes (--nproc)"
            )
        if problems:
            raise ParallelDimsError(problems)

    @classmethod
    def resolve(
        cls, strategy: str, world_size: int, dp_replicate: int = 0, dp_shard: int = 0, tp: int = 1, pp: int = 1,
        cp: int = 1, ep: int = 1,
    ) -> "ParallelDims":
        """Fill the degrees left at 0 from the strategy and the world size, then validate.

        ``ddp``/``zero1`` replicate over every rank not used by tp/pp/cp; ``fsdp`` shards
        over them (HSDP when ``dp_replicate`` > 1 is given); ``none`` uses no data parallelism.
        """
        model_parallel = tp * pp * cp
        rest = world_size // model_parallel if model_parallel and world_size % model_parallel == 0 else 0
        if strategy in ("ddp", "zero1"):
            if dp_shard not in (0, 1):
                raise ParallelDimsError(
                    [f"parallel.dp_shard = {dp_shard} needs parallel.strategy = 'fsdp' (got '{strategy}')"]
                )
            dp_shard = 1
            dp_replicate = dp_replicate or rest
        elif strategy == "fsdp":
            dp_replicate = dp_replicate or 1
            if not dp_shard:
                if not rest or rest % dp_replicate:
                    raise ParallelDimsError([
                        f"parallel.dp_replicate = {dp_replicate} does not divide the world size {world_size} "
                        f"(degrees do not multiply to the world size); use a divisor of {world_size} or "
                        "change the number of processes (--nproc)"
                    ])
                dp_shard = rest // dp_replicate
        else:  # none
            if (dp_replicate or 1) != 1 or (dp_shard or 1) != 1:
                raise ParallelDimsError(
                    ["parallel.strategy = 'none' cannot have data-parallel degrees above 1; "
                     "choose 'ddp', 'fsdp' or 'zero1'"]
                )
            dp_replicate = dp_shard = 1
        return cls(dp_replicate=dp_replicate, dp_shard=dp_shard, tp=tp, pp=pp, world_size=world_size, cp=cp, ep=ep)

    @property
    def dp(self) -> int:
        """Total data-parallel degree: how many different batches are processed at once."""
        return self.dp_replicate * self.dp_shard

    def build_mesh(self, device_type: str) -> tuple[DeviceMesh, DeviceMesh]:
        """The single DeviceMesh of the job, and its flattened 1-D ``dp`` view.

        Its groups come from the default process group (dimensions spanning every rank
        reuse it; the others are split from it), so they keep its device-to-backend map:
        CPU tensors go through gloo on every mesh group, as on the default one.
        """
        if self.ep == 1:
            shape = (self.pp, self.dp_replicate, self.dp_shard, self.cp, self.tp)
            mesh = init_device_mesh(device_type, shape, mesh_dim_names=MESH_DIMS)
        else:
            shape = (self.pp, self.dp_replicate, self.dp_shard // self.ep, self.ep, self.cp, self.tp)
            mesh = init_device_mesh(device_type, shape, mesh_dim_names=EP_MESH_DIMS)
            mesh["dp_shard_mod_ep", "ep"]._flatten("dp_shard")
        return mesh, mesh["dp_replicate", "dp_shard"]._flatten("dp")

    def expert_dp_mesh(self, mesh: DeviceMesh) -> DeviceMesh:
        """The mesh FSDP shards expert weights over: the data-parallel ranks that hold the
        same experts (``dp_shard_mod_ep``, with ``dp_replicate`` in front under HSDP)."""
        return mesh["dp_replicate", "dp_shard_mod_ep"] if self.dp_replicate > 1 else mesh["dp_shard_mod_ep"]
