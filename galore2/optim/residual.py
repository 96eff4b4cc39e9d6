"""What GaLore does with the gradient outside its subspace: Fira's residual compensation,
APOLLO's gradient scaling, and the norm-growth limiter both use.

Plain GaLore drops the part of the gradient its basis does not span: the update is
α·P·N (left side; α·N·Qᵀ on the right), where R = PᵀG is the projected gradient and
N = inner(R) what the inner rule (Adam…) made of it. Two group options change that:

``residual="fira"`` (Fira, arXiv 2410.01623) adds the residual G − P·R, scaled per channel
by φ = ‖N‖/‖R‖ — how much the inner rule amplified that channel of the projected
gradient (channel: the dimension the projection keeps — columns for a left basis,
rows for a right one; ‖·‖ over the projected dimension, ε = 1e-8 in the denominator)::

    update = α·P·N + φ ⊙ (G − P·R)

The residual is G − P·R, the part of G outside the subspace. The ``fira`` 1.0.2 package,
whose code produced the paper's tables, subtracts α·P·R instead (its ``project_back``
multiplies by α), which for α ≠ 1 leaves (1 − α)·φ ⊙ P·R — an unnormalized,
gradient-descent-like step inside the subspace that Adam's update already covers — in the
"residual". ``residual="fira"`` follows the paper's G − P·R; ``residual="fira_reference"``
is the package's behaviour::

    update = α·P·N + φ ⊙ (G − α·P·R)

(the same at α = 1; ``tests/optim/test_reference_fira.py`` checks ``"fira"`` against the
package at α = 1, the exact difference at α = 0.25, and ``"fira_reference"`` against the
package at α = 0.25). Both need an orthonormal basis (every projector but ``random``).

``scale_type="channel"`` or ``"tensor"`` (APOLLO, arXiv 2412.05270) replaces the
back-projection: the update is the raw full gradient scaled by the same ratio, per
channel or for the whole matrix (φ = ‖N‖_F/‖R‖_F)::

    update = α·φ ⊙ G

so the subspace only estimates the scaling and no basis needs to be accurate: a seeded
random projection (``projector="random"``, nothing stored) is enough. (apollo-torch
multiplies by √scale; here α multiplies: APOLLO-Mini's published scale 128 is α = √128.)

The **norm-growth limiter** (``norm_growth_limit`` γ, default 1.01; None: off) acts on
S = φ ⊙ residual (Fira) or S = φ ⊙ G (APOLLO): when ‖S_t‖ > γ·‖S_{t−1}‖, S_t is rescaled
to γ·‖S_{t−1}‖, so a sudden spike cannot blow up the update. Norms are compared before
the inner rule's bias correction (Adam's √(1−β₂ᵗ)/(1−β₁ᵗ), a schedule, not growth) and
before the learning rate, as both reference implementations do. Its state is one float64
scalar per matrix, ``galore.limit_norm`` (float64: a finite S may have a norm beyond
float32's range when ‖R‖ ≈ 0 makes φ huge) (0 until the first step: no previous norm, no
limit — also after a step whose S was exactly zero, where the references would clamp the
next steps to ~1e-8).

Along the data (a shape batch's gradients left where they are, where galore2's grouped
kernels run: :func:`.lowrank_plan.along`) no m×n tensor is made: APOLLO's S = φ ⊙ G stays
its operands, and Fira's update is written as ``α·decay·P·X + φ ⊙ G`` with
X = N − φ ⊙ R · c/(α·decay) (c = 1, or α for ``"fira_reference"``): the residual's
in-subspace part φ ⊙ P·R = P·(φ ⊙ R) folded into the low-rank factor (left; a right
basis's rows likewise), and the limiter's ‖S‖ taken from channel norms computed tile by
tile (:mod:`galore2.kernels.ops_scaled`).

Both keep every step's host reads at zero: ratios, norms and the limiter are tensor ops
(``torch.where``, no ``.item()``). Under FSDP2 the per-channel norms of a left basis's
column-sharded N and R are computed after one all-gather of [N; R] (the back-projection
needs all of N anyway), a right basis's rows are local, and the Frobenius norms are
all-reduced (``Placement.reduce``).
"""

from __future__ import annotations

from collections.abc import Callable
from contextlib import nullcontext
from typing import Any, NamedTuple

import torch
from torch import Tensor

