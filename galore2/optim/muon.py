"""Orthogonalized momentum (Muon, SUMO) as a transform, and the preset's per-direction choice.

``ScaleByMuon`` keeps one momentum buffer M ← β·M + (1 − β)·u (torch.optim.Muon's
``lerp``), takes the Nesterov look-ahead u + β·(M − u) (or M) and returns its
orthogonalization O — every singular value of the direction replaced by (about) one —
times the learning-rate adjustment of ``adjust_lr_fn``:

* ``orthogonalize="newton_schulz"`` (Muon): five steps of the quintic iteration
  X ← aX + (bA + cA²)X, A = XXᵀ, from X/‖X‖_F, with Muon's coefficients
  (3.4445, −4.7750, 2.0315). It is a polynomial in XXᵀ, so O = U·p(Σ)·Vᵀ exactly: the
  singular vectors are the input's and the singular values p(σ/‖X‖_F) land in
  [0.68, 1.21] for σ/‖X‖_F ≥ 2e-3 (tested against float64 SVDs). Computed in float32
  (float64 inputs: float64); torch.optim.Muon uses bfloat16.
* ``orthogonalize="polar"`` (SUMO, arXiv 2505.24749): the exact polar factor U·Vᵀ, from
  the eigendecomposition of the small Gram matrix XXᵀ in float64 (singular values below
  1e-6 of the largest count as zero: their directions are rounding noise).

Inside GaLore the direction is the low-rank r×n (or m×r) projected moment, so both cost
O(r²·n) per step and the Gram matrix is r×r; under FSDP2 the long dimension is sharded
(a left basis's r×n by columns, a right basis's m×r by rows) and each Gram matrix is one
r×r all-reduce.

``adjust_lr_fn`` as torch.optim.Muon's: ``"match_rms_adamw"`` (default) multiplies O by
0.2·√max(rows, cols) of the orthogonalized matrix, so its RMS is AdamW's typical 0.2 and
AdamW's learning rates apply; ``"original"`` by √max(1, rows/cols). For a full matrix (no
projection) and ``orthogonalize="newton_schulz"`` the update is torch.optim.Muon's up to
its bfloat16 rounding.

``MuonOrAdam`` applies Muon to the 2-D directions of the groups it is handed a test for,
and Adam to everything else, the split Muon is used with. It reads no other module's
option: the chain that builds it says which groups are Muon's (:class:`~galore2.GaLoreMuon`:
the groups GaLore projects — the projected low-rank moment, or the whole matrix when
``rank ≥ min(m, n)`` — while embeddings, norms and biases in unprojected groups get Adam).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from contextlib import nullcontext
from typing import Any, ClassVar

import torch
from torch import Tensor

from .._numerics import constants
from ..core.module import complex_problem
from ..core.options import Bool, Choice, Int, Option, Real
from ..core.state import counter
from ..core.transform import Context, Group, StackedState, State, Transform
from ..placement import Placement
from ..storage.dtype import STATE_DTYPE, STATE_DTYPES
from .adam import ScaleByAdam
from .products import fast_float32

NS_COEFFICIENTS = (3.4445, -4.7750, 2.0315)  # Muon's quintic (torch.optim.Muon's default)
NS_EPS = 1e-7  # torch.optim.Muon's floor of ‖X‖_F
POLAR_RTOL = 1e-12  # eigenvalues of XXᵀ (σ²) below this × the largest are treated as zero

MOMENTUM = Option("momentum", 0.95, Real(low=0.0, high=1.0, high_open=True), "Muon's momentum β")
NESTEROV = Option("nesterov", True, Bool(), "Muon: orthogonalize u + β·(M − u) instead of M")
ORTHOGONALIZE = Option(
    "orthogonalize",
    "newton_schulz",
    Choice(("newton_schulz", "polar")),
    "Muon's Newton–Schulz iteration, or the exact polar factor U·Vᵀ (SUMO)",
    resumable=False,
)
NS_STEPS = Option("ns_steps", 5, Int(low=1, high=100), "Newton–Schulz iterations")
ADJUST_LR_FN = Option(
    "adjust_lr_fn",
    "match_rms_adamw",
    Choice(("match_rms_adamw", "original")),
    "scale of the orthogonalized update: 0.2·√max(A, B) (AdamW's lr), or √max(1, A/B)",
)


def newton_schulz(
    X: Tensor, steps: int = 5, reduce: Callable[[Tensor], Tensor] = lambda t: t
) -> Tensor:
    """Muon's quintic Newton–Schulz iteration on a short × long ``X`` (rows ≤ columns), or on
    each matrix of a k × rows × columns stack of them (whole matrices only).

    ``reduce`` sums a tensor over the ranks holding column shards of X (identity when X is
    whole). Float32 unless X is float64.
    """
    a, b, c = NS_COEFFICIENTS
    X = X.double() if X.dtype == torch.float64 else X.float()
    if X.dim() == 3:  # a stack of same-shape matrices (the batched path): one bmm per product
        X = X / torch.linalg.vector_norm(X, dim=(1, 2), keepdim=True).clamp_(min=NS_EPS)
        for _ in range(steps):
            A = torch.bmm(X, X.mT)
            B = torch.baddbmm(A, A, A, beta=b, alpha=c)
            X = torch.baddbmm(X, B, X, beta=a)
        return X
    norm = reduce(X.square().sum().reshape(1))[0].sqrt()
    X = X / norm.clamp(min=NS_EPS)
    for _ in range(steps):
        A = reduce(X @ X.mT)
        B = torch.addmm(A, A, A, beta=b, alpha=c)
        X = torch.addmm(X, B, X, beta=a)
    return X


def polar(X: Tensor, reduce: Callable[[Tensor], Tensor] = lambda t: t) -> Tensor:
    """The polar factor U·Vᵀ of a short × long ``X`` (X = U·Σ·Vᵀ), as (XXᵀ)^(−1/2)·X with the
    Gram matrix and its eigendecomposition in float64; zero singular values give zero.
    A k × rows × columns stack of matrices gives each one's (batched ``eigh``)."""
    X64 = X.double()
    lam, W = torch.linalg.eigh(reduce(X64 @ X64.mT))
    keep = lam > lam.amax(dim=-1, keepdim=True).clamp(min=0) * POLAR_RTOL
    inv_sqrt = torch.where(keep, lam.clamp(min=torch.finfo(torch.float64).tiny).rsqrt(), 0.0)
    out = (W * inv_sqrt.unsqueeze(-2)) @ (W.mT @ X64)
    return out if X.dtype == torch.float64 else out.float()


