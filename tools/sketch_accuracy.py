"""How accurate the randomized and power bases are, over many seeds.

    python -m tools.sketch_accuracy [--seeds 200]
    cd /tmp && PYTHONPATH=<other checkout> python <this checkout>/tools/sketch_accuracy.py

Runs against whichever galore2 is imported (``-m`` from a checkout's root: that checkout's;
the second form, from a directory without one: ``PYTHONPATH``'s), so the same script
measures two checkouts. Cases:

- ``10x9 r8 <proj_type>``: an exactly rank-8 gradient G = A·B (A 10×8, B 8×9 Gaussian) stepped
  once by ``GaLoreAdamW(rank=8)``, as ``tests/core/test_properties.py`` does; with the default
  oversample 8 the sketch has k = min(r + 8, m, n) = 9 columns and is rank-deficient (rank 8),
  its Gram matrix singular to rounding. ``power`` also takes a warm refresh on a second
  independent rank-8 gradient (``warm``).
- ``120x300 6dec os0 q1/q2`` (and 300×120): a rank-16 gradient with singular values over
  6 decades, oversample 0, one or two power iterations (G·GᵀY has κ ≈ 1e12 in exact
  arithmetic), 20 seeds; ``power warm`` adds a warm refresh on a drifted gradient, as
  ``tests/projectors/test_projectors.py`` does — that gradient has rank 32, so its "recon"
  is the residual's excess over the exact top-16 basis's.

Reports max and median over seeds of the relative reconstruction error ‖Π(G) − G‖/‖G‖
(float64, Π the projection onto the basis) and of the orthonormality error max|BᵀB − I|.
"""

from __future__ import annotations

import argparse
import statistics
import warnings

import torch

import galore2
from galore2.projectors import LEFT, RIGHT, Plan, get_projector


def orth_err(B: torch.Tensor) -> float:
    B = B.double()
    return (B.mT @ B - torch.eye(B.shape[1], dtype=torch.float64)).abs().max().item()


def recon_err(G: torch.Tensor, P: torch.Tensor | None, Q: torch.Tensor | None) -> float:
    G64, R = G.double(), G.double()
    if P is not None:
        R = P.double() @ (P.double().mT @ R)
    if Q is not None:
        R = (R @ Q.double()) @ Q.double().mT
    return (torch.linalg.norm(R - G64) / torch.linalg.norm(G64)).item()


def bases(opt, p, rank: int, projector: str):
    state = opt.state[p]
    plan = Plan(int(state["galore.side"]), p.shape[0], p[0].numel(), rank, p.device)
    return get_projector(projector).bases(state, plan)


def rank_r(m: int, n: int, r: int, gen: torch.Generator) -> torch.Tensor:
    return torch.randn(m, r, generator=gen) @ torch.randn(r, n, generator=gen)


def small_case(projector: str, arg: tuple[str, bool], seed: int) -> tuple[float, float]:
    (proj_type, warm), (m, n, r) = arg, (10, 9, 8)
    gen = torch.Generator().manual_seed(seed)
    p = torch.nn.Parameter(torch.zeros(m, n))
    opt = galore2.GaLoreAdamW(
        [p], rank=r, proj_type=proj_type, projector=projector, update_proj_gap=1, seed=seed
    )
    for _ in range(2 if warm else 1):
        G = rank_r(m, n, r, gen)
        p.grad = G
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            opt.step()
    P, Q = bases(opt, p, r, projector)
    return recon_err(G, P, Q), max(orth_err(B) for B in (P, Q) if B is not None)


def spectrum_matrix(m: int, n: int, s: torch.Tensor, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    k = len(s)
    U = torch.linalg.qr(torch.randn(m, k, generator=g, dtype=torch.float64)).Q
    V = torch.linalg.qr(torch.randn(n, k, generator=g, dtype=torch.float64)).Q
    return ((U * s.double()) @ V.T).float()


def ill_case(projector: str, arg: tuple[int, int, bool], seed: int) -> tuple[float, float]:
    side, iters, warm = arg
    m, n, r = (120, 300, 16) if side == LEFT else (300, 120, 16)
    G = spectrum_matrix(m, n, torch.logspace(0, -6, r), seed)
    plan = Plan(side, m, n, r, torch.device("cpu"))
    state = {"galore.refreshes": torch.tensor(0)}
    key = "left" if side == LEFT else "right"
    settings = {"oversample": 0, "power_iters": iters}
    proj = get_projector(projector)
    B = proj.refresh(G, state, plan, settings, seed=seed)[key]
    if warm:  # a warm refresh on a drifted gradient (tests/projectors/test_projectors.py)
        state["proj." + key], state["galore.refreshes"] = B, torch.tensor(1)
        G = G + 0.01 * spectrum_matrix(m, n, torch.logspace(0, -6, r), seed + 50)
        B = proj.refresh(G, state, plan, settings, seed=seed + 1)[key]
    P, Q = (B, None) if side == LEFT else (None, B)
    if not warm:
        return recon_err(G, P, Q), orth_err(B)
    # G has rank 32 now: report the residual's excess over the exact top-16 basis's
    U, _, Vh = torch.linalg.svd(G.double(), full_matrices=False)
    best = recon_err(G, U[:, :r], None) if side == LEFT else recon_err(G, None, Vh[:r].mT)
    return recon_err(G, P, Q) - best, orth_err(B)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seeds", type=int, default=200)
    args = ap.parse_args()
    torch.manual_seed(0)
    cases = []
    for proj_type in ("std", "left", "full"):
        for projector in ("svd", "randomized", "power"):
            label = f"10x9 r8 {proj_type:<4} {projector}"
            cases.append((label, small_case, projector, (proj_type, False)))
        cases.append((f"10x9 r8 {proj_type:<4} power warm", small_case, "power", (proj_type, True)))
    for side, name in ((LEFT, "left"), (RIGHT, "right")):
        for iters in (1, 2):
            label = f"120x300 6dec os0 q{iters} {name:<5}"
            cases.append((f"{label} randomized", ill_case, "randomized", (side, iters, False)))
            cases.append((f"{label} power warm", ill_case, "power", (side, iters, True)))
    print(f"galore2 from {galore2.__file__}; {args.seeds} seeds; torch {torch.__version__}")
    print(f"{'case':<42} {'recon max':>10} {'recon med':>10} {'orth max':>10} {'orth med':>10}")
    for label, fn, projector, arg in cases:
        seeds = range(args.seeds if fn is small_case else min(args.seeds, 20))
        rs, os_ = zip(*(fn(projector, arg, s) for s in seeds), strict=True)
        print(
            f"{label:<42} {max(rs):10.2e} {statistics.median(rs):10.2e} "
            f"{max(os_):10.2e} {statistics.median(os_):10.2e}"
        )


if __name__ == "__main__":
    main()