from ..core.options import Choice, CrossCheck, Option, Optional, Real
from ..core.transform import LowRankUpdate, ResidualUpdate, ScaledUpdate
from ..kernels.ops_scaled import channel_norms_each, residual_norms_each
from ..kernels.tables import upload
from ..projectors import LEFT, RIGHT, Plan
from .products import fast_float32
from .projection import Projection

RESIDUAL = Option(
    "residual",
    "none",
    Choice(("none", "fira", "fira_reference")),
    "Fira: add the gradient's residual outside the subspace, scaled per channel by ‖N‖/‖R‖ "
    "('fira_reference': fira 1.0.2's residual G − α·P·R, which keeps (1 − α) of the "
    "in-subspace gradient)",
    resumable=False,
)
SCALE_TYPE = Option(
    "scale_type",
    None,
    Optional(Choice(("channel", "tensor")), "GaLore: project the subspace update back"),
    "APOLLO: the update is the raw gradient scaled by ‖N‖/‖R‖ per 'channel' or per 'tensor'",
    resumable=False,
)
NORM_GROWTH_LIMIT = Option(
    "norm_growth_limit",
    1.01,
    Optional(Real(low=1.0), "no limit"),
    "γ: the residual (Fira) or scaled gradient (APOLLO) may grow at most γ× per step",
)
OPTIONS = (RESIDUAL, SCALE_TYPE, NORM_GROWTH_LIMIT)

LIMIT_KEY = "galore.limit_norm"
_EPS = 1e-8  # the references' ε in ‖N‖/(‖R‖ + ε) and in the limiter


def active(group: dict[str, Any]) -> bool:
    """Does this group replace plain back-projection (Fira or APOLLO)?"""
    return group.get("residual", "none") != "none" or group.get("scale_type") is not None


def residual_c(group: dict[str, Any]) -> float:
    """Fira's c of the residual G + c·P·R: −1 (the paper's), or −α ("fira_reference")."""
    return -float(group["scale"]) if group["residual"] == "fira_reference" else -1.0


def projected_norms(group: dict[str, Any]) -> float | None:
    """The c of the channel norms of ``G + c·P·R`` and of R that a step takes with its
    projection where it needs both (:class:`Bucket`'s ``norms``: the norm-growth limiter
    on, φ per channel): Fira's residual's (:func:`residual_c`), APOLLO's gradient's own
    (0); None otherwise (no limiter, or APOLLO-Mini's per-tensor φ)."""
    if group["norm_growth_limit"] is None:
        return None
    if group["residual"] != "none" and group["scale_type"] is None:
        return residual_c(group)
    return 0.0 if group["scale_type"] == "channel" else None


def validate(group: dict[str, Any]) -> None:
    """Checks across keys: one of Fira / APOLLO, a side with channels, an orthonormal basis."""
    residual, scale_type = group["residual"], group["scale_type"]
    if residual != "none" and scale_type is not None:
        raise ValueError(
            f"residual={residual!r} and scale_type={scale_type!r} are two alternatives to "
            "GaLore's back-projection (Fira adds the scaled residual to it, APOLLO replaces it "
            "by the scaled gradient); set one of them"
        )
    if not active(group):
        return
    what = f"residual={residual!r}" if residual != "none" else f"scale_type={scale_type!r}"
    if group["proj_type"] == "full":
        raise ValueError(
            f"{what} needs a one-sided projection (its channels are the kept dimension); "
            "proj_type='full' projects both; use 'std', 'reverse_std', 'left' or 'right'"
        )
    if residual != "none" and group["projector"] == "random":
        raise ValueError(
            f"residual={residual!r} needs an orthonormal basis (G − P·PᵀG is the residual only then); "
            "projector='random' draws a Gaussian one. Use 'randomized', 'power' or 'svd', or "
            "APOLLO's scale_type with projector='random'"
        )
    if group.get("rank") is None or group.get("tensor_projection", "tucker") != "tucker":
        return
    for p in group["params"]:
        shape = tuple(p[1].shape if isinstance(p, tuple) else p.shape)
        if len(shape) > 2 and any(group["rank"] < d for d in shape):
            raise ValueError(
                f"{what} is defined for matrices; a parameter of shape {shape} would get a "
                "Tucker projection. Set tensor_projection='matrix' (treat it as "
                f"{shape[0]} × {int(torch.Size(shape[1:]).numel())}) or put it in a group "
                "without rank"
            )