# The direction's dim that a sharded parameter splits across ranks, per state layout
# (galore2.placement): "param"/"rows" split dim 0, "cols" dim 1, "replicate" none.
_SPLIT_DIM = {"param": 0, "rows": 0, "cols": 1, "replicate": -1}


def _sharded_dim(split: int, placement: Placement) -> int | None:
    """Which dim of the direction is split over ranks in this run (None: whole here)."""
    return None if split < 0 or not placement.distributed else split


def _split_of(state: State, placement: Placement) -> int | None:
    """:func:`_sharded_dim` of a direction's recorded ``muon.split_dim``: read (a host
    counter) only in a distributed run."""
    if not placement.distributed:
        return None
    return _sharded_dim(int(state["muon.split_dim"]), placement)


class ScaleByMuon(Transform):
    """Orthogonalized momentum of a 2-D direction; see the module docstring."""

    name = "muon"
    options = (MOMENTUM, NESTEROV, ORTHOGONALIZE, NS_STEPS, ADJUST_LR_FN, STATE_DTYPE)
    kinds: ClassVar[dict[str, str]] = {"muon.momentum": "moments", "muon.split_dim": "other"}
    linear_keys = ("muon.momentum",)

    def capture_problem(self, group: Group) -> str | None:
        """Why a step of this rule cannot replay from a CUDA graph (None: it can; see
        :mod:`galore2.core.capture`). Muon keeps no step counter: its Newton–Schulz step is
        device arithmetic only; ``orthogonalize="polar"`` is refused (``torch.linalg.eigh``
        checks its convergence on the host)."""
        if group["orthogonalize"] == "polar":
            return (
                "Muon's orthogonalize='polar' is not captured (torch.linalg.eigh reads its "
                "convergence flag on the host)"
            )
        return None

    def init(
        self, shape: torch.Size, ref: Tensor, group: Group, state: State, ctx: Context
    ) -> None:
        if len(shape) != 2:
            raise ValueError(f"Muon orthogonalizes matrices; got a direction of shape {shape}")
        rows, cols = int(shape[0]), int(shape[1])
        split = _SPLIT_DIM[ctx.layout]
        sharded = _sharded_dim(split, ctx.placement)
        long_dim = 0 if rows > cols else 1
        if sharded is not None and sharded != long_dim:
            raise ValueError(
                f"Muon on an FSDP-sharded {rows}×{cols} matrix needs its rows (the sharded "
                "dimension) to be the longer one; project it (rank < min(m, n)) or keep it "
                "in a group without rank (AdamW)"
            )
        state["muon.momentum"] = ctx.zeros(shape, STATE_DTYPES[group["state_dtype"]])
        # record which dim of the direction the layout splits (as Adafactor does; update's
        # context has the same layout, but checkpoints carry the key)
        state["muon.split_dim"] = counter(split)

    def update(self, u: Tensor, state: State, group: Group, ctx: Context) -> Tensor:
        buf = state["muon.momentum"]
        beta = group["momentum"]
        fast = fast_float32(u)  # TF32 for a 16-bit direction where galore2's ops run
        u = u.to(buf.dtype)
        buf.lerp_(u, 1 - beta)
        x = u.lerp(buf, beta) if group["nesterov"] else buf
        sharded = _split_of(state, ctx.placement)
        rows, cols = _global_2d(x, sharded, ctx)
        transpose = rows > cols  # work on short × long
        X = x.mT if transpose else x
        reduce = ctx.placement.reduce if sharded is not None else (lambda t: t)
        if group["orthogonalize"] == "polar":
            ortho = polar(X, reduce)
        else:
            with fast:
                ortho = newton_schulz(X, group["ns_steps"], reduce)
        if transpose:
            ortho = ortho.mT
        return ortho * _adjust(rows, cols, group)

    def stacks(self, group: Group, device: torch.device) -> bool:
        """Stacked entries (GaLore's shape batches): their momenta are elementwise and their
        orthogonalization runs on stacks anyway."""
        return True

    def update_many(
        self, us: list[Tensor], states: list[State], group: Group, ctxs: list[Context]
    ) -> list[Tensor]:
        """Batched :meth:`update`: the momenta by foreach kernels, the orthogonalization of
        whole directions of the same shape (and dtype, device) on their stack — one ``bmm``
        per product of the Newton–Schulz iteration, one batched ``eigh`` for ``polar``; a
        stacked entry is its matrices' stack already — and sharded directions one by one
        (their Gram matrices are all-reduced)."""
        whole = [
            i
            for i, (s, c) in enumerate(zip(states, ctxs, strict=True))
            if type(s) is StackedState  # a shape batch of local matrices (k × r × n)
            or _split_of(s, c.placement) is None
        ]
        out: list[Tensor | None] = [None] * len(us)
        for i in sorted(set(range(len(us))) - set(whole)):
            out[i] = self.update(us[i], states[i], group, ctxs[i])
        if not whole:
            return out  # type: ignore[return-value]
        beta = group["momentum"]
        bufs = [states[i]["muon.momentum"] for i in whole]
        xs = [u if u.dtype == b.dtype else u.to(b.dtype)
              for u, b in zip((us[i] for i in whole), bufs, strict=True)]  # fmt: skip
        torch._foreach_lerp_(bufs, xs, 1 - beta)
        xs = list(torch._foreach_lerp(xs, bufs, beta)) if group["nesterov"] else bufs
        # work on short × long: an m×r direction joins the r×m ones, transposed; a stacked
        # entry (k × r × n) is k matrices of the bucket at once
        buckets: dict[tuple[Any, ...], list[int]] = {}
        tall = [x.shape[-2] > x.shape[-1] for x in xs]
        for j, x in enumerate(xs):
            short_long = tuple(sorted(x.shape[-2:]))
            buckets.setdefault((short_long, x.dtype, x.device), []).append(j)
        for js in buckets.values():
            parts = [xs[j].mT if tall[j] else xs[j] for j in js]
            counts = [p.shape[0] if p.dim() == 3 else 1 for p in parts]
            if len(parts) == 1 and parts[0].dim() == 3:
                X = parts[0]
            elif all(p.dim() == 2 for p in parts):
                X = torch.stack(parts)
            else:
                X = torch.cat([p if p.dim() == 3 else p.unsqueeze(0) for p in parts])
            if group["orthogonalize"] == "polar":
                ortho = polar(X)
            else:
                given = [us[whole[j]] for j in js]  # one dtype: its context (see update())
                same = len({u.dtype for u in given}) == 1
                with fast_float32(given[0]) if same else nullcontext():
                    ortho = newton_schulz(X, group["ns_steps"])
            # the adjustment of "original" depends on which side is longer: a bucket may
            # hold two (one per shape)
            shapes = [tuple(xs[j].shape[-2:]) for j in js]
            adjust = {shape: _adjust(*shape, group) for shape in set(shapes)}
            if len(set(adjust.values())) == 1:
                ortho.mul_(next(iter(adjust.values())))
            else:
                per = tuple(adjust[sh] for sh, n in zip(shapes, counts, strict=True)
                            for _ in range(n))  # fmt: skip
                ortho.mul_(constants(per, ortho.dtype, ortho.device).view(-1, 1, 1))
            if len(js) == len(X) and all(p.dim() == 2 for p in parts):
                # views of each matrix, both ways round, made by two calls
                for j, o, t in zip(js, ortho.unbind(), ortho.mT.unbind(), strict=True):
                    out[whole[j]] = t if tall[j] else o
                continue
            start = 0
            for j, p, n in zip(js, parts, counts, strict=True):
                o = ortho[start : start + n] if p.dim() == 3 else ortho[start]
                out[whole[j]] = o.mT if tall[j] else o
                start += n
        return out  # type: ignore[return-value]


