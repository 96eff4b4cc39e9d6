"""GaLoreAdafactor's step vs galore-torch's, per weight shape, and the column statistic.

Usage (repository root, venv active)::

    python -m benchmarks.adafactor_step

Prints (nothing is written): the median of 7 timed calls, after 2 untimed ones, of
(a) the Adafactor column statistic Σᵢ u²ᵢⱼ as ``torch.norm(u, dim=-2)`` (torch.optim.
Adafactor's op) and as galore2's row-blocked ``_col_sq``; (b) one optimizer step of
galore2's GaLoreAdafactor and galore-torch's GaLoreAdafactor (both with an explicit lr:
``relative_step=False, scale_parameter=False``) on a single weight: a 32000×1024
embedding (full rank) and 1024×2736 / 2736×1024 matrices at r = 256 (non-refresh steps).
"""

from __future__ import annotations

import warnings

import torch

import galore2
from galore2.optim.adafactor import _col_sq

from ._common import import_galore_torch, machine_md, median, table, time_call

SHAPES = (((32000, 1024), None), ((1024, 2736), 256), ((2736, 1024), 256))


def _step_ms(make, shape: tuple[int, int], rank: int | None) -> float:
    torch.manual_seed(0)
    p = torch.nn.Parameter(torch.randn(*shape) * 0.02)
    group: dict = {"params": [p]}
    if rank:
        group.update(rank=rank, update_proj_gap=10**9, scale=0.25, proj_type="std")
    opt = make([group])
    p.grad = torch.randn_like(p)
    return 1e3 * median(time_call(opt.step, repeats=7, warmup=2))


def main() -> None:
    gt = import_galore_torch()
    warnings.simplefilter("ignore")
    u = torch.randn(32000, 1024)
    norm_ms = 1e3 * median(time_call(lambda: torch.norm(u, dim=-2, keepdim=True), 7, 2))
    blocked_ms = 1e3 * median(time_call(lambda: _col_sq(u), 7, 2))
    ours = lambda g: galore2.GaLoreAdafactor(  # noqa: E731
        g, lr=1e-2, relative_step=False, scale_parameter=False
    )
    theirs = lambda g: gt.GaLoreAdafactor(  # noqa: E731
        g, lr=1e-2, relative_step=False, scale_parameter=False, warmup_init=False
    )
    rows = []
    for shape, rank in SHAPES:
        a, b = _step_ms(ours, shape, rank), _step_ms(theirs, shape, rank)
        rows.append(
            [f"{shape[0]}×{shape[1]}", rank or "full", f"{a:.1f}", f"{b:.1f}", f"{a / b:.2f}"]
        )
    print(machine_md())
    print(f"\ncolumn statistic, 32000×1024: torch.norm(dim=-2) {norm_ms:.1f} ms, "
          f"_col_sq {blocked_ms:.1f} ms ({norm_ms / blocked_ms:.1f}×)\n")  # fmt: skip
    print(table(["weight", "rank", "galore2 ms", "galore-torch ms", "ratio"], rows))


if __name__ == "__main__":
    main()