#: the residual's check across keys (GaLore runs it): its own options and the projection's
CHECKS = (
    CrossCheck(
        ("residual", "scale_type", "proj_type", "projector", "rank", "tensor_projection",
         "params"),
        validate,
    ),
)  # fmt: skip


def init_state(state: dict[str, Tensor], group: dict[str, Any], ref: Tensor) -> None:
    if active(group):
        state[LIMIT_KEY] = torch.zeros((), dtype=torch.float64, device=ref.device)


def combine(
    G: Tensor,
    R: Tensor,
    N: Tensor,
    P: Tensor | None,
    Q: Tensor | None,
    state: dict[str, Tensor],
    group: dict[str, Any],
    plan: Plan,
    bias: float,
) -> Tensor:
    """The dense update of this rank's rows of the matrix (before the decay factor).

    ``G``: this rank's rows of the gradient (m_i × n); ``R``, ``N``: the projected gradient
    and the inner rule's output — for a left basis the *full* r×n (gathered), for a right
    one this rank's rows (m_i × r); ``P``: this rank's rows of the left basis, ``Q``: the
    right basis; ``bias``: the inner rule's bias-correction factor (see the module doc).
    """
    assert plan.side in (LEFT, RIGHT), plan.side  # validate() refuses full and Tucker
    with fast_float32(G):  # TF32 where the ops run with 16-bit gradients
        return _combine(G, R, N, P, Q, state, group, plan, bias)


def _combine(
    G: Tensor, R: Tensor, N: Tensor, P: Tensor | None, Q: Tensor | None,
    state: dict[str, Tensor], group: dict[str, Any], plan: Plan, bias: float,
) -> Tensor:  # fmt: skip
    """:func:`combine`'s arithmetic."""
    R, N = R.float(), N.float()
    alpha = float(group["scale"])
    scale_type = group["scale_type"]
    if scale_type == "tensor":
        sums = torch.stack([N.square().sum(), R.square().sum()])
        if plan.side == RIGHT:  # rows are sharded: a sum over ranks (left: gathered already)
            sums = plan.placement.reduce(sums)
        phi = sums[0].sqrt() / (sums[1].sqrt() + _EPS)
    else:  # per channel: columns of a left basis's r×n, rows of a right basis's m×r
        dim = 0 if plan.side == LEFT else 1
        phi = torch.linalg.vector_norm(N, dim=dim) / (torch.linalg.vector_norm(R, dim=dim) + _EPS)
        if plan.side == RIGHT:
            phi = phi.unsqueeze(1)
    if scale_type is not None:  # APOLLO: the raw gradient, scaled
        S = G.float() * phi
    else:  # Fira: the residual G − P·R, scaled ("fira_reference": fira 1.0.2's G − α·P·R)
        c = residual_c(group)
        if plan.side == LEFT:
            S = torch.addmm(G.float(), P.float(), R, alpha=c).mul_(phi)  # type: ignore[union-attr]
        else:
            S = torch.addmm(G.float(), R, Q.float().mT, alpha=c).mul_(phi)  # type: ignore[union-attr]
    S = _limit(S, state, group, plan, bias)
    if scale_type is not None:
        return S.mul_(alpha) if alpha != 1.0 else S
    if plan.side == LEFT:
        return S.addmm_(P.float(), N, alpha=alpha)  # type: ignore[union-attr]
    return S.addmm_(N, Q.float().mT, alpha=alpha)  # type: ignore[union-attr]


def combine_projected(
    projection: Projection, u: Tensor, R: Tensor, N: Tensor, state: dict[str, Tensor],
    group: dict[str, Any], bias: float,
) -> Tensor:  # fmt: skip
    """:func:`combine` of one projected matrix: its gradient ``u`` as its ``projection``
    sees it, R and N brought to the full low-rank shape (:meth:`.Projection.full`), its
    bases where the residual needs them (Fira; APOLLO's scaling needs none)."""
    N, R = projection.full(N, R)
    plan = projection.plan
    P, Q = (
        projection.projector.bases(state, plan) if group["residual"] != "none" else (None, None)
    )
    return combine(projection.matrix(u), R, N, P, Q, state, group, plan, bias)


