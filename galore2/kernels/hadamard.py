"""Blockwise normalized Walsh–Hadamard transform with the random-sign diagonal (Triton).

Computes :func:`galore2.storage.hadamard.rotate` (``H·D·x``) and ``unrotate``
(``D·H·y``) for fp32 ``rows × L`` inputs: each row is cut into ``L // block`` blocks of
``block`` entries (a power of two) and one shorter power-of-two tail block, and each
block is multiplied by the Sylvester-ordered ``H_n / √n`` (n its length), with the ±1
``signs`` (length L) applied before (rotate) or after (unrotate).

The transform runs in registers as log₂ n identical "constant-geometry" stages: pair
entries (2j, 2j+1) → (a + b at j, a − b at n/2 + j). Stage s combines the pairs the
torch path's stage s combines (entries differing in bit s of their original index),
with the same operands in the same order — only where partial sums are kept differs —
so the result is bitwise equal to the torch path's (the final ×1/√n and ±1 products are
single roundings in both).

Memory traffic: the input read once, the output written once (4 + 4 bytes per entry),
the signs once per program (L2-resident). The torch path materializes the signed
copy, one tensor per butterfly stage and the scaled result (~2·(log₂ n + 2) passes).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from .blocks import hadamard_blocks  # the block / padding checks the torch path uses too
from .dispatch import launch_device

MAX_BLOCK = 8192  # larger blocks would not fit a program's registers


@triton.jit
def _fwht_kernel(
    x_ptr,
    signs_ptr,
    out_ptr,
    rows,
    col0,
    s_xr,
    s_xc,
    s_or,
    scale,
    SIGNS_FIRST: tl.constexpr,
    N: tl.constexpr,
    LOG2N: tl.constexpr,
    ROWS: tl.constexpr,
):
    # One program: ROWS rows × one block of N columns starting at col0 + pid_b·N.
    r = (tl.program_id(0) * ROWS + tl.arange(0, ROWS)).to(tl.int64)
    c = col0 + tl.program_id(1) * N + tl.arange(0, N)
    mask = (r < rows)[:, None]
    x = tl.load(x_ptr + r[:, None] * s_xr + c[None, :] * s_xc, mask=mask, other=0.0)
    signs = tl.load(signs_ptr + c)
    if SIGNS_FIRST:
        x = x * signs[None, :]
    for _ in tl.static_range(LOG2N):
        a, b = tl.split(tl.reshape(x, (ROWS, N // 2, 2)))
        x = tl.reshape(tl.permute(tl.join(a + b, a - b), (0, 2, 1)), (ROWS, N))
    x = x * scale
    if not SIGNS_FIRST:
        x = x * signs[None, :]
    tl.store(out_ptr + r[:, None] * s_or + c[None, :], x, mask=mask)


def _launch(x: Tensor, signs: Tensor, out: Tensor, col0: int, n: int, count: int, first: bool):
    rows = x.shape[0]
    tile = max(1, min(4096 // n, triton.next_power_of_2(rows)))
    grid = (triton.cdiv(rows, tile), count)
    _fwht_kernel[grid](
        x,
        signs,
        out,
        rows,
        col0,
        x.stride(0),
        x.stride(1),
        out.stride(0),
        n**-0.5,
        SIGNS_FIRST=first,
        N=n,
        LOG2N=n.bit_length() - 1,
        ROWS=tile,
        num_warps=4 if tile * n <= 2048 else 8,
        # explicit (Triton 3.10 changes the default); it cannot change the result: the only
        # products are by ±1 (exact) and the final 1/√n scale
        enable_fp_fusion=True,
    )


def blockwise_fwht(
    x: Tensor, block: int, signs: Tensor, *, signs_first: bool, out: Tensor | None = None
) -> Tensor:
    """``rotate`` (``signs_first=True``: H·D·x) or ``unrotate`` (D·H·x) of fp32 ``x``
    (rows × L, L padded as :func:`~galore2.storage.hadamard.padded_length` pads),
    blockwise; written to ``out`` (a new contiguous tensor when None) and returned.
    Runs on CUDA tensors, or on CPU tensors under ``TRITON_INTERPRET=1``."""
    if x.dim() != 2 or x.dtype != torch.float32:
        raise ValueError(f"x must be a 2-D fp32 tensor, got {x.dtype} {tuple(x.shape)}")
    rows, length = x.shape
    count, tail = hadamard_blocks(length, block)
    if block > MAX_BLOCK and count:
        raise ValueError(f"Hadamard blocks above {MAX_BLOCK} are not supported, got {block}")
    signs = signs.to(torch.float32).contiguous()
    if signs.shape != (length,):
        raise ValueError(f"signs must have {length} entries, got {tuple(signs.shape)}")
    if out is None:
        out = torch.empty((rows, length), dtype=torch.float32, device=x.device)
    if out.shape != x.shape or out.dtype != torch.float32 or out.stride(1) != 1:
        raise ValueError("out must be an fp32 tensor of x's shape with unit column stride")
    if rows == 0:
        return out
    with launch_device(x):
        if count:
            _launch(x, signs, out, 0, block, count, signs_first)
        if tail:
            _launch(x, signs, out, count * block, tail, 1, signs_first)
    return out


def supported(x: Tensor, block: int) -> bool:
    """Inputs the kernel takes: 2-D fp32 rows with blocks of at most MAX_BLOCK."""
    return x.dim() == 2 and x.dtype == torch.float32 and block <= MAX_BLOCK


__all__ = ["MAX_BLOCK", "blockwise_fwht", "supported"]
