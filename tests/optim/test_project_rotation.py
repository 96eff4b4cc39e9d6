"""moments_on_refresh="project": at a refresh the Adam moments are rotated into the new
basis, M ← C·M with C = P_newᵀ·P_old (right side: M ← M·Q_oldᵀ·Q_new; full: both; a Tucker
core: ×_k U_k,newᵀ·U_k,old per mode), second moments with C∘C (clamped at 0).

Each test reads the bases and moments from the optimizer state just before the refresh
step and just after it, and checks them against a float64 computation of that step:
m = β₁·rot(m_old) + (1 − β₁)·R, v = β₂·rot²(v_old) + (1 − β₂)·R², R the gradient projected
on the new basis.
"""

from __future__ import annotations

import pytest
import torch

import galore2

BETAS = (0.9, 0.999)
GAP = 3


def _snapshot(state: dict) -> dict:
    return {
        k: v.detach().double().clone() for k, v in state.items() if k.startswith(("proj.", "adam."))
    }


def _run(shape: tuple[int, ...], proj_type: str):
    """Steps 0 .. GAP on random gradients (refreshes at 0 and GAP); the state before and
    after step GAP and that step's gradient."""
    gen = torch.Generator().manual_seed(0)
    p = torch.nn.Parameter(torch.randn(shape, generator=gen))
    opt = galore2.GaLoreAdamW(
        [
            {
                "params": [p],
                "rank": 3,
                "update_proj_gap": GAP,
                "proj_type": proj_type,
                "projector": "svd",
                "moments_on_refresh": "project",
            }
        ],
        lr=1e-2,
        betas=BETAS,
    )
    for _ in range(GAP):
        p.grad = torch.randn(shape, generator=gen)
        opt.step()
    before = _snapshot(opt.state[p])
    G = torch.randn(shape, generator=gen)
    p.grad = G.clone()
    opt.step()
    assert int(opt.state[p]["galore.refreshes"]) == 2
    return before, _snapshot(opt.state[p]), G.double()


def _check(before: dict, after: dict, rot, R: torch.Tensor) -> None:
    b1, b2 = BETAS
    m = b1 * rot(before["adam.exp_avg"], False) + (1 - b1) * R
    v = b2 * rot(before["adam.exp_avg_sq"], True).clamp(min=0) + (1 - b2) * R * R
    scale_m, scale_v = m.abs().max().item(), v.abs().max().item()
    assert (after["adam.exp_avg"] - m).abs().max().item() <= 1e-5 * scale_m
    assert (after["adam.exp_avg_sq"] - v).abs().max().item() <= 1e-5 * scale_v
    # the rotation really mattered: plain kept moments would be far off
    kept = b1 * before["adam.exp_avg"] + (1 - b1) * R
    assert (after["adam.exp_avg"] - kept).abs().max().item() > 1e-2 * scale_m


@pytest.mark.parametrize("proj_type", ["left", "right", "full"])
def test_project_rotates_matrix_moments_into_the_new_basis(proj_type):
    before, after, G = _run((20, 30), proj_type)
    P_old, P_new = before.get("proj.left"), after.get("proj.left")
    Q_old, Q_new = before.get("proj.right"), after.get("proj.right")
    assert (P_new is not None) == (proj_type in ("left", "full"))
    assert (Q_new is not None) == (proj_type in ("right", "full"))
    C = None if P_new is None else P_new.T @ P_old  # r×r
    D = None if Q_new is None else Q_old.T @ Q_new  # r×r (= (Q_newᵀ·Q_old)ᵀ)
    assert not torch.allclose(
        C if C is not None else D, torch.eye(3, dtype=torch.float64), atol=0.1
    )

    def rot(M, squared):
        if C is not None:
            M = (C * C if squared else C) @ M
        if D is not None:
            M = M @ (D * D if squared else D)
        return M

    R = G
    if P_new is not None:
        R = P_new.T @ R
    if Q_new is not None:
        R = R @ Q_new
    _check(before, after, rot, R)


def _mode(x: torch.Tensor, A: torch.Tensor, k: int) -> torch.Tensor:
    """x ×_k A: mode k of x (size A.shape[1]) becomes size A.shape[0]."""
    return torch.tensordot(x, A, dims=([k], [1])).movedim(-1, k)


def test_project_rotates_a_tucker_core_per_mode():
    shape = (6, 7, 8)
    before, after, G = _run(shape, "std")
    olds = [before[f"proj.mode{k}"] for k in range(3)]
    news = [after[f"proj.mode{k}"] for k in range(3)]
    Cs = [U_new.T @ U_old for U_new, U_old in zip(news, olds, strict=True)]

    def rot(M, squared):
        for k, C in enumerate(Cs):
            M = _mode(M, C * C if squared else C, k)
        return M

    R = G
    for k, U in enumerate(news):
        R = _mode(R, U.T, k)
    _check(before, after, rot, R)