def _limit(S: Tensor, state: dict[str, Tensor], group: dict[str, Any], plan: Plan,
           bias: float) -> Tensor:  # fmt: skip
    """S rescaled so that its norm (before bias correction) grows at most γ× per step."""
    gamma = group["norm_growth_limit"]
    if gamma is None:
        return S
    prev = state[LIMIT_KEY]
    # in float64: S's norm may overflow float32 when ‖R‖ ≈ 0 makes φ huge (finite S)
    sq = torch.linalg.vector_norm(S, dtype=torch.float64).square().reshape(1)
    norm = plan.placement.reduce(sq)[0].sqrt() / bias  # the norm the references limit
    ratio = torch.clamp(norm / (prev + _EPS), min=gamma) / gamma
    limiter = torch.where(prev > 0, ratio, torch.ones_like(ratio))
    prev.copy_(norm / limiter)
    return S.div_(limiter.float())


class Bucket(NamedTuple):
    """Same-shape whole (unsharded) matrices of one side, stacked: the input of
    :func:`combine_buckets`."""

    left: bool  # a left basis (channels: columns) or a right one (channels: rows)
    # the gradients, k × m × n; or (along the data) the k m × n gradients themselves
    G: Tensor | list[Tensor]
    R: Tensor  # the projected gradients, k × r × n (left) or k × m × r (right)
    N: Tensor  # the inner rule's outputs, shaped like R
    B: Tensor | None  # the bases on their side (P: k × m × r, Q: k × n × r); None for APOLLO
    states: list[dict[str, Tensor]]
    biases: list[float | Tensor]  # each matrix's inner bias correction (see _limit)
    owned: bool = True  # G is a temporary of the step (else, a view of the caller's: kept)
    # Fira along the data: a low-rank stack X to the factors (A_i, B_i) of each matrix's
    # P·X (X·Qᵀ) in the weights' dtype (.lowrank_batch.factor_lists); None otherwise
    factors: Callable[[Tensor], tuple[list[Tensor], list[Tensor]]] | None = None
    # a deferred step's flags (one tensor, the matrices' positions in it): the limiter keeps
    # a flagged-out matrix's last norm; None on other steps
    keep: tuple[Tensor, list[int]] | None = None
    # along the data: the float32 channel norms of the residuals G + c·P·R (Fira) or of G
    # (APOLLO) and of R, taken by the projection's launch
    # (.lowrank_batch.ShapeBatch.project, projected_norms); None otherwise
    norms: tuple[Tensor, Tensor] | None = None


class Residual(NamedTuple):
    """Fira's update of a shape batch along the data kept as operands,
    ``scale·P·X + G ⊙ factor`` (left; ``X·Qᵀ`` right): the gradients themselves (never
    written), the float32 factors (as :class:`Scaled`'s) and each matrix's low-rank factors
    (A_i, B_i) — the residual G − P·R folded in (X = N − R ⊙ factor / scale, scale =
    α·decay): no m×n tensor is made."""

    G: list[Tensor]
    factor: Tensor
    As: list[Tensor]
    Bs: list[Tensor]
    scale: float  # of the low-rank part: α·decay

    def updates(self, shapes: list[torch.Size]) -> list[ResidualUpdate]:
        """One :class:`~galore2.core.transform.ResidualUpdate` per matrix (``shapes``: the
        weights'): the optimizer applies a shape batch's in one grouped launch
        (``galore2::addmm_scaled_each_``)."""
        parts = zip(self.As, self.Bs, self.G, self.factor.unbind(0), shapes, strict=True)
        return [
            ResidualUpdate(LowRankUpdate(a, b, shape, self.scale), ScaledUpdate(g, f, shape))
            for a, b, g, f, shape in parts
        ]


class Scaled(NamedTuple):
    """APOLLO's stacked update kept as its operands, ``G ⊙ factor``: the gradients (k × m × n,
    their dtype, never written) and the float32 factors broadcast over them (k × 1 × n per
    column, k × m × 1 per row, k × 1 × 1 per matrix): each weight takes its matrix's by one
    ``addcmul_`` (:class:`~galore2.core.transform.ScaledUpdate`), no float32 m×n update."""

    G: Tensor | list[Tensor]  # or the gradients themselves (along the data)
    factor: Tensor

    def updates(self, shapes: list[torch.Size]) -> list[ScaledUpdate]:
        """One :class:`~galore2.core.transform.ScaledUpdate` per matrix (``shapes``: the
        weights'): the optimizer applies a shape batch's together
        (:func:`~galore2.core.apply.apply_updates`, one ``galore2::scaled_add_each_``)."""
        Gs = self.G if isinstance(self.G, list) else self.G.unbind(0)
        return [
            ScaledUpdate(g, f, shape)
            for g, f, shape in zip(Gs, self.factor.unbind(0), shapes, strict=True)
        ]


