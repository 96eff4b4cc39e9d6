"""Subspace-refresh benchmark: time and captured energy of one GaLore basis refresh.

``python -m benchmarks.run --tasks refresh [--repeats N]``: G 2048×5504 fp32, r=512, 5
timed repeats; ``--quick``: G 512×1376, r=128, 2 repeats (smoke test only). Runs on the
CPU with torch's default thread count (``--threads``).

Test matrix (seeded): ``G_prev`` = rank-k signal (k ≈ 1.17·r, so ≈600 at r=512)
with singular values s_i = 1/(1 + i/32), plus Gaussian noise with Frobenius
norm 3% of the signal's. ``G = G_prev + D``, where the drift D is an
independent matrix of the same kind scaled to 10% of ‖G_prev‖ — two
consecutive gradients seen at GaLore refreshes. Every method is timed on
``G``; warm power starts from the exact top-r basis of ``G_prev`` (untimed).

Methods: galore2 projectors through ``Projector.refresh`` (what the optimizer
calls: usability check + find + finiteness check) — ``svd`` (exact),
``randomized`` (oversample 8, power_iters 0/1/2), ``power`` (warm, 1 iter) —
and galore-torch 1.0's ``GaLoreProjector.get_orthogonal_matrix`` (full SVD).

Energy of a basis B (m×r, orthonormal): ‖BᵀG‖²_F / ‖G‖²_F, also reported
relative to the exact top-r value (the best any rank-r basis can do).
Targets: randomized (q=1) ≥ 8× faster than exact, warm power ≥ 30×, both
≥ 99% of the exact energy.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import Tensor

from galore2.projectors import LEFT, Plan, choose_side, get_projector

from ._common import import_galore_torch, median, render, table
from .timing import time_steps

FULL_SIZE = {"m": 2048, "n": 5504, "rank": 512, "repeats": 5}
QUICK_SIZE = {"m": 512, "n": 1376, "rank": 128, "repeats": 2}
TARGETS = {"randomized p=8 q=1": 8.0, "power (warm) q=1": 30.0}


def low_rank_plus_noise(m: int, n: int, k: int, noise: float, gen: torch.Generator) -> Tensor:
    """U·diag(s)·Vᵀ with s_i = 1/(1 + i/32), plus Gaussian noise of relative norm ``noise``."""
    U = torch.linalg.qr(torch.randn(m, k, generator=gen)).Q
    V = torch.linalg.qr(torch.randn(n, k, generator=gen)).Q
    s = 1.0 / (1.0 + torch.arange(k, dtype=torch.float32) / 32.0)
    S = (U * s) @ V.mT
    N = torch.randn(m, n, generator=gen)
    return S + N * (noise * S.norm() / N.norm())


def test_matrices(m: int, n: int, rank: int, seed: int = 0) -> tuple[Tensor, Tensor]:
    """(G_prev, G): a low-rank-plus-noise gradient and the next one after a 10% drift."""
    gen = torch.Generator().manual_seed(seed)
    k = min(round(rank * 600 / 512), m, n)
    G_prev = low_rank_plus_noise(m, n, k, 0.03, gen)
    D = low_rank_plus_noise(m, n, k, 0.03, gen)
    return G_prev, G_prev + D * (0.1 * G_prev.norm() / D.norm())


def energy(B: Tensor, G: Tensor, side: int) -> float:
    """Fraction of ‖G‖²_F captured by the basis B on ``side``."""
    R = B.mT @ G if side == LEFT else G @ B
    return float(R.square().sum() / G.square().sum())


def methods(G: Tensor, G_prev: Tensor, plan: Plan) -> dict[str, Callable[[], Tensor]]:
    """Each method as a zero-argument callable returning the new basis."""
    key = "left" if plan.side == LEFT else "right"

    def ours(name: str, state: dict[str, Tensor], **group: int) -> Callable[[], Tensor]:
        projector = get_projector(name)
        return lambda: projector.refresh(G, state, plan, group, 1234)[key]

    exact = get_projector("svd")
    prev_basis = exact.refresh(G_prev, {}, plan, {}, 0)[key]
    warm_state = {"proj." + key: prev_basis.clone(), "galore.refreshes": torch.tensor(1)}

    galore_torch = import_galore_torch()
    gt = galore_torch.galore_projector.GaLoreProjector(plan.rank, proj_type="std")
    gt_type = "left" if plan.side == LEFT else "right"

    def reference() -> Tensor:
        B = gt.get_orthogonal_matrix(G, plan.rank, gt_type)
        return B if plan.side == LEFT else B.mT  # galore-torch returns Qᵀ (r×n) for "right"

    return {
        "exact SVD (galore2 svd)": ours("svd", {}),
        "galore-torch 1.0 get_orthogonal_matrix": reference,
        "randomized p=8 q=0": ours("randomized", {}, oversample=8, power_iters=0),
        "randomized p=8 q=1": ours("randomized", {}, oversample=8, power_iters=1),
        "randomized p=8 q=2": ours("randomized", {}, oversample=8, power_iters=2),
        "power (warm) q=1": ours("power", warm_state, oversample=8, power_iters=1),
    }


def refresh(quick: bool, repeats: int | None = None) -> str:
    size = QUICK_SIZE if quick else FULL_SIZE
    m, n, rank = size["m"], size["n"], size["rank"]
    repeats = repeats or size["repeats"]
    G_prev, G = test_matrices(m, n, rank)
    plan = Plan(choose_side((m, n), "std", rank), m, n, rank, G.device)
    fns = methods(G, G_prev, plan)
    # interleaved, one call per round, so transient background load hits every method alike
    times = time_steps({name: (lambda fn=fn: fn) for name, fn in fns.items()}, repeats, 1, 1)
    results = {name: (median(times[name]), energy(fn(), G, plan.side)) for name, fn in fns.items()}
    exact_s, exact_e = results["exact SVD (galore2 svd)"]
    rows = []
    for name, (seconds, e) in results.items():
        speedup, rel = exact_s / seconds, e / exact_e
        target = TARGETS.get(name)
        verdict = ""
        if target is not None:
            ok = speedup >= target and rel >= 0.99
            verdict = f"≥{target:g}×, ≥99%: " + (
                "n/a (quick)" if quick else "pass" if ok else "FAIL"
            )
        rows.append(
            [name, f"{seconds:.4f}", f"{speedup:.1f}×", f"{e:.5f}", f"{100 * rel:.2f}%", verdict]
        )
    headers = ["method", "median s", "speedup vs exact", "energy", "vs exact top-r", "target"]
    side = "left" if plan.side == LEFT else "right"
    return render("refresh", m=m, n=n, rank=rank, side=side, repeats=repeats,
                  threads=torch.get_num_threads(), table=table(headers, rows))  # fmt: skip
