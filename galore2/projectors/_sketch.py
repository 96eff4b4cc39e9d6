"""Shared numerical pieces of the randomized and power projectors."""

from __future__ import annotations

import torch
from torch import Tensor

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


def _cholesky_qr(Y: Tensor) -> Tensor | None:
    """One CholeskyQR pass in float64: Y·R⁻¹ with RᵀR = YᵀY; None if YᵀY is not PD."""
    Y64 = Y.double()
    R, info = torch.linalg.cholesky_ex(Y64.mT @ Y64, upper=True)
    if int(info) != 0:
        return None
    return torch.linalg.solve_triangular(R, Y64, upper=True, left=False)


def orthonormalize(Y: Tensor) -> Tensor:
    """An orthonormal basis of Y's columns, column order and signs kept (R has a positive diagonal).

    CholeskyQR2 (two CholeskyQR passes, Gram matrices in float64) is all BLAS-3 and
    several times faster than Householder QR for tall thin Y; it falls back to
    Householder QR when Y is too ill-conditioned for a Cholesky factorization.
    """
    Q = _cholesky_qr(Y)
    if Q is not None:
        Q = _cholesky_qr(Q)
    if Q is None or not bool(torch.isfinite(Q).all()):
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