def combine_buckets(
    buckets: list[Bucket], group: dict[str, Any], decay: float
) -> list[Tensor | Scaled]:
    """:func:`combine` of each :class:`Bucket`'s matrices, times ``decay``: one stacked
    update (k × m × n, float32) per bucket, or for APOLLO's gradients of up to 32 bits its
    operands (:class:`Scaled`: the update is never made). Every op runs once per bucket —
    the channel norms, Fira's two products (``baddbmm``, in
    :func:`~.products.fast_float32`'s context where the buckets' gradients share a
    dtype), the scaling — or once for all of them (ratios, the limiter's scalars); no host
    read. A stack's tensors may be written in place (the caller's stacks are temporaries).
    """
    firsts = [b.G if isinstance(b.G, Tensor) else b.G[0] for b in buckets]
    mixed = len({g.dtype for g in firsts}) > 1  # a float32 bucket keeps torch's setting
    with nullcontext() if mixed else fast_float32(firsts[0]):
        return _combine_buckets(buckets, group, decay)


def _combine_buckets(
    buckets: list[Bucket], group: dict[str, Any], decay: float
) -> list[Tensor | Scaled]:  # fmt: skip
    """:func:`combine_buckets`' arithmetic."""
    alpha, scale_type = float(group["scale"]), group["scale_type"]
    limit = group["norm_growth_limit"] is not None
    c_res = residual_c(group)
    # APOLLO's and the gradients along the data read only N's and R's norms (and X, small):
    # off the CPU in their dtype (float32 sums, no float32 copy); Fira's stacked products
    # read them in float32
    wide = [_for_norms if scale_type is not None or isinstance(b.G, list)
            else torch.Tensor.float for b in buckets]  # fmt: skip
    Ns = [w(b.N) for w, b in zip(wide, buckets, strict=True)]
    Rs = [w(b.R) for w, b in zip(wide, buckets, strict=True)]
    # per matrix (‖N‖_F / (‖R‖_F + ε)), or per channel: columns of a left basis's r×n,
    # rows of a right basis's m×r
    dims = [(1, 2) if scale_type == "tensor" else 1 if b.left else 2 for b in buckets]
    num = [_norms(n, d) for n, d in zip(Ns, dims, strict=True)]
    den = [_norms(r, d) if b.norms is None else b.norms[1]
           for b, r, d in zip(buckets, Rs, dims, strict=True)]  # fmt: skip
    torch._foreach_add_(den, _EPS)
    phis = torch._foreach_div(num, den)
    S, norms = [], []
    for b, r, phi, d in zip(buckets, Rs, phis, dims, strict=True):
        if isinstance(b.G, list):  # along the data: the gradients where they are
            S.append(b.G)
            if limit:
                norms.append(_scaled_norm_each(b, r, phi, d, c_res))
            continue
        if scale_type is not None and b.G.dtype in _UP_TO_FP32:
            # APOLLO: the raw gradient as it is (bf16: read in its dtype); S = G·φ is made
            # below by the scaling itself, in float32 (a product with a float32 factor)
            S.append(b.G)
            if limit:
                norms.append(_scaled_norm(b.G, phi, d))
            continue
        Gs = b.G.float()
        kept = not b.owned and Gs.data_ptr() == b.G.data_ptr()  # not to be written
        if scale_type is None:  # Fira: the residual G − P·R ("fira_reference": G − α·P·R)
            Bs = b.B.float()  # type: ignore[union-attr]
            # in place when the stack of gradients is a temporary (no second m×n buffer)
            bmm = torch.baddbmm if kept else torch.Tensor.baddbmm_
            Gs = bmm(Gs, Bs, r, alpha=c_res) if b.left else bmm(Gs, r, Bs.mT, alpha=c_res)
        elif kept:  # APOLLO scales S in place: a copy of the caller's stack
            Gs = Gs.clone()
        S.append(Gs)  # APOLLO: the raw gradient
        if limit:  # ‖φ ⊙ S‖ from the channels' norms of S, φ applied in float64
            norms.append(_scaled_norm(Gs, phi, d))
    # every per-matrix and per-channel factor of S in one small tensor per bucket, applied
    # by one pass over S: φ, the limiter's 1/ℓ, and the decay (APOLLO: α too); Fira's α·P·N
    # then comes in with α·decay (the per-tensor path's ((φ⊙S)/ℓ + α·P·N)·decay, rounded
    # differently: within 1e-7)
    inv = _limit_buckets(norms, buckets, group) if limit else None
    c = decay * (alpha if scale_type is not None else 1.0)
    start = 0
    for j, (s, phi) in enumerate(zip(S, phis, strict=True)):
        k = len(s) if isinstance(s, list) else s.shape[0]
        if inv is not None:
            phi = phi.mul_(inv[start : start + k].view(k, 1, 1))
        start += k
        factor = phi.mul_(c) if c != 1.0 else phi
        if isinstance(s, list) and scale_type is not None:  # G ⊙ factor into each weight
            S[j] = Scaled(s, factor)
        elif isinstance(s, list):  # Fira along the data: α·decay·P·X + G ⊙ factor
            # X = N + c·R ⊙ factor / (α·decay): the residual's P·R part folded into the
            # low-rank factor (one pass over the r-sized stacks, X in N's dtype), so each
            # weight takes P·X and G ⊙ factor in one pass
            scale = alpha * decay
            if scale != 0.0:
                X = torch.addcmul(Ns[j], Rs[j], factor, value=c_res / scale,
                                  out=torch.empty_like(Ns[j]))  # fmt: skip
            else:  # no low-rank update (a decay factor of 0): the residual's P·R term alone
                X, scale = torch.mul(Rs[j], factor).mul_(c_res).to(Ns[j].dtype), 1.0
            S[j] = Residual(s, factor, *buckets[j].factors(X), scale)  # type: ignore[misc]
        elif s.dtype == torch.float32 and s is not buckets[j].G:
            s.mul_(factor)
        elif scale_type is not None:  # APOLLO's raw gradient: G ⊙ factor, applied as such
            S[j] = Scaled(s, factor)
        else:  # Fira's residual written into the caller's float32 stack: a new S
            S[j] = torch.mul(s, factor)
    if scale_type is None:
        for s, b, n in zip(S, buckets, Ns, strict=True):  # type: ignore[assignment]
            if isinstance(s, Residual):
                continue
            Bs = b.B.float()  # type: ignore[union-attr]
            if b.left:
                s.baddbmm_(Bs, n, alpha=alpha * decay)
            else:
                s.baddbmm_(n, Bs.mT, alpha=alpha * decay)
    return S


