"""``collective_bytes``: the collectives galore2 issues under FSDP2, counted on paper.

For a model (a meta-device one is fine: nothing is allocated), a world size and GaLore
settings, :func:`collective_bytes` lists every collective galore2's optimizer step
issues through :class:`~galore2.fsdp.ShardedPlacement` — one entry per call, derived
from the code paths below — next to FSDP2's own per-step parameter/gradient traffic.

Conventions
-----------

* ``world_size`` is the size of the FSDP shard group (a 1-D mesh, ``(Shard(0),)``).
  Every parameter is assumed to have a gradient at every step, every refresh to find a
  usable gradient, and every factorization to take its ordinary (fp32) path.
* **Logical bytes** (:attr:`Collective.bytes`) = numel × itemsize of the *full* tensor
  the collective reduces, assembles or distributes: all-reduce → the tensor;
  reduce-scatter → its input (r×n partial sums); all-gather → its output (r×n);
  gather → what the owner assembles (p·⌈m/p⌉ padded rows × n); broadcast → the tensor.
  Uneven column splits are not padded here (DTensor pads them to p·⌈n/p⌉ internally).
* **Wire bytes** (:meth:`Collective.wire_bytes`) = bytes a rank receives, averaged over
  the p ranks, under bandwidth-optimal algorithms: all-reduce (ring) 2(p−1)/p·N,
  reduce-scatter and all-gather (ring) (p−1)/p·N — every rank alike — gather
  (p−1)/p²·N (the owner receives (p−1)/p·N, the others nothing; galore2 spreads SVD
  owners over ranks, ``assign_owners``, so the average is each rank's share), broadcast
  (p−1)/p·N (every rank but the owner receives N). Zero at p = 1.
* Not modelled: fallbacks. A sharded CholeskyQR2 that fails in fp32 (an
  ill-conditioned sketch, typically a square one, k = m) retries in fp64 (up to two
  more k×k fp64 Gram all-reduces); an unusable gradient stops a refresh after
  ``usable_norm`` (retried next step); a linear-algebra failure stops it where it occurs.

galore2's collectives
---------------------

Every step (``Traffic.step``), per parameter group with ``nonfinite != "ignore"``: one
all-reduce of one int32 flag per parameter (``NonFinitePolicy.keep``,
over the default process group); with per-layer updates (``galore2.per_layer``:
``step_param`` inside backward) one such all-reduce per parameter, of one flag. Per projected weight (``GaLore._project`` /
``GaLore._back``): left side — reduce-scatter of R = PᵀG (r×n, gradient dtype) and
all-gather of Adam's direction N (r×n, ``state_dtype``: it is cast to the parameter's
dtype only after the gather); full — all-reduce of PᵀGQ (r×r, gradient dtype); right —
nothing (G·Q is row-local).

At a refresh (``Traffic.first_refresh`` for a weight's first one, ``Traffic.refresh``
for every later one), per projected weight:

* ``usable_norm``: all-reduce of one int32 (any non-finite) and one fp64 (Σ‖G_i‖²);
* ``randomized`` (and ``power``'s first refresh, a randomized cold start), with
  k = min(r + oversample, m, n) and q = ``power_iters``: left — CholeskyQR2 of G·Ω
  (two k×k Gram all-reduces, the first in fp64, as in every CholeskyQR2 below), q × (Gᵀ·Y:
  n×k, then two k×k Grams), Yᵀ·G (k×n, only when k > r), ``align_signs`` (r; at the first
  refresh too, against the zero-initialized basis);
  right — Gᵀ·Ω (n×k), q × Gᵀ·(G·Y) (n×k), CᵀC (k×k,
  only when k > r); the right basis is replicated, so its orthonormalization and sign
  alignment are local;
* ``power`` (later refreshes): left — q × (Gᵀ·Y: n×r, two r×r Grams), ``align_signs``
  (r); right — q × Gᵀ·(G·Y) (n×r);
* ``svd``: gather of G's rows onto an owner rank (p·⌈m/p⌉ × n fp32), broadcast of the
  owner's P (m×r) and/or Q (n×r), fp32;
* ``random``: nothing but ``usable_norm`` (the basis is a seed);
* every projector but ``random``: all-reduce of one int32 (``Projector.refresh``: the
  new basis is finite everywhere);
* ``moments_on_refresh="project"``, later refreshes, left/full: all-reduce of
  C = P_newᵀ·P_old (r×r fp32, ``_rotation``).

A Tucker-projected weight (more than two dims, ``tensor_projection="tucker"``, factors
U_k of rank r_k = min(r, d_k) for the modes with r < d_k): every step, an all-reduce of
its core (r_0 × r_1 × …, gradient dtype) when mode 0 is reduced — none when d_0 ≤ r (the
core is then row-sharded like the weight). At a refresh, one ``usable_norm`` and one
non-finite-basis flag; ``svd``: one gather of G's rows (p·⌈d_0/p⌉ × rest) and a
broadcast of each factor (d_k × r_k), plus ``align_signs`` of U_0 (r_0); ``randomized`` /
``power``: per reduced mode the collectives of a left basis of d_0 × rest (mode 0) or of
a right basis of the unfolding (d_0·rest/d_k) × d_k (mode k ≥ 1), as listed above;
``project``: the all-reduce of C_0 = U_0,newᵀ·U_0,old (r_0 × r_0).

Refresh collectives are fp32 whatever the parameter dtype (G is cast first), but for the
int32 flags and the fp64 norm.

FSDP2's own traffic (``Traffic.fsdp``), per forward + backward of one micro-batch: per
``fully_shard`` unit (``fsdp_units`` in order, then the root holding every other
parameter), an all-gather of its parameters in forward, another in backward when the
unit reshards after forward (FSDP2's default: every unit but the root), and a
reduce-scatter of its gradients. Sizes are FSDP2's padded ones (dim 0 padded to
p·⌈m/p⌉ per parameter), in ``param_dtype`` / ``reduce_dtype`` of its
``MixedPrecisionPolicy`` when given. With gradient accumulation FSDP's traffic repeats
per micro-batch while galore2's is once per optimizer step.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

import torch
from torch import Tensor, nn

from .core.options import resolve
from .groups import param_groups
from .presets import GaLoreAdamW
from .projectors import FULL, LEFT, NONE, RIGHT, TUCKER, choose_side
from .projectors.tucker import reduced_modes, tucker_ranks
from .storage.dtype import STATE_DTYPES

OPS = ("all_reduce", "reduce_scatter", "all_gather", "gather", "broadcast")
KINDS = ("step", "first_refresh", "refresh", "fsdp")

_I32, _F32, _F64 = torch.int32, torch.float32, torch.float64
_OPTIONS = GaLoreAdamW.declared_options()  # the options of a projected AdamW group


@dataclass(frozen=True)
class Collective:
    """One collective call, as issued by every rank of the shard group."""

    op: str  # one of OPS
    shape: tuple[int, ...]  # the full logical tensor (see the module docstring)
    dtype: torch.dtype
    source: str  # the galore2 (or FSDP) code that issues it
    param: str = ""  # parameter (or FSDP unit) name; "" for a group-level call
    period: int = 1  # steps between two occurrences (update_proj_gap for refreshes)

    @property
    def numel(self) -> int:
        out = 1
        for d in self.shape:
            out *= int(d)
        return out

    @property
    def itemsize(self) -> int:
        return _itemsize(self.dtype)

    @property
    def bytes(self) -> int:
        """Logical payload bytes (the full tensor reduced / assembled / distributed)."""
        return self.numel * self.itemsize

    def wire_bytes(self, world_size: int) -> float:
        """Bytes received per rank (averaged over ranks), bandwidth-optimal algorithms."""
        p = world_size
        if p <= 1:
            return 0.0
        factor = {
            "all_reduce": 2 * (p - 1) / p,
            "reduce_scatter": (p - 1) / p,
            "all_gather": (p - 1) / p,
            "gather": (p - 1) / p**2,
            "broadcast": (p - 1) / p,
        }[self.op]
        return factor * self.bytes

    def key(self) -> tuple[str, int, int]:
        """(op, numel, itemsize): what a recorder of issued collectives can compare."""
        return self.op, self.numel, self.itemsize


@dataclass(frozen=True)
class Traffic:
    """The result of :func:`collective_bytes`: lists of :class:`Collective` by kind.

    ``step``: galore2, every optimizer step; ``first_refresh``: galore2, extra on the
    step of a weight's first refresh; ``refresh``: galore2, extra on every later refresh
    (every ``update_proj_gap`` steps); ``fsdp``: FSDP2's own, per forward + backward.
    """

    world_size: int
    step: tuple[Collective, ...]
    first_refresh: tuple[Collective, ...]
    refresh: tuple[Collective, ...]
    fsdp: tuple[Collective, ...]
    galore_params: tuple[str, ...] = field(default=())  # projected weights, by name

    def of(self, kind: str) -> tuple[Collective, ...]:
        if kind not in KINDS:
            raise ValueError(f"kind must be one of {KINDS}, got {kind!r}")
        return getattr(self, kind)

    def calls(self, kind: str) -> int:
        return len(self.of(kind))

    def bytes(self, kind: str) -> int:
        """Total logical bytes of ``kind``."""
        return sum(c.bytes for c in self.of(kind))

    def wire_bytes(self, kind: str) -> float:
        """Total bytes received per rank (averaged over ranks) for ``kind``."""
        return sum(c.wire_bytes(self.world_size) for c in self.of(kind))

    def amortized_bytes(self, wire: bool = False) -> float:
        """galore2's bytes per step over a long run: step + refresh / update_proj_gap."""
        size = (lambda c: c.wire_bytes(self.world_size)) if wire else (lambda c: c.bytes)
        return sum(size(c) for c in self.step) + sum(size(c) / c.period for c in self.refresh)

    def by_op(self, kind: str) -> dict[str, dict[str, float]]:
        """``{op: {"calls", "bytes", "wire_bytes"}}`` for ``kind`` (ops that occur)."""
        out: dict[str, dict[str, float]] = {}
        for c in self.of(kind):
            d = out.setdefault(c.op, {"calls": 0, "bytes": 0, "wire_bytes": 0.0})
            d["calls"] += 1
            d["bytes"] += c.bytes
            d["wire_bytes"] += c.wire_bytes(self.world_size)
        return out

    def summary(self) -> dict[str, dict[str, float]]:
        """``{kind: {"calls", "bytes", "wire_bytes"}}`` for every kind."""
        return {
            k: {"calls": self.calls(k), "bytes": self.bytes(k), "wire_bytes": self.wire_bytes(k)}
            for k in KINDS
        }


