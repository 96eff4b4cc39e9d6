"""``ShardedPlacement``: galore2's view of an FSDP2 / HSDP parameter (a DTensor).

Supported parameter placements (what ``fully_shard`` produces):

* 1-D mesh, ``(Shard(0),)`` — FSDP;
* 2-D mesh, ``(Replicate(), Shard(0))`` — HSDP (replicate × shard).

Anything else (``Shard(1)`` from tensor parallelism, ``Partial``, 3-D meshes…)
raises ``ValueError`` naming the parameter's shape and placement, never a silently
wrong update. State tensors are DTensors on the parameter's mesh (so DCP can
save and reshard them); transforms get their local tensors. Collectives run on
the shard dimension's process group only: replicas of an HSDP mesh compute the
same thing from the same (already all-reduced) gradients and seeds.
"""

from __future__ import annotations

import math

import torch
import torch.distributed as dist
from torch import Tensor
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard

from ..placement import LAYOUTS, Placement


def _chunk_bounds(size: int, parts: int, index: int) -> tuple[int, int]:
    """Rows [start, stop) of chunk ``index`` when ``size`` is split like ``torch.chunk``."""
    chunk = -(-size // parts) if size else 0
    start = min(index * chunk, size)
    return start, min(start + chunk, size)


class ShardedPlacement(Placement):
    """galore2's view of an FSDP2 / HSDP DTensor parameter: state layout and collectives.

    Built by :func:`placement_for` for every DTensor parameter; transforms and projectors reach
    it through their context and see only local tensors. Collectives run on the shard
    dimension's process group.

    Args:
        param: a DTensor parameter placed ``(Shard(0),)`` on a 1-D mesh (FSDP2) or
            ``(Replicate(), Shard(0))`` on a 2-D mesh (HSDP).

    Raises:
        ValueError: any other placement (tensor or sequence parallel layouts, ``Partial``,
            3-D meshes), naming the parameter's shape and placements.
    """

    def __init__(self, param: DTensor) -> None:
        mesh, placements = param.device_mesh, tuple(param.placements)
        if mesh.ndim == 1 and placements == (Shard(0),):
            shard_dim = 0
        elif mesh.ndim == 2 and placements == (Replicate(), Shard(0)):
            shard_dim = 1
        else:
            raise ValueError(
                f"galore2 supports DTensor parameters sharded on dim 0 only — FSDP2 "
                f"(Shard(0),) on a 1-D mesh or HSDP (Replicate(), Shard(0)) on a 2-D mesh; got a "
                f"parameter of shape {tuple(param.shape)} with placements {placements} on a "
                f"{mesh.ndim}-D mesh (tensor/sequence parallel layouts are not supported)"
            )
        self.mesh = mesh
        self.shard_dim = shard_dim
        self.group = mesh.get_group(shard_dim)
        self.world = mesh.size(shard_dim)
        self.rank = mesh.get_local_rank(shard_dim)
        self.param_shape = tuple(param.shape)
        self.param_placements = placements
        self.owner: int | None = None  # rank that runs this matrix's exact SVD (assign_owners)

    # ---- state allocation --------------------------------------------------------
    def _placements(self, inner: object) -> list:
        out: list = [Replicate()] * self.mesh.ndim
        out[self.shard_dim] = inner
        return out

    def zeros(
        self,
        shape: tuple[int, ...] | torch.Size,
        dtype: torch.dtype,
        device: torch.device,
        layout: str,
    ) -> Tensor:
        """A zero state DTensor of global ``shape`` on the parameter's mesh, sharded per ``layout``.

        ``"param"`` and ``"rows"`` shard dim 0 like the parameter (``torch.chunk`` bounds),
        ``"cols"`` shards dim 1, ``"replicate"`` keeps a full copy on every rank.

        Raises:
            ValueError: ``layout`` is not one of :data:`galore2.placement.LAYOUTS`.
        """
        if layout not in LAYOUTS:
            raise ValueError(f"layout must be one of {LAYOUTS}, got {layout!r}")
        shape = tuple(shape)
        if layout == "param":
            layout = "rows"
        if layout == "rows":
            start, stop = _chunk_bounds(shape[0], self.world, self.rank)
            local_shape, inner = (stop - start, *shape[1:]), Shard(0)
        elif layout == "cols":
            start, stop = _chunk_bounds(shape[1], self.world, self.rank)
            local_shape, inner = (shape[0], stop - start, *shape[2:]), Shard(1)
        else:
            local_shape, inner = shape, Replicate()
        local = torch.zeros(local_shape, dtype=dtype, device=device)
        return DTensor.from_local(
            local,
            self.mesh,
            self._placements(inner),
            run_check=False,
            shape=torch.Size(shape),
            stride=torch.empty(shape, device="meta").stride(),
        )

    def local(self, t: Tensor) -> Tensor:
        """The local shard of a DTensor state tensor (a plain tensor is returned as is)."""
        return t.to_local() if isinstance(t, DTensor) else t

    def row_range(self, m: int) -> tuple[int, int]:
        """This rank's rows ``[start, stop)`` of ``m`` rows split like ``torch.chunk``."""
        return _chunk_bounds(m, self.world, self.rank)

    # ---- collectives (shard group only) ------------------------------------------
    def reduce(self, t: Tensor) -> Tensor:
        """All-reduce (sum) ``t`` in place over the shard group; returns ``t``."""
        dist.all_reduce(t, group=self.group)
        return t

    def reduce_scatter_cols(self, t: Tensor) -> Tensor:
        """Partial sums r×n on every rank → this rank's column chunk of the sum."""
        partial = DTensor.from_local(t, self.mesh, self._placements(Partial()), run_check=False)
        return partial.redistribute(self.mesh, self._placements(Shard(1))).to_local()

    def all_gather_cols(self, t: Tensor, n: int) -> Tensor:
        """Column chunks → the full r×n tensor on every rank."""
        shape = torch.Size((t.shape[0], n))
        sharded = DTensor.from_local(
            t,
            self.mesh,
            self._placements(Shard(1)),
            run_check=False,
            shape=shape,
            stride=(n, 1),
        )
        return sharded.redistribute(self.mesh, self._placements(Replicate())).to_local()

    def any(self, flags: list[bool]) -> list[bool]:
        """Logical OR of each flag over the shard group (one all-reduce of the list)."""
        if not flags:
            return flags
        t = torch.tensor(flags, dtype=torch.int32)
        dist.all_reduce(t, op=dist.ReduceOp.MAX, group=self.group)
        return [bool(x) for x in t.tolist()]

    def any_global(self, flags: Tensor) -> Tensor:
        """Elementwise OR of a bool tensor over every rank of the default process group."""
        if not flags.numel():
            return flags
        t = flags.to(torch.int32)
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        return t.bool()

    def gather_rows(self, t: Tensor, owner: int) -> Tensor | None:
        """Gather a row-sharded matrix (torch.chunk layout) onto ``owner``; None elsewhere."""
        m = self.param_shape[0]
        chunk = -(-m // self.world)
        padded = torch.zeros((chunk, *t.shape[1:]), dtype=t.dtype, device=t.device)
        padded[: t.shape[0]] = t
        dst = dist.get_global_rank(self.group, owner)
        parts = (
            [torch.empty_like(padded) for _ in range(self.world)] if self.rank == owner else None
        )
        dist.gather(padded, parts, dst=dst, group=self.group)
        if parts is None:
            return None
        return torch.cat(parts)[:m]

    def broadcast(
        self,
        t: Tensor | None,
        owner: int,
        shape: tuple[int, ...],
        device: torch.device | None = None,
    ) -> Tensor:
        """Broadcast ``t`` from shard-group rank ``owner``; other ranks may pass ``None``.

        Ranks without ``t`` allocate an fp32 tensor of ``shape`` on ``device`` to receive it.
        """
        if t is None:
            t = torch.empty(shape, device=device, dtype=torch.float32)  # bases are fp32
        t = t.contiguous()
        dist.broadcast(t, src=dist.get_global_rank(self.group, owner), group=self.group)
        return t


def assign_owners(params: list[tuple[torch.Size, Placement]]) -> None:
    """Spread exact-SVD work: each sharded ≥2-D parameter gets an owner rank, the largest
    SVDs first (cost m·n·min(m, n)), each to the least-loaded rank. Deterministic, so every
    rank computes the same assignment."""
    loads: dict[int, list[float]] = {}
    sized = [
        (float(shape[0]) * math.prod(shape[1:]) * min(shape[0], math.prod(shape[1:])), i, pl)
        for i, (shape, pl) in enumerate(params)
        if isinstance(pl, ShardedPlacement) and len(shape) >= 2
    ]
    for cost, _, pl in sorted(sized, key=lambda t: (-t[0], t[1])):
        load = loads.setdefault(pl.world, [0.0] * pl.world)
        owner = min(range(pl.world), key=lambda r: (load[r], r))
        load[owner] += cost
        pl.owner = owner


def placement_for(param: Tensor) -> Placement | None:
    """A ``ShardedPlacement`` for a DTensor parameter, None for a plain tensor."""
    return ShardedPlacement(param) if isinstance(param, DTensor) else None
