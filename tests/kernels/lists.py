"""Lists of same-shape matrices for the list kernels' tests (``test_scaled_list``,
``test_fira_kernels``): the entries' layouts, the factors, and fresh kernel tables."""

from __future__ import annotations

import math

import pytest
import torch

from galore2.kernels import tables

from .test_triton_kernels import DEVICE

K = 3  # entries per list

#: the (weight dtype, gradient dtype) pairs the scaled kernels are tested at
WEIGHT_AND_GRADIENT_DTYPES = pytest.mark.parametrize(
    "p_dtype,g_dtype",
    [
        (torch.float32, torch.float32),
        (torch.bfloat16, torch.bfloat16),
        (torch.float32, torch.bfloat16),
    ],
    ids=["fp32", "bf16", "fp32_bf16grad"],
)
U32 = 2.0**-24  # a float32 rounding, relative


@pytest.fixture(autouse=True)
def fresh_tables():
    tables.clear()


def gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def matrices(m: int, n: int, dtype: torch.dtype, layout: str, seed: int):
    """K random m × n matrices and the buffer they live in (None for separate tensors):
    ``stack`` — views of one stack, each inside a NaN frame (strides (n+3, 1)); ``separate_t``
    — separate tensors at unrelated addresses in a transposed layout (strides (1, m)),
    ordered by decreasing address (offsets from the first entry's are negative)."""
    g = gen(seed)
    if layout == "stack":
        buf = torch.full((K, m + 2, n + 3), math.nan, dtype=dtype, device=DEVICE)
        views = buf[:, 1 : m + 1, 2 : n + 2]
        views.copy_(torch.randn(K, m, n, generator=g))
        return list(views.unbind(0)), buf
    ts = [torch.randn(n, m, generator=g).to(DEVICE, dtype).mT for _ in range(K)]
    return sorted(ts, key=lambda t: -t.data_ptr()), None


def unchanged_frame(buf: torch.Tensor | None, m: int, n: int) -> bool:
    """The NaN frame around a stack's views is still NaN (nothing written outside them)."""
    if buf is None:
        return True
    inside = torch.zeros(buf.shape, dtype=torch.bool, device=buf.device)
    inside[:, 1 : m + 1, 2 : n + 2] = True
    return bool(buf[~inside].isnan().all())


def factors(kind: str, m: int, n: int, seed: int) -> torch.Tensor:
    """Positive float32 factors of shape (K, 1, n), (K, m, 1) or (K, 1, 1), as strided views
    (none of them contiguous)."""
    g = gen(seed)
    if kind == "column":
        return (torch.rand(n, K, generator=g) * 2).to(DEVICE).T.unsqueeze(1)
    if kind == "row":
        return (torch.rand(m, K, generator=g) * 2).to(DEVICE).T.unsqueeze(2)
    return (torch.rand(K, 3, generator=g) * 2).to(DEVICE)[:, 1:2].unsqueeze(2)
