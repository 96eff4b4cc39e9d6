"""Small numerical helpers shared by optimizers and projectors."""

from __future__ import annotations

import math

import torch
from torch import Tensor

_F64 = torch.float64


def all_finite(t: Tensor) -> bool:
    """True when every entry of ``t`` is finite.

    A sum is NaN/Inf whenever some entry is, and is an order of magnitude cheaper
    than ``torch.isfinite(t).all()`` on CPU; only a non-finite sum (an overflow of
    huge finite values, or a real NaN/Inf) pays for the exact elementwise check.
    """
    if t.numel() == 0:
        return True
    if math.isfinite(float(t.sum(dtype=torch.float64 if t.dtype == torch.float64 else None))):
        return True
    return bool(torch.isfinite(t).all())


def norms_within(
    tensors: list[Tensor], bound: float, dtype: torch.dtype, batched: bool = False
) -> Tensor:
    """Per tensor: is its L2 norm, computed in ``dtype`` (float64 tensors: in float64), at
    most ``bound``? A bool tensor on the tensors' device — no host read.

    False for a NaN or Inf entry and for a sum of squares that overflows ``dtype`` (the
    norm is a plain sum of squares, not rescaled: on the CPU and in the CUDA
    ``_foreach_norm`` kernel alike). ``batched``: one ``_foreach_norm`` (one fused kernel on
    accelerators); otherwise one reduction per tensor (CPU foreach kernels are a slower
    loop). Either way the flags come back as one tensor, for one read (:func:`host_list`).
    """
    wide = _F64 if any(t.dtype == _F64 for t in tensors) else dtype  # never narrowing
    if batched:
        norms = torch._foreach_norm(tensors, 2, dtype=wide)
    else:
        norms = [
            torch.linalg.vector_norm(t, dtype=None if t.dtype in (dtype, _F64) else dtype)
            for t in tensors
        ]
    if not batched:  # _foreach_norm's results are in ``wide`` already
        norms = [n.to(wide) for n in norms]
    return torch.stack(norms) <= bound  # NaN compares False


_CONSTANTS: dict[tuple, Tensor] = {}


def constants(values: tuple[float, ...], dtype: torch.dtype, device: torch.device) -> Tensor:
    """A 1-D tensor of ``values`` on ``device``, made once per process and reused: the
    per-matrix constants of a batched step (sizes, lr adjustments), so no step after the
    first copies host data to the device (a CUDA graph can capture it)."""
    key = (values, dtype, str(device))
    out = _CONSTANTS.get(key)
    if out is None:
        if len(_CONSTANTS) >= 256:  # bounded: layouts change rarely
            _CONSTANTS.clear()
        out = _CONSTANTS[key] = torch.tensor(values, dtype=dtype).to(device)
    return out


def host_list(t: Tensor) -> list:
    """``t``'s values on the host: the one device→host read of an optimizer step.

    Every read the step makes of a value computed on the device goes through here (a
    single transfer however long ``t`` is), so ``benchmarks.step_counts`` and the tests count
    them by wrapping this function (``tolist`` dispatches no op a dispatch mode could see)."""
    return t.tolist()


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
    """A generator for ``device`` seeded with ``seed``; on the meta device (which has none)
    a CPU one: meta ops take it and draw nothing, so a step runs through on meta tensors
    (shape-only dry runs: ``benchmarks.roofline``)."""
    device = torch.device(device)
    gen = torch.Generator(device="cpu" if device.type == "meta" else device)
    gen.manual_seed(seed)
    return gen
