"""``collective_bytes``: the collectives galore2 issues under FSDP2, counted on paper.

For a model (a meta-device one is fine: nothing is allocated), a world size and GaLore
settings, :func:`collective_bytes` lists every collective galore2's optimizer step
issues through :class:`~galore2.fsdp.ShardedPlacement` — one entry per call, listed by
the code that issues it (below) — next to FSDP2's own per-step parameter/gradient traffic.

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

Listed by the code that issues them, not re-derived here:

* every step (``Traffic.step``), per parameter group with ``nonfinite != "ignore"``: one
  all-reduce of one int32 flag per parameter (``NonFinitePolicy.keep``, over the default
  process group); with per-layer updates (``galore2.per_layer``: ``step_param`` inside
  backward) one such all-reduce per parameter, of one flag;
* per projected weight, every step: its projection's
  :meth:`~galore2.optim.projection.Projection.step_collectives` (left: reduce-scatter of
  R = PᵀG and all-gather of N; full: all-reduce of PᵀGQ; right: nothing; Tucker: the core's
  all-reduce when mode 0 is reduced);
* per projected weight, at a refresh (``Traffic.first_refresh`` for a weight's first one,
  ``Traffic.refresh`` for every later one): its projection's
  :meth:`~galore2.optim.projection.Projection.refresh_collectives` — the projector's
  (:meth:`~galore2.projectors.Projector.refresh_collectives`: ``usable_norm``, the basis
  search of ``svd`` / ``randomized`` / ``power`` / ``random``, the finite-basis check), then
  the moment rotation's under ``moments_on_refresh="project"``.

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
from .optim.projection import Projection, projection_for
from .placement import OPS, Collective, itemsize
from .presets import GaLoreAdamW
from .projectors import NONE, Plan, choose_side
from .storage.dtype import STATE_DTYPES

KINDS = ("step", "first_refresh", "refresh", "fsdp")

_I32 = torch.int32
_OPTIONS = GaLoreAdamW.declared_options()  # the options of a projected AdamW group


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

    def summary(self) -> dict[str, dict[str, float]]:
        """``{kind: {"calls", "bytes", "wire_bytes"}}`` for every kind."""
        return {
            k: {"calls": self.calls(k), "bytes": self.bytes(k), "wire_bytes": self.wire_bytes(k)}
            for k in KINDS
        }


def _projection(shape: torch.Size, side: int, group: dict[str, Any]) -> Projection:
    """The projection galore2 builds for a weight of global ``shape`` (on the meta device)."""
    m, n = int(shape[0]), 1
    for d in shape[1:]:
        n *= int(d)
    plan = Plan(side, m, n, int(group["rank"]), torch.device("meta"))
    return projection_for(group, plan, tuple(int(d) for d in shape))


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
    total = sum(_padded_numel(t, p) * itemsize(d) for t, d in zip(params, dtypes, strict=True))
    dt = dtypes[0] if len(set(dtypes)) == 1 else torch.uint8
    return Collective(op, (total // itemsize(dt),), dt, source, unit)


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
            name, gap = names[id(t)], int(g["update_proj_gap"])
            projected.append(name)
            projection = _projection(t.shape, side, g)
            step.extend(
                replace(c, param=name) for c in projection.step_collectives(t.dtype, state_dtype)
            )
            for out, at_first in ((first, True), (later, False)):
                out.extend(
                    replace(c, param=name, period=gap)
                    for c in projection.refresh_collectives(g, p, at_first)
                )
    fsdp = _fsdp(model, p, fsdp_units, reshard_after_forward, param_dtype, reduce_dtype)
    return Traffic(p, tuple(step), tuple(first), tuple(later), tuple(fsdp), tuple(projected))


__all__ = ["KINDS", "OPS", "Collective", "Traffic", "collective_bytes"]
