"""Shared numerical pieces of the randomized and power projectors."""

from __future__ import annotations

import math

import torch
from torch import Tensor

from .._numerics import all_finite, generator_for, mix_seed
from ..placement import LOCAL, Placement


def _cholesky_qr(
    Y: Tensor, equilibrate: bool = False, placement: Placement = LOCAL
) -> Tensor | None:
    """One CholeskyQR pass: Y·R⁻¹ with RᵀR = YᵀY; None if YᵀY is not numerically PD.

    ``equilibrate`` factors D⁻¹·YᵀY·D⁻¹ (D = column norms, read off the Gram diagonal)
    instead, and solves with R·D: the same Q, but Cholesky sees a well-scaled matrix.
    Y may be row-sharded: the Gram matrix is summed over ``placement``.
    """
    gram = placement.reduce(Y.mT @ Y)
    if equilibrate:
        d = torch.diagonal(gram).sqrt()
        if not bool((d > 0).all()):
            return None
        R, info = torch.linalg.cholesky_ex(gram / d[:, None] / d[None, :], upper=True)
        R = R * d[None, :]
    else:
        R, info = torch.linalg.cholesky_ex(gram, upper=True)
    if int(info) != 0:
        return None
    return torch.linalg.solve_triangular(R, Y, upper=True, left=False)


def _cholesky_qr2(Y: Tensor, placement: Placement = LOCAL) -> Tensor | None:
    Q = _cholesky_qr(Y, True, placement)
    return None if Q is None else _cholesky_qr(Q, False, placement)


def orthonormalize_rows(Y: Tensor, placement: Placement) -> Tensor:
    """``orthonormalize`` for a Y whose rows are sharded over ``placement`` (CholeskyQR2
    with all-reduced Gram matrices; float64 retry; LinAlgError if Y is too ill-conditioned).
    Every rank takes the same branch: the Gram matrices are identical everywhere."""
    if not placement.distributed:
        return orthonormalize(Y)
    Q = _cholesky_qr2(Y, placement)
    if Q is None:
        Q = _cholesky_qr2(Y.double(), placement)
    if Q is None:
        # Rank-deficient Y (a gradient of rank < k): complete it with tiny random directions
        # (they carry none of G's energy) — what Householder QR does in one process.
        Y64 = Y.double()
        total = placement.reduce(Y64.pow(2).sum().reshape(1))
        rms = math.sqrt(float(total) / max(1, Y.numel() * placement.world)) or 1.0
        gen = generator_for(Y.device, mix_seed(placement.rank, *Y.shape))
        noise = torch.randn(Y.shape, generator=gen, device=Y.device, dtype=torch.float64)
        Q = _cholesky_qr2(Y64 + 1e-6 * rms * noise, placement)
        if Q is None:
            raise torch.linalg.LinAlgError("sharded CholeskyQR2 failed: basis kept")
    return Q.to(Y.dtype)


def orthonormalize(Y: Tensor) -> Tensor:
    """An orthonormal basis of Y's columns, column order and signs kept (R has a positive diagonal).

    CholeskyQR2 is all BLAS-3 and several times faster than Householder QR for tall
    thin Y. Columns are equilibrated first (warm-started iterates are near-orthogonal
    with very different norms, σᵢ²), which lets it run in the input dtype; it falls
    back to float64 CholeskyQR2, then to Householder QR, when Y is too ill-conditioned.
    """
    Q = _cholesky_qr2(Y)
    if Q is not None and all_finite(Q):
        return Q
    Q = _cholesky_qr2(Y.double())
    if Q is None or not all_finite(Q):
        Q, R = torch.linalg.qr(Y.double(), mode="reduced")
        Q = Q * torch.sign(torch.diagonal(R)).where(torch.diagonal(R) != 0, 1.0)
    return Q.to(Y.dtype)


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
    draws the same. Collectives: k×k and n×k all-reduces.
    """
    n = G.shape[1]
    k = min(rank + oversample, m, n)
    Y = orthonormalize_rows(G @ _gaussian(n, k, seed, G), pl)
    for _ in range(iters):
        Y = orthonormalize_rows(G @ pl.reduce(G.mT @ Y), pl)
    if k == rank:
        return Y
    B = pl.reduce(Y.mT @ G)  # k×n
    return Y @ top_eigvecs(B @ B.mT, rank, Y.dtype)


def right_basis(
    G: Tensor, m: int, rank: int, oversample: int, iters: int, seed: int, pl: Placement = LOCAL
) -> Tensor:
    """Randomized top-``rank`` basis of Gᵀ's column space (n×rank), replicated on every rank.

    G (m×n) may be row-sharded: Gᵀ·X = Σ over ranks of G_iᵀ·X_i. Ω (m×k) is seeded and
    each rank uses its own rows of it. Collectives: n×k and k×k all-reduces.
    """
    n = G.shape[1]
    k = min(rank + oversample, m, n)
    start, stop = pl.row_range(m)
    omega = _gaussian(m, k, seed, G)[start:stop]
    Y = orthonormalize(pl.reduce(G.mT @ omega))
    for _ in range(iters):
        Y = orthonormalize(pl.reduce(G.mT @ (G @ Y)))
    if k == rank:
        return Y
    C = G @ Y  # m×k (rows sharded)
    return Y @ top_eigvecs(pl.reduce(C.mT @ C), rank, Y.dtype)


def warm_left(G: Tensor, P: Tensor, iters: int, pl: Placement = LOCAL) -> Tensor:
    """Subspace iteration from an orthonormal (row-sharded) basis P: Y ← orth(G·(Gᵀ·Y))."""
    Y = P
    for _ in range(iters):
        Y = orthonormalize_rows(G @ pl.reduce(G.mT @ Y), pl)
    return Y


def warm_right(G: Tensor, Q: Tensor, iters: int, pl: Placement = LOCAL) -> Tensor:
    """Subspace iteration from an orthonormal (replicated) basis Q: Y ← orth(Gᵀ·(G·Y))."""
    Y = Q
    for _ in range(iters):
        Y = orthonormalize(pl.reduce(G.mT @ (G @ Y)))
    return Y
