"""The argument checks the list kernels share (:mod:`~galore2.kernels.scaled_list`,
:mod:`~galore2.kernels.residual_list`, :mod:`~galore2.kernels.lowrank_list`): each returns
why a tensor is not what the kernel takes, or None. Imports no triton."""

from __future__ import annotations

import torch
from torch import Tensor


def _got(t: object) -> str:
    return (
        f"{t.dtype} {tuple(t.shape)} on {t.device}" if isinstance(t, Tensor) else type(t).__name__
    )


def factor_problem(factor: object, k: int, m: int, n: int, device: torch.device) -> str | None:
    """A scaled gradient's factors for ``k`` m × n matrices: float32, ``(k, 1, n)`` per
    column, ``(k, m, 1)`` per row or ``(k, 1, 1)`` per matrix, on ``device``."""
    shapes = ((k, 1, n), (k, m, 1), (k, 1, 1))
    if (isinstance(factor, Tensor) and factor.dtype == torch.float32
            and factor.device == device and tuple(factor.shape) in shapes):  # fmt: skip
        return None
    return (f"factor must be a float32 tensor of shape {shapes[0]}, {shapes[1]} or "
            f"{shapes[2]} on {device}, got {_got(factor)}")  # fmt: skip


def norms_problem(out: object, dim: object, k: int, m: int, n: int,
                  device: torch.device) -> str | None:  # fmt: skip
    """Channel norms of ``k`` m × n matrices over ``dim``: 0 (one per column, ``out``
    float32 ``(k, 1, n)``) or 1 (one per row, ``(k, m, 1)``), on ``device``."""
    if dim not in (0, 1) or isinstance(dim, bool):
        return f"dim must be 0 (one norm per column) or 1 (one per row), got {dim!r}"
    shape = (k, 1, n) if dim == 0 else (k, m, 1)
    if (isinstance(out, Tensor) and out.dtype == torch.float32 and out.device == device
            and tuple(out.shape) == shape):  # fmt: skip
        return None
    return f"out must be a float32 tensor of shape {shape} on {device}, got {_got(out)}"


__all__ = ["factor_problem", "norms_problem"]