#: gradient dtypes whose product with a float32 factor is float32 (the float32 path's bits)
_UP_TO_FP32 = (torch.bfloat16, torch.float16, torch.float32)


def _summed_squares(x: Tensor, dim: int | tuple[int, int]) -> bool:
    """Whether channel norms of ``x`` over ``dim`` are taken from summed squares rather than
    ``vector_norm``: over dim 1 (a left basis's columns) on the CPU, where torch's
    ``vector_norm`` over a strided dim is ~20× slower (elsewhere it reads x once and
    writes no squares)."""
    return dim == 1 and x.device.type == "cpu"


def _for_norms(x: Tensor) -> Tensor:
    """``x`` (an N or R stack of which only norms, or a small product, are taken: APOLLO's,
    and Fira's along the data) as :func:`_norms` reads it: in float32 on the CPU (the
    summed squares need it) and from float64 (φ is float32 on every path), as it is
    elsewhere (``vector_norm`` sums a 16-bit x in float32)."""
    keep = x.device.type != "cpu" and x.dtype in _UP_TO_FP32
    return x if keep else x.float()


def _norms(x: Tensor, dim: int | tuple[int, int]) -> Tensor:
    """2-norms of a stack over ``dim`` (kept), summed in float32; see
    :func:`_summed_squares`."""
    if _summed_squares(x, dim):
        return x.square().sum(dim=1, keepdim=True).sqrt_()
    return torch.linalg.vector_norm(x, dim=dim, keepdim=True, dtype=torch.float32)