def _adjust(rows: int, cols: int, group: Group) -> float:
    """The learning-rate adjustment of a rows × cols orthogonalized update (``adjust_lr_fn``)."""
    if group["adjust_lr_fn"] == "match_rms_adamw":
        return 0.2 * math.sqrt(max(rows, cols))
    return math.sqrt(max(1.0, rows / cols))


def _global_2d(x: Tensor, sharded: int | None, ctx: Context) -> tuple[int, int]:
    """The global (rows, cols) of a direction whose local piece is ``x`` and whose dim
    ``sharded`` is split over ranks: the parameter's m (the parameter itself, or a right
    basis's m×r) or n (a left basis's r×n)."""
    rows, cols = int(x.shape[0]), int(x.shape[1])
    m = int(ctx.global_shape[0])
    if sharded == 0:
        return m, cols
    if sharded == 1:
        return rows, int(ctx.global_shape.numel() // m)
    return rows, cols


class MuonOrAdam(Transform):
    """Muon for the 2-D directions of the groups ``muon_groups`` picks, Adam for every
    other one.

    Args:
        muon_groups: whether a parameter group's 2-D directions are Muon's; handed by the
            chain that builds this rule (a module-level function, so the optimizer pickles).
    """

    name = "muon_or_adam"

    def __init__(self, muon_groups: Callable[[Group], bool]) -> None:
        self.muon_groups = muon_groups
        self.muon = ScaleByMuon()
        self.adam = ScaleByAdam()
        self.inner: list[Transform] = [self.muon, self.adam]

    def complex_problem(self, group: Group) -> str | None:
        return complex_problem(self) if self.muon_groups(group) else None

    def adamw_rule(self, group: Group) -> Transform | None:
        """In a group that is not Muon's every direction is Adam's: its answer."""
        return None if self.muon_groups(group) else self.adam.adamw_rule(group)

    def stacks(self, group: Group, device: torch.device) -> bool:
        """Stacked entries where both of its rules take them (a stack holds one's state)."""
        return self.muon.stacks(group, device) and self.adam.stacks(group, device)

    def masked_keys(self, group: Group) -> tuple[str, ...]:
        """Adam's (its directions get their flags; Muon's momentum is the snapshot's)."""
        return self.adam.masked_keys(group)

    def capture_problem(self, group: Group) -> str | None:
        """None: the choice is by state keys; Muon and Adam answer for themselves (``walk``)."""
        return None

    def _pick(self, state: State) -> Transform:
        return self.muon if "muon.momentum" in state else self.adam

    def init(
        self, shape: torch.Size, ref: Tensor, group: Group, state: State, ctx: Context
    ) -> None:
        use_muon = len(shape) == 2 and self.muon_groups(group)
        (self.muon if use_muon else self.adam).init(shape, ref, group, state, ctx)

    def update(self, u: Tensor, state: State, group: Group, ctx: Context) -> Tensor:
        return self._pick(state).update(u, state, group, ctx)

    def update_many(
        self, us: list[Tensor], states: list[State], group: Group, ctxs: list[Context]
    ) -> list[Tensor]:
        adam = [i for i, s in enumerate(states) if "muon.momentum" not in s]
        out: list[Tensor | None] = [None] * len(us)
        if adam:
            done = self.adam.update_many(
                [us[i] for i in adam], [states[i] for i in adam], group, [ctxs[i] for i in adam]
            )
            for i, r in zip(adam, done, strict=True):
                out[i] = r
        muon = [i for i, r in enumerate(out) if r is None]
        if muon:
            done = self.muon.update_many(
                [us[i] for i in muon], [states[i] for i in muon], group, [ctxs[i] for i in muon]
            )
            for i, r in zip(muon, done, strict=True):
                out[i] = r
        return out  # type: ignore[return-value]

    def bias_correction(self, state: State, group: Group) -> float:
        return self._pick(state).bias_correction(state, group)

    def second_moment_sum(self, state: State, group: Group) -> Tensor | None:
        return self._pick(state).second_moment_sum(state, group)

    def reset(self, state: State, group: Group) -> None:
        self._pick(state).reset(state, group)

    def rotate(self, state: State, rotate_fn: Callable[[Tensor, bool], Tensor]) -> None:
        self._pick(state).rotate(state, rotate_fn)


__all__ = ["MuonOrAdam", "ScaleByMuon", "newton_schulz", "polar"]
