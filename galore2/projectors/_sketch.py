"""Shared numerical pieces of the randomized and power projectors."""

from __future__ import annotations

import torch
from torch import Tensor

from .._numerics import all_finite

_GOLDEN = 0x9E3779B97F4A7C15


def mix_seed(*parts: int) -> int:
    """Combine integers into one 63-bit seed (deterministic, process-independent)."""
    h = 0x243F6A8885A308D3
    for p in parts:
        h = (
            (h ^ (int(p) & 0xFFFFFFFFFFFFFFFF)) * _GOLDEN + 0x632BE59BD9B4E019
        ) & 0xFFFFFFFFFFFFFFFF
        h ^= h >> 29
    return h & 0x7FFFFFFFFFFFFFFF


def generator_for(device: torch.device, seed: int) -> torch.Generator:
    gen = torch.Generator(device=device)
    gen.manual_seed(seed)
    return gen


def _cholesky_qr(Y: Tensor, equilibrate: bool = False) -> Tensor | None:
    """One CholeskyQR pass: Y·R⁻¹ with RᵀR = YᵀY; None if YᵀY is not numerically PD.

    ``equilibrate`` factors D⁻¹·YᵀY·D⁻¹ (D = column norms, read off the Gram diagonal)
    instead, and solves with R·D: the same Q, but Cholesky sees a well-scaled matrix.
    """
    gram = Y.mT @ Y
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


def _cholesky_qr2(Y: Tensor) -> Tensor | None:
    Q = _cholesky_qr(Y, equilibrate=True)
    return None if Q is None else _cholesky_qr(Q)


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


def subspace_iterate(A: Tensor, Y: Tensor, iters: int) -> Tensor:
    """``iters`` rounds of Y ← orth(A·(Aᵀ·Y)), starting from Y (rows×k)."""
    for _ in range(iters):
        Y = orthonormalize(A @ (A.mT @ Y))
    return Y


def rayleigh_ritz(A: Tensor, Y: Tensor, rank: int) -> Tensor:
    """The best rank-``rank`` basis of A's column space inside span(Y) (Y orthonormal).

    Uses the small k×k Gram matrix of B = YᵀA (eigendecomposition in float64),
    which is far cheaper than an SVD of the k×n matrix B for the same answer.
    """
    B = Y.mT @ A
    gram = (B @ B.mT).double()
    _, vecs = torch.linalg.eigh(gram)  # ascending
    top = vecs[:, -rank:].flip(-1).to(Y.dtype)
    return Y @ top


def randomized_range(A: Tensor, rank: int, oversample: int, power_iters: int, seed: int) -> Tensor:
    """Halko–Martinsson–Tropp randomized range finder: an orthonormal rows×rank basis.

    Ω (cols×(rank+oversample), seeded Gaussian), Y = A·Ω, ``power_iters`` rounds of
    subspace iteration with re-orthonormalization, then Rayleigh–Ritz to keep the
    top ``rank`` directions.
    """
    rows, cols = A.shape
    k = min(rank + oversample, rows, cols)
    gen = generator_for(A.device, seed)
    omega = torch.randn(cols, k, generator=gen, device=A.device, dtype=A.dtype)
    Y = orthonormalize(A @ omega)
    Y = subspace_iterate(A, Y, power_iters)
    if k == rank:
        return Y
    return rayleigh_ritz(A, Y, rank)