def _scaled_norm(res: Tensor, phi: Tensor, dim: int | tuple[int, int]) -> Tensor:
    """‖φ ⊙ res‖_F of each stacked matrix, in float64: Σ_c (φ_c·‖res_c‖)² over the channels
    φ scales (``dim``: the dims φ was reduced over). Only res's channel norms are full-size
    work, in float32 (they overflow only for gradient entries beyond ~1e18, where Adam's
    second moment overflows first); φ — huge when ‖R‖ ≈ 0 — multiplies them in float64,
    where ‖S‖ cannot overflow (the per-tensor path's float64 norm of S, within 1e-7)."""
    if _summed_squares(res, dim):  # in float32
        squares = res.float().square_() if res.dtype != torch.float32 else res.square()
        squares = squares.sum(dim=1, keepdim=True)
        return phi.double().square_().mul_(squares).sum(dim=(1, 2)).sqrt_()
    # accumulated in float32 whatever res's dtype (its values are exact in float32): one
    # read of res, no float32 copy
    channel = torch.linalg.vector_norm(res, dim=dim, keepdim=True, dtype=torch.float32)
    return torch.linalg.vector_norm(phi.double().mul_(channel), dim=(1, 2))


def _scaled_norm_each(
    b: Bucket, R: Tensor, phi: Tensor, dim: int | tuple[int, int], c: float
) -> Tensor:  # fmt: skip
    """:func:`_scaled_norm` of a bucket whose gradients are not stacked (along the data):
    the channel norms of its gradients (APOLLO: ``galore2::channel_norms_each``) or of its
    residuals G + c·P·R (Fira: ``galore2::residual_norms_each``, never made), by one grouped
    pass — columns for ``dim`` 1, rows for 2; a per-matrix φ takes the columns', whose
    norm is the matrix's."""
    side = 1 if dim == 2 else 0
    if b.norms is not None:  # taken with the projection
        channel = b.norms[0]
    elif b.factors is None:
        channel = channel_norms_each(b.G, side)
    else:
        channel = residual_norms_each(b.G, *b.factors(R), c, side)
    return torch.linalg.vector_norm(phi.double().mul(channel), dim=(1, 2))


def _limit_buckets(norms: list[Tensor], buckets: list[Bucket], group: dict[str, Any]) -> Tensor:
    """:func:`_limit` of the stacked matrices of ``buckets``, whose norms (float64, before
    bias correction) are ``norms``: the scalars of every matrix together. Returns each
    matrix's 1/ℓ (float32, in bucket order), the factor that limits its growth."""
    gamma = group["norm_growth_limit"]
    norm = torch.cat(norms) if len(norms) > 1 else norms[0]
    bias = [x for b in buckets for x in b.biases]
    if isinstance(bias[0], Tensor):  # device bias corrections (capturable): no host read
        norm = norm.div_(torch.stack(bias).to(norm.device))
    elif all(x == bias[0] for x in bias):
        norm = norm.div_(bias[0])
    else:  # steps differ between matrices (reset, parameters added later)
        norm = norm.div_(torch.tensor(bias, dtype=torch.float64).to(norm.device))
    prevs = [s[LIMIT_KEY] for b in buckets for s in b.states]
    prev = torch.stack(prevs)
    ratio = torch.clamp(norm / (prev + _EPS), min=gamma).div_(gamma)
    limiter = ratio.masked_fill_(prev <= 0, 1.0)  # no previous norm: no limit
    new = norm.div_(limiter)
    if buckets[0].keep is not None:  # a deferred step: a flagged-out matrix keeps its norm
        keep = buckets[0].keep[0]
        at = [j for b in buckets for j in b.keep[1]]  # type: ignore[index]
        # the positions uploaded anew (not a kept table: a step's memory must not depend on
        # which steps ran before it in the process, as the planner measures it)
        new = torch.where(keep.index_select(0, upload(at, keep.device)), new, prev)
    torch._foreach_copy_(prevs, list(new.unbind()))
    return limiter.reciprocal_().float()


__all__ = [
    "CHECKS",
    "LIMIT_KEY",
    "NORM_GROWTH_LIMIT",
    "OPTIONS",
    "RESIDUAL",
    "SCALE_TYPE",
    "Bucket",
    "Residual",
    "Scaled",
    "active",
    "combine",
    "combine_buckets",
    "init_state",
    "projected_norms",
    "residual_c",
    "validate",
]
