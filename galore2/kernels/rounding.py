"""Roundings the Triton kernels share (imports triton: loaded with the kernel modules)."""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def to_bf16(x):
    """float32 → bfloat16 rounded to nearest, ties to even, in integer arithmetic: what a
    cast does on the GPU, and what Triton's interpreter (which truncates) does not.
    Finite values only (a NaN's payload may round to infinity)."""
    bits = x.to(tl.uint32, bitcast=True)
    bits = bits + 0x7FFF + ((bits >> 16) & 1)
    return (bits >> 16).to(tl.uint16).to(tl.bfloat16, bitcast=True)


__all__ = ["to_bf16"]
