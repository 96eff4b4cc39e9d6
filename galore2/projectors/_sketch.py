"""Shared numerical pieces of the randomized and power projectors.

Orthonormalization is a mixed-precision CholeskyQR2 (first Gram matrix in float64) with a
certificate: the second pass's Gram matrix is Q₁ᵀQ₁, so ‖Q₁ᵀQ₁ − I‖_F — how far the first
pass got — costs nothing extra. When it is ≤ 1/2 (so κ(Q₁)² ≤ 3) the second pass returns a
Q orthonormal to O(u) whose columns span Y's as accurately as Householder QR's would
(Yamamoto et al. 2015: CholeskyQR2 is stable once its second pass sees a well-conditioned
input). When it is not — Y too ill-conditioned even so (κ ≳ 1e6 after equilibration) or
rank-deficient (a sketch with more columns than G's rank), where CholeskyQR can "succeed"
with a far from orthonormal Q — Householder QR replaces it. A basis search reads the
certificates of all its orthonormalizations together, once: one device→host
synchronization per basis (one per orthonormalization under a distributed placement, see
:func:`certified`).
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch
from torch import Tensor

from .._numerics import generator_for, mix_seed
from ..placement import LOCAL, Collective, Placement

# ‖Q₁ᵀQ₁ − I‖_F above which CholeskyQR2's first pass is deemed to have failed: below it
# κ(Q₁)² ≤ 3 and the second pass is as accurate as Householder QR.
_CERTIFY = 0.5

Orth = Callable[[Tensor], Tensor]


def cholesky_qr2(Y: Tensor, placement: Placement = LOCAL) -> tuple[Tensor, Tensor]:
    """Mixed-precision CholeskyQR2 of Y (column order and signs kept) and its certificate,
    a 0-d bool tensor on Y's device; no host read. Y may be row-sharded: the Gram matrices
    are summed over ``placement``.

    The first pass forms and factors the Gram matrix in float64 (equilibrated: D⁻¹·YᵀY·D⁻¹
    with D the column norms, solved with R·D — the same Q, a well-scaled Cholesky), so its
    Q₁ is off orthonormal by about u·κ(Y) instead of u·κ(Y)² (Yamazaki, Tomov & Dongarra
    2015): fp32 sketches of real gradients (κ up to ~1e6 after power iterations) need no
    fallback. The second pass, in Y's dtype, makes Q orthonormal to O(u). Certificate:
    both Cholesky factorizations succeeded and ‖Q₁ᵀQ₁ − I‖_F ≤ 1/2 (read off the second
    pass's Gram matrix); False for a rank-deficient or non-finite Y.
    """
    Y64 = Y.double()
    gram = placement.reduce(Y64.mT @ Y64)
    d = torch.diagonal(gram).sqrt()
    R, info1 = torch.linalg.cholesky_ex(gram / d[:, None] / d[None, :], upper=True)
    Q1 = torch.linalg.solve_triangular((R * d[None, :]).to(Y.dtype), Y, upper=True, left=False)
    gram = placement.reduce(Q1.mT @ Q1)
    R, info2 = torch.linalg.cholesky_ex(gram, upper=True)
    Q = torch.linalg.solve_triangular(R, Q1, upper=True, left=False)
    eye = torch.eye(gram.shape[0], dtype=gram.dtype, device=gram.device)
    near = torch.linalg.matrix_norm(gram - eye) <= _CERTIFY
    return Q, (info1 == 0) & (info2 == 0) & near


def gram_collectives(k: int, where: str) -> list[Collective]:
    """What :func:`cholesky_qr2` of a row-sharded Y with ``k`` columns issues: two k×k Gram
    all-reduces, the first in fp64 (its fp64 retry after a failed certificate is not listed)."""
    return [
        Collective("all_reduce", (k, k), torch.float64, f"{where}: CholeskyQR2 Gram 1 (float64)"),
        Collective("all_reduce", (k, k), torch.float32, f"{where}: CholeskyQR2 Gram 2"),
    ]


def householder(Y: Tensor) -> Tensor:
    """Householder QR's Q of Y, signed so that R has a non-negative diagonal (as CholeskyQR's)."""
    Q, R = torch.linalg.qr(Y, mode="reduced")
    return Q * torch.where(torch.diagonal(R) < 0, -1.0, 1.0).to(Q.dtype)


def certified(run: Callable[[Orth], Tensor], placement: Placement, eager: bool) -> Tensor:
    """``run(orth)`` with every ``orth`` a certified CholeskyQR2 over ``placement``, and the
    robust orthonormalization (:func:`robust`) wherever a certificate fails.

    By default the certificates are read together once, at the end, and if any failed
    ``run`` is repeated with the robust orthonormalization throughout: one host read per
    ``run`` (a failure costs the run twice). A run whose iterates pass through collectives
    is ``eager`` instead: each certificate is read as it is made and only a failed
    orthonormalization is redone, so a failure repeats no collective of ``run`` (only the
    row-sharded retry's own Gram all-reduces are added), at one host read per
    orthonormalization. Every rank reads the same certificates (their Gram matrices are
    all-reduced or replicated), so every rank takes the same branch. ``run`` must be
    deterministic apart from ``orth``.
    """
    oks: list[Tensor] = []

    def fast(Y: Tensor) -> Tensor:
        Q, ok = cholesky_qr2(Y, placement)
        if eager:
            return Q if bool(ok) else robust(Y, placement)
        oks.append(ok)
        return Q

    out = run(fast)
    if eager or not oks or bool(torch.stack(oks).all()):  # the one host read
        return out
    return run(lambda Y: robust(Y, placement))


def robust(Y: Tensor, placement: Placement) -> Tensor:
    """What replaces an uncertified CholeskyQR2: Householder QR, or, for row-sharded Y (no
    Householder QR across ranks), :func:`_orthonormalize_sharded`."""
    if placement.distributed:
        return _orthonormalize_sharded(Y, placement)
    return householder(Y)


def _orthonormalize_sharded(Y: Tensor, placement: Placement) -> Tensor:
    """Row-sharded Y that fp32 CholeskyQR2 could not certify: float64 CholeskyQR2; if Y is
    rank-deficient (a gradient of rank < k), Y completed with tiny random directions (they
    carry none of G's energy: what Householder QR does in one process); LinAlgError if that
    fails too (the refresh then keeps the basis)."""
    Y64 = Y.double()
    Q, ok = cholesky_qr2(Y64, placement)
    if not bool(ok):
        total = placement.reduce(Y64.pow(2).sum().reshape(1))
        rms = math.sqrt(float(total) / max(1, Y.numel() * placement.world)) or 1.0
        gen = generator_for(Y.device, mix_seed(placement.rank, *Y.shape))
        noise = torch.randn(Y.shape, generator=gen, device=Y.device, dtype=torch.float64)
        Q, ok = cholesky_qr2(Y64 + 1e-6 * rms * noise, placement)
        if not bool(ok):
            raise torch.linalg.LinAlgError("sharded CholeskyQR2 failed: basis kept")
    return Q.to(Y.dtype)


def orthonormalize_rows(Y: Tensor, placement: Placement) -> Tensor:
    """``orthonormalize`` for a Y whose rows may be sharded over ``placement`` (Gram
    matrices all-reduced). One host read."""
    return certified(lambda orth: orth(Y), placement, eager=True)


def orthonormalize(Y: Tensor) -> Tensor:
    """An orthonormal basis of Y's columns, column order and signs kept (R has a positive
    diagonal), as accurate as Householder QR's.

    CholeskyQR2 is all BLAS-3 and several times faster than Householder QR for tall
    thin Y. Columns are equilibrated first (warm-started iterates are near-orthogonal
    with very different norms, σᵢ²), which lets it run in the input dtype; Householder QR
    takes over when the result cannot be certified. One host read.
    """
    return certified(lambda orth: orth(Y), LOCAL, eager=True)


def top_eigvecs(gram: Tensor, rank: int, dtype: torch.dtype) -> Tensor:
    """Eigenvectors of the ``rank`` largest eigenvalues of a small symmetric PSD matrix."""
    _, vecs = torch.linalg.eigh(gram.double())  # ascending
    return vecs[:, -rank:].flip(-1).to(dtype)


def _gaussian(rows: int, k: int, seed: int, like: Tensor) -> Tensor:
    gen = generator_for(like.device, seed)
    return torch.randn(rows, k, generator=gen, device=like.device, dtype=like.dtype)


def left_basis(
    G: Tensor, m: int, rank: int, oversample: int, iters: int, seed: int, pl: Placement = LOCAL
) -> Tensor:
    """Randomized (Halko–Martinsson–Tropp) top-``rank`` basis of G's column space (m×rank).

    G (m×n) may be row-sharded over ``pl`` (this rank holds some rows); the basis comes
    back sharded the same way. Ω (n×k, k = rank + oversample) is seeded, so every rank
    draws the same. Collectives: k×k and n×k all-reduces. One host read (:func:`certified`).
    """
    n = G.shape[1]
    k = min(rank + oversample, m, n)
    GO = G @ _gaussian(n, k, seed, G)

    def run(orth: Orth) -> Tensor:
        Y = orth(GO)
        for _ in range(iters):
            Y = orth(G @ pl.reduce(G.mT @ Y))
        return Y

    Y = certified(run, pl, eager=pl.distributed)
    if k == rank:
        return Y
    B = pl.reduce(Y.mT @ G)  # k×n
    return Y @ top_eigvecs(B @ B.mT, rank, Y.dtype)


def right_basis(
    G: Tensor, m: int, rank: int, oversample: int, iters: int, seed: int, pl: Placement = LOCAL
) -> Tensor:
    """Randomized top-``rank`` basis of Gᵀ's column space (n×rank), replicated on every rank.

    G (m×n) may be row-sharded: Gᵀ·X = Σ over ranks of G_iᵀ·X_i. Ω (m×k) is seeded and
    each rank uses its own rows of it. Collectives: n×k and k×k all-reduces. One host read.
    """
    n = G.shape[1]
    k = min(rank + oversample, m, n)
    start, stop = pl.row_range(m)
    GO = pl.reduce(G.mT @ _gaussian(m, k, seed, G)[start:stop])

    def run(orth: Orth) -> Tensor:
        Y = orth(GO)
        for _ in range(iters):
            Y = orth(pl.reduce(G.mT @ (G @ Y)))
        return Y

    Y = certified(run, LOCAL, eager=pl.distributed)
    if k == rank:
        return Y
    C = G @ Y  # m×k (rows sharded)
    return Y @ top_eigvecs(pl.reduce(C.mT @ C), rank, Y.dtype)


def warm_left(G: Tensor, P: Tensor, iters: int, pl: Placement = LOCAL) -> Tensor:
    """Subspace iteration from an orthonormal (row-sharded) basis P: Y ← orth(G·(Gᵀ·Y)).
    One host read."""

    def run(orth: Orth) -> Tensor:
        Y = P
        for _ in range(iters):
            Y = orth(G @ pl.reduce(G.mT @ Y))
        return Y

    return certified(run, pl, eager=pl.distributed)


def warm_right(G: Tensor, Q: Tensor, iters: int, pl: Placement = LOCAL) -> Tensor:
    """Subspace iteration from an orthonormal (replicated) basis Q: Y ← orth(Gᵀ·(G·Y)).
    One host read."""

    def run(orth: Orth) -> Tensor:
        Y = Q
        for _ in range(iters):
            Y = orth(pl.reduce(G.mT @ (G @ Y)))
        return Y

    return certified(run, LOCAL, eager=pl.distributed)
