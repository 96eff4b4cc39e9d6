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


def orthonormalize(Y: Tensor) -> Tensor:
    """An orthonormal basis of Y's columns (reduced QR)."""
    return torch.linalg.qr(Y, mode="reduced").Q


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
