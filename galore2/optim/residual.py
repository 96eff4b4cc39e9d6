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

Both keep every step's host reads at zero: ratios, norms and the limiter are tensor ops
(``torch.where``, no ``.item()``). Under FSDP2 the per-channel norms of a left basis's
column-sharded N and R are computed after one all-gather of [N; R] (the back-projection
needs all of N anyway), a right basis's rows are local, and the Frobenius norms are
all-reduced (``Placement.reduce``).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from ..core.options import Choice, Option, Optional, Real
from ..projectors import LEFT, RIGHT, Plan

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
        c = -alpha if group["residual"] == "fira_reference" else -1.0
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


def combine_many(
    G: list[Tensor],
    R: list[Tensor],
    N: list[Tensor],
    B: list[Tensor | None],
    states: list[dict[str, Tensor]],
    group: dict[str, Any],
    sides: list[int],
    biases: list[float],
    decay: float,
) -> list[Tensor]:
    """:func:`combine` of several whole (unsharded) matrices, times ``decay``: the batched path.

    ``B[i]``: matrix i's basis on its side (P for a left basis, Q for a right one; None for
    APOLLO), ``sides[i]`` that side. Matrices of the same (side, shapes, dtype, device) are
    stacked, so every op runs once per such bucket — the channel norms, Fira's two products
    (``baddbmm``), the scaling — or once for all of them (ratios, the limiter's scalars);
    no host read. Returns one m×n view per matrix, in the order given.
    """
    alpha, scale_type = float(group["scale"]), group["scale_type"]
    buckets: dict[tuple[Any, ...], list[int]] = {}
    for i, (g, r) in enumerate(zip(G, R, strict=True)):
        key = (sides[i], tuple(g.shape), tuple(r.shape), g.dtype, g.device)
        buckets.setdefault(key, []).append(i)
    idxs = list(buckets.values())
    left = [sides[idx[0]] == LEFT for idx in idxs]
    # N and R of a bucket in one stack, their norms in one reduction
    NRs = [torch.stack([*(N[i] for i in idx), *(R[i] for i in idx)]).float() for idx in idxs]
    Ns = [nr[: len(idx)] for nr, idx in zip(NRs, idxs, strict=True)]
    Rs = [nr[len(idx) :] for nr, idx in zip(NRs, idxs, strict=True)]
    # per matrix (‖N‖_F / (‖R‖_F + ε)), or per channel: columns of a left basis's r×n,
    # rows of a right basis's m×r
    dims = [(1, 2) if scale_type == "tensor" else 1 if lf else 2 for lf in left]
    sums = [
        torch.linalg.vector_norm(nr, dim=d, keepdim=True) for nr, d in zip(NRs, dims, strict=True)
    ]
    num = [sm[: len(idx)] for sm, idx in zip(sums, idxs, strict=True)]
    den = [sm[len(idx) :] for sm, idx in zip(sums, idxs, strict=True)]
    torch._foreach_add_(den, _EPS)
    phis = torch._foreach_div(num, den)
    S, bases = [], []
    for idx, r, phi, lf in zip(idxs, Rs, phis, left, strict=True):
        Gs = torch.stack([G[i] for i in idx]).float()
        if scale_type is not None:  # APOLLO: the raw gradient, scaled
            S.append(Gs.mul_(phi))
            continue
        Bs = torch.stack([B[i] for i in idx]).float()  # type: ignore[misc]
        bases.append(Bs)
        c = -alpha if group["residual"] == "fira_reference" else -1.0  # as in combine()
        res = torch.baddbmm(Gs, Bs, r, alpha=c) if lf else torch.baddbmm(Gs, r, Bs.mT, alpha=c)
        S.append(res.mul_(phi))
    _limit_many(S, [i for idx in idxs for i in idx], states, group, biases)
    if scale_type is not None:
        if alpha != 1.0:
            torch._foreach_mul_(S, alpha)
    else:
        for s, Bs, n, lf in zip(S, bases, Ns, left, strict=True):
            if lf:
                s.baddbmm_(Bs, n, alpha=alpha)
            else:
                s.baddbmm_(n, Bs.mT, alpha=alpha)
    if decay != 1.0:
        torch._foreach_mul_(S, decay)
    out: list[Tensor] = [None] * len(G)  # type: ignore[list-item]
    for idx, s in zip(idxs, S, strict=True):
        for j, i in enumerate(idx):
            out[i] = s[j]
    return out


def _limit_many(
    S: list[Tensor],
    order: list[int],
    states: list[dict[str, Tensor]],
    group: dict[str, Any],
    biases: list[float],
) -> None:
    """:func:`_limit` of the stacked matrices ``S`` (in place), whose matrices are those of
    ``order``: one norm per bucket, the scalars of every matrix together."""
    gamma = group["norm_growth_limit"]
    if gamma is None:
        return
    # in float64: S's norm may overflow float32 when ‖R‖ ≈ 0 makes φ huge (finite S)
    sqs = [s.flatten(1).double().square_().sum(dim=1) for s in S]
    sq = torch.cat(sqs) if len(sqs) > 1 else sqs[0]
    bias = [biases[i] for i in order]
    if isinstance(bias[0], Tensor):  # device bias corrections (capturable): no host read
        norm = sq.sqrt_().div_(torch.stack(bias).to(sq.device))
    elif all(b == bias[0] for b in bias):
        norm = sq.sqrt_().div_(bias[0])
    else:  # steps differ between matrices (reset, parameters added later)
        norm = sq.sqrt_().div_(torch.tensor(bias, dtype=torch.float64).to(sq.device))
    prevs = [states[i][LIMIT_KEY] for i in order]
    prev = torch.stack(prevs)
    ratio = torch.clamp(norm / (prev + _EPS), min=gamma).div_(gamma)
    limiter = ratio.masked_fill_(prev <= 0, 1.0)  # no previous norm: no limit
    torch._foreach_copy_(prevs, list(norm.div_(limiter).unbind()))
    limiter = limiter.float()
    start = 0
    for s in S:
        k = s.shape[0]
        s.div_(limiter[start : start + k].view(k, 1, 1))
        start += k


__all__ = [
    "LIMIT_KEY",
    "NORM_GROWTH_LIMIT",
    "OPTIONS",
    "RESIDUAL",
    "SCALE_TYPE",
    "active",
    "combine",
    "combine_many",
    "init_state",
    "validate",
]