def _matrix(shape: torch.Size) -> tuple[int, int]:
    n = 1
    for d in shape[1:]:
        n *= int(d)
    return int(shape[0]), n


def _per_step(name: str, m: int, n: int, side: int, r: int, grad: torch.dtype, state: torch.dtype):
    if side == LEFT:
        yield Collective("reduce_scatter", (r, n), grad, "GaLore._project: R = PᵀG", name)
        yield Collective("all_gather", (r, n), state, "GaLore._back: N (Adam direction)", name)
    elif side == FULL:
        yield Collective("all_reduce", (r, r), grad, "GaLore._project: R = PᵀGQ", name)


def _refresh(
    name: str, m: int, n: int, side: int, r: int, g: dict[str, Any], p: int, first: bool
) -> list[Collective]:
    gap = int(g["update_proj_gap"])
    out: list[Collective] = []

    def add(op: str, shape: tuple[int, ...], dtype: torch.dtype, source: str) -> None:
        out.append(Collective(op, shape, dtype, source, name, gap))

    def grams(k: int, where: str) -> None:  # orthonormalize_rows: sharded CholeskyQR2
        add("all_reduce", (k, k), _F64, f"{where}: CholeskyQR2 Gram 1 (float64)")
        add("all_reduce", (k, k), _F32, f"{where}: CholeskyQR2 Gram 2")

    left, right = side in (LEFT, FULL), side in (RIGHT, FULL)
    add("all_reduce", (1,), _I32, "usable_norm: any non-finite")
    add("all_reduce", (1,), _F64, "usable_norm: Σ‖G_i‖²")
    projector, q = g["projector"], int(g["power_iters"])
    k = min(r + int(g["oversample"]), m, n)
    if projector == "svd":
        chunk = -(-m // p)
        add("gather", (p * chunk, n), _F32, "SVDProjector.find: G rows onto the owner")
        if left:
            add("broadcast", (m, r), _F32, "SVDProjector.find: P from the owner")
        if right:
            add("broadcast", (n, r), _F32, "SVDProjector.find: Q from the owner")
    elif projector == "power" and not first:
        if left:
            for _ in range(q):
                add("all_reduce", (n, r), _F32, "warm_left: GᵀY")
                grams(r, "warm_left")
            add("all_reduce", (r,), _F32, "align_signs (left)")
        if right:
            for _ in range(q):
                add("all_reduce", (n, r), _F32, "warm_right: Gᵀ(GY)")
    elif projector in ("randomized", "power"):  # power's first refresh: randomized cold start
        if left:
            grams(k, "left_basis: G·Ω")
            for _ in range(q):
                add("all_reduce", (n, k), _F32, "left_basis: GᵀY")
                grams(k, "left_basis: G·(GᵀY)")
            if k > r:
                add("all_reduce", (k, n), _F32, "left_basis: B = YᵀG")
            add("all_reduce", (r,), _F32, "align_signs (left)")
        if right:
            add("all_reduce", (n, k), _F32, "right_basis: GᵀΩ")
            for _ in range(q):
                add("all_reduce", (n, k), _F32, "right_basis: Gᵀ(GY)")
            if k > r:
                add("all_reduce", (k, k), _F32, "right_basis: CᵀC")
    if projector != "random":
        add("all_reduce", (1,), _I32, "Projector.refresh: any non-finite basis")
    if not first and g["moments_on_refresh"] == "project" and left:
        add("all_reduce", (r, r), _F32, "_rotation: C = P_newᵀ·P_old")
    return out


def _tucker_step(name: str, shape: tuple[int, ...], r: int, grad: torch.dtype):
    if 0 in reduced_modes(shape, r):  # each rank's core is a partial sum over its rows
        yield Collective("all_reduce", tucker_ranks(shape, r), grad, "GaLore._project: core", name)


def _tucker_refresh(
    name: str, shape: tuple[int, ...], r: int, g: dict[str, Any], p: int, first: bool
) -> list[Collective]:
    """A Tucker weight's refresh: one usable_norm; per reduced mode, the matrix problem
    of its factor (mode 0: left of d_0 × rest; mode k: right of its unfolding); svd: one
    gather, one broadcast per factor."""
    gap = int(g["update_proj_gap"])
    modes, ranks = reduced_modes(shape, r), tucker_ranks(shape, r)
    out: list[Collective] = []

    def add(op: str, size: tuple[int, ...], dtype: torch.dtype, source: str) -> None:
        out.append(Collective(op, size, dtype, source, name, gap))

    add("all_reduce", (1,), _I32, "usable_norm: any non-finite")
    add("all_reduce", (1,), _F64, "usable_norm: Σ‖G_i‖²")
    d0, rest = shape[0], _matrix(torch.Size(shape))[1]
    projector = g["projector"]
    if projector == "svd":
        chunk = -(-d0 // p)
        add("gather", (p * chunk, rest), _F32, "TuckerProjector._exact: G rows onto the owner")
        for k in modes:
            add("broadcast", (shape[k], ranks[k]), _F32, f"TuckerProjector._exact: U_{k}")
        if 0 in modes:
            add("all_reduce", (ranks[0],), _F32, "align_signs (mode 0)")
    elif projector in ("randomized", "power"):
        keep = {**g, "moments_on_refresh": "keep"}
        for k in modes:
            if k == 0:
                sub = _refresh(name, d0, rest, LEFT, ranks[0], keep, p, first)
            else:
                sub = _refresh(
                    name, d0 * rest // shape[k], shape[k], RIGHT, ranks[k], keep, p, first
                )
            out.extend(
                replace(c, source=f"mode {k}: {c.source}")
                for c in sub
                if not c.source.startswith(("usable_norm", "Projector.refresh"))
            )
    if projector != "random":
        add("all_reduce", (1,), _I32, "Projector.refresh: any non-finite basis")
    if not first and g["moments_on_refresh"] == "project" and 0 in modes:
        add("all_reduce", (ranks[0], ranks[0]), _F32, "TuckerProjector.rotation: C_0")
    return out


def _fsdp_units(
    named: list[tuple[str, Tensor]], units: Sequence[str]
) -> list[tuple[str, list[tuple[str, Tensor]]]]:
    """Parameters by ``fully_shard`` unit: the innermost unit whose name prefixes theirs."""
    by_unit: dict[str, list[tuple[str, Tensor]]] = {u: [] for u in units}
    root: list[tuple[str, Tensor]] = []
    for pname, t in named:
        owners = [u for u in units if pname.startswith(u + ".")]
        (by_unit[max(owners, key=len)] if owners else root).append((pname, t))
    return [*by_unit.items(), ("<root>", root)]


def _padded_numel(t: Tensor, p: int) -> int:
    """FSDP2's all-gather / reduce-scatter size of a parameter: dim 0 padded to p·⌈m/p⌉."""
    if t.dim() == 0:
        return 1
    rows = int(t.shape[0])
    return -(-rows // p) * p * (t.numel() // rows if rows else 0)


def _unit_collective(
    op: str, params: list[Tensor], dtypes: list[torch.dtype], p: int, source: str, unit: str
) -> Collective:
    """One flat FSDP2 collective over a unit's parameters (uint8 when dtypes are mixed)."""
    total = sum(_padded_numel(t, p) * _itemsize(d) for t, d in zip(params, dtypes, strict=True))
    dt = dtypes[0] if len(set(dtypes)) == 1 else torch.uint8
    return Collective(op, (total // _itemsize(dt),), dt, source, unit)


def _itemsize(dtype: torch.dtype) -> int:
    return torch.empty((), dtype=dtype).element_size()


def _fsdp(
    model: nn.Module,
    p: int,
    units: Sequence[str],
    reshard_after_forward: bool | None,
    param_dtype: torch.dtype | None,
    reduce_dtype: torch.dtype | None,
) -> list[Collective]:
    names = {n for n, _ in model.named_modules()}
    missing = [u for u in units if u not in names or u == ""]
    if missing:
        raise ValueError(f"fsdp_units {missing} name no submodule of the model")
    named = list(model.named_parameters())  # deduplicated, like FSDP
    out: list[Collective] = []
    for unit, members in _fsdp_units(named, units):
        if not members:
            continue
        params = [t for _, t in members]
        gather = [param_dtype or t.dtype for t in params]
        reduce = [reduce_dtype or param_dtype or t.dtype for t in params]
        reshard = (unit != "<root>") if reshard_after_forward is None else reshard_after_forward
        out.append(_unit_collective("all_gather", params, gather, p, "FSDP forward: unshard", unit))
        if reshard:
            src = "FSDP backward: unshard again"
            out.append(_unit_collective("all_gather", params, gather, p, src, unit))
        src = "FSDP backward: reduce-scatter gradients"
        out.append(_unit_collective("reduce_scatter", params, reduce, p, src, unit))
    return out


def collective_bytes(
    model: nn.Module,
    world_size: int,
    *,
    rank: int | None = None,
    target_modules: str | Sequence[str] = "all-linear",
    groups: Iterable[dict[str, Any]] | None = None,
    fsdp_units: Sequence[str] = (),
    reshard_after_forward: bool | None = None,
    param_dtype: torch.dtype | None = None,
    reduce_dtype: torch.dtype | None = None,
    per_layer: bool = False,
    **settings: Any,
) -> Traffic:
    """The collectives a galore2 optimizer step issues under FSDP2, and FSDP2's own.

    Args:
        model: the (unsharded) model; build it under ``torch.device("meta")`` to size a
            large one without allocating. Parameter dtypes are the sharded parameters'
            (and so the gradients' seen by the optimizer).
        world_size: FSDP shard-group size p.
        rank, target_modules, settings: as :func:`galore2.param_groups` (``rank``,
            ``proj_type``, ``projector``, ``oversample``, ``power_iters``,
            ``moments_on_refresh``, ``update_proj_gap``, ``state_dtype``,
            ``nonfinite``…), used when ``groups`` is not given.
        groups: the optimizer's parameter groups instead (dicts with ``params`` drawn
            from ``model``, e.g. ``opt.param_groups``); missing keys take
            ``GaLoreAdamW``'s defaults.
        fsdp_units: names of the submodules given their own ``fully_shard`` (before the
            root's), e.g. ``[f"model.layers.{i}" for i in range(32)]``.
        reshard_after_forward: as ``fully_shard`` (``None``: every unit but the root).
        param_dtype, reduce_dtype: FSDP2's ``MixedPrecisionPolicy`` (its traffic only).
        per_layer: updates inside backward (``galore2.per_layer`` / ``step_param``): the
            non-finite flags go one parameter at a time.

    Returns:
        a :class:`Traffic` (see the module docstring for the byte conventions).
    """
    if not isinstance(world_size, int) or world_size < 1:
        raise ValueError(f"world_size must be an int >= 1, got {world_size!r}")
    if not isinstance(reshard_after_forward, (bool, type(None))):
        raise ValueError("reshard_after_forward must be True, False or None (int unsupported)")
    p = world_size
    if groups is None:
        groups = param_groups(model, target_modules, rank=rank, **settings)
    elif rank is not None or settings:
        raise ValueError("pass either groups or rank/settings, not both")
    names = {id(t): n for n, t in model.named_parameters()}
    step: list[Collective] = []
    first: list[Collective] = []
    later: list[Collective] = []
    projected: list[str] = []
    for raw in groups:
        g = resolve(_OPTIONS, raw, passthrough=("params",), owner="collective_bytes")
        params = list(g["params"])
        unknown = [t for t in params if id(t) not in names]
        if unknown:
            raise ValueError("groups hold parameters that are not the model's")
        if p == 1:  # one rank: the placement is not distributed, nothing is issued
            continue
        if params and g["nonfinite"] != "ignore":
            src = "NonFinitePolicy.keep: skip flags"
            if per_layer:
                step.extend(Collective("all_reduce", (1,), _I32, src, names[id(t)]) for t in params)
            else:
                step.append(Collective("all_reduce", (len(params),), _I32, src))
        state_dtype = STATE_DTYPES[g["state_dtype"]]
        for t in params:
            side = choose_side(tuple(t.shape), g["proj_type"], g["rank"], g["tensor_projection"])
            if side == NONE:
                continue
            name, r = names[id(t)], int(g["rank"])
            m, n = _matrix(t.shape)
            projected.append(name)
            if side == TUCKER:
                shape = tuple(int(d) for d in t.shape)
                step.extend(_tucker_step(name, shape, r, t.dtype))
                first.extend(_tucker_refresh(name, shape, r, g, p, first=True))
                later.extend(_tucker_refresh(name, shape, r, g, p, first=False))
                continue
            step.extend(_per_step(name, m, n, side, r, t.dtype, state_dtype))
            first.extend(_refresh(name, m, n, side, r, g, p, first=True))
            later.extend(_refresh(name, m, n, side, r, g, p, first=False))
    fsdp = _fsdp(model, p, fsdp_units, reshard_after_forward, param_dtype, reduce_dtype)
    return Traffic(p, tuple(step), tuple(first), tuple(later), tuple(fsdp), tuple(projected))


__all__ = ["KINDS", "OPS", "Collective", "Traffic", "collective_bytes"]
