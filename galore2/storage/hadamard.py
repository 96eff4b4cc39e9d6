"""Random Hadamard rotation of basis rows before quantization (``basis_hadamard=True``).

A basis row with a few large entries ("outliers") wastes most of a quantization
group's range on them. Rotating the row by an orthogonal H·D first — D a diagonal
of random ±1 signs, H a normalized Walsh–Hadamard matrix — spreads every entry's
energy evenly over its block, so the group's absmax, and with it the rounding
step, shrinks; the rotation is undone after dequantizing (x = D·H·y, both factors
are their own inverses).

* :func:`fwht` — the normalized fast Walsh–Hadamard transform over the last dim,
  O(n log n) (log₂ n butterfly stages), orthogonal and its own inverse. It is the
  Sylvester-ordered ``H_n`` (``H_{2k} = [[H_k, H_k], [H_k, −H_k]] / √2``).
* :func:`rotate` / :func:`unrotate` — H·D and D·H applied blockwise along the rank
  axis: full blocks of ``block`` entries (a power of two), then one shorter
  power-of-two block for the tail (see :func:`padded_length`).
  On CUDA with triton installed both are one Triton kernel
  (:mod:`galore2.kernels.hadamard`), bitwise equal to the torch path.
* :func:`random_signs` — the ±1 diagonal, a pure function of a seed: a counter-based
  integer hash evaluated on the tensor's device (no generator, no host↔device copy,
  and the same signs on CPU and CUDA, so a checkpoint moves between devices).
"""

from __future__ import annotations

from functools import partial

import torch
from torch import Tensor

from ..kernels.blocks import hadamard_blocks, is_power_of_two
from ..kernels.dispatch import run_kernel

_M31 = 0x7FFFFFFF
_MUL = 0x45D9F3B  # < 2**27: products of 31-bit values stay below 2**58 (no int64 overflow)


def next_power_of_two(n: int) -> int:
    return 1 if n <= 1 else 1 << (n - 1).bit_length()


def padded_length(r: int, block: int) -> int:
    """Entries a row of ``r`` takes once padded for blockwise rotation: ``r // block`` full
    blocks, then the remaining ``t = r % block`` entries padded with zeros to the next
    power of two (one shorter block). The overhead is under ``t`` entries per row
    (none when ``block`` divides ``r`` or ``t`` is a power of two)."""
    full = (r // block) * block
    tail = r - full
    return full + (next_power_of_two(tail) if tail else 0)


def fwht(x: Tensor) -> Tensor:
    """Normalized Walsh–Hadamard transform of the last dim (a power of two): H·x per row.

    Iterative butterflies (a, b) → (a + b, a − b), log₂ n stages, then a 1/√n
    scale, so the map is orthogonal and its own inverse.
    """
    n = x.shape[-1]
    if not is_power_of_two(n):
        raise ValueError(f"fwht needs a power-of-two last dim, got {n}")
    rows = x.numel() // n
    y = x.reshape(rows, n)
    h = 1
    while h < n:
        y = y.reshape(rows, n // (2 * h), 2, h)
        a, b = y[:, :, 0], y[:, :, 1]
        y = torch.stack((a + b, a - b), dim=2)
        h *= 2
    return y.reshape(x.shape) * (n**-0.5)


def _blockwise_fwht(x: Tensor, block: int) -> Tensor:
    rows, L = x.shape
    count, tail = hadamard_blocks(L, block)
    head = fwht(x[:, : count * block].reshape(rows, count, block)).reshape(rows, count * block)
    if not tail:
        return head
    return torch.cat((head, fwht(x[:, count * block :])), dim=1)


def _fused(x: Tensor, block: int, signs: Tensor, signs_first: bool) -> Tensor | None:
    """The Triton kernel's result where it runs (see :mod:`galore2.kernels.dispatch`)."""
    return run_kernel(
        "hadamard",
        x,
        signs,
        supported=lambda k: k.supported(x, block),
        kernel=lambda k: partial(k.blockwise_fwht, x, block, signs, signs_first=signs_first),
    )


def rotate(x: Tensor, block: int, signs: Tensor) -> Tensor:
    """H·D·x for each row of ``x`` (rows × L, L from :func:`padded_length`), blockwise."""
    fused = _fused(x, block, signs, signs_first=True)
    return fused if fused is not None else _blockwise_fwht(x * signs, block)


def unrotate(y: Tensor, block: int, signs: Tensor) -> Tensor:
    """D·H·y: the inverse of :func:`rotate`."""
    fused = _fused(y, block, signs, signs_first=False)
    return fused if fused is not None else _blockwise_fwht(y, block) * signs


def random_signs(seed: int, n: int, device: torch.device | str | None = None) -> Tensor:
    """``n`` fp32 entries ±1, a deterministic function of ``(seed, index)`` on any device.

    Each index goes through a few rounds of a 31-bit multiply–xorshift hash keyed by the
    seed (int64 arithmetic that never overflows); one bit of the result is the sign.
    """
    k1, k2 = seed & _M31, (seed >> 31) & _M31
    x = (torch.arange(n, dtype=torch.int64, device=device) + k1) & _M31
    for key in (k2, k1 ^ 0x5BD1E995, k2 ^ 0x27D4EB2F):
        x = (((x >> 16) ^ x) * _MUL) & _M31
        x = x ^ key
    x = (((x >> 16) ^ x) * _MUL) & _M31
    x = (x >> 15) ^ x
    return 1.0 - 2.0 * (x & 1).to(torch.float32)


__all__ = [
    "fwht",
    "is_power_of_two",
    "next_power_of_two",
    "padded_length",
    "random_signs",
    "rotate",
    "unrotate",
]
