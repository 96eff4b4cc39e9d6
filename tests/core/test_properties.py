"""Property tests of GaLoreAdamW over shapes, dtypes, projection types and projectors.

For random shapes (wide, tall, square; rank from 1 to above min(m, n)), both
fp32 and bf16 parameters, every ``proj_type``, ``projector`` and
``moments_on_refresh``, a few steps with random gradients must:

(a) keep the parameter finite and change it;
(b) create exactly the documented state at the documented shapes;
(c) keep non-random bases orthonormal (to fp32 accuracy: see ``FP32``);
(d) move the parameter only inside the projected subspace (and, on the first
    step, by exactly −lr·α·back(R / (|R| + eps)) computed in float64);
(e) choose the side by the documented rule.
"""

from __future__ import annotations

import ast
import math
import os
import warnings
from pathlib import Path

import torch
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

import galore2
from galore2.projectors import Plan, get_projector

from ..helpers import assert_f32_close

NONE, LEFT, RIGHT, FULL = 0, 1, 2, 3
PROJ_TYPES = ["std", "reverse_std", "left", "right", "full"]
PROJECTORS = ["svd", "randomized", "power", "random"]
# eps large enough that R / (|R| + eps) is well conditioned for the float64 comparison
LR, SCALE, EPS = 1e-2, 0.25, 0.1
# What fp32 allows a basis B (d×r) found by a backward-stable method: ‖BᵀB − I‖_F and the
# relative error of projecting a rank-r gradient onto it are c·sqrt(d·r)·u and c·sqrt(d)·u
# (d-term inner products in unit roundoff u = 2⁻²⁴, errors adding like a random walk), c a
# small constant. Over 5,000 random cases of these strategies c ≤ 9.3 (exact SVD) and
# ≤ 5.3 (randomized, power); c = 24 leaves room for other BLAS builds. CholeskyQR2 without
# a fallback reached c ≈ 1300 on rank-deficient sketches (tools/sketch_accuracy.py).
FP32 = 24 * 2.0**-24


def budget(n: int) -> settings:
    """``n`` examples. Unless ``HYPOTHESIS_RANDOM`` is set (to explore new examples
    locally), derandomized with no example database: the same examples on every run and
    machine, CI included, none replayed from an earlier run's failures."""
    explore = bool(os.environ.get("HYPOTHESIS_RANDOM"))
    return settings(
        max_examples=n,
        deadline=None,
        derandomize=not explore,
        **({} if explore else {"database": None}),
        suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
    )


def test_property_tests_are_derandomized_without_a_database(monkeypatch):
    """CI (no HYPOTHESIS_RANDOM) gets the derandomized profile, and every ``@given`` test
    under tests/ takes its settings from :func:`budget`."""
    monkeypatch.delenv("HYPOTHESIS_RANDOM", raising=False)
    ci = budget(3)
    assert ci.derandomize is True and ci.database is None
    monkeypatch.setenv("HYPOTHESIS_RANDOM", "1")
    assert budget(3).derandomize is False

    def name(node: ast.expr) -> str:
        node = node.func if isinstance(node, ast.Call) else node
        return node.attr if isinstance(node, ast.Attribute) else getattr(node, "id", "")

    tests_dir = Path(__file__).resolve().parents[1]
    given_tests = []
    for path in sorted(tests_dir.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
                decorators = [name(d) for d in node.decorator_list]
                if "given" in decorators:
                    given_tests.append(node.name)
                    assert "budget" in decorators, f"{path}:{node.lineno} {node.name}"
    assert len(given_tests) >= 3, given_tests


def expected_side(m: int, n: int, rank: int, proj_type: str) -> int:
    if rank >= min(m, n):
        return NONE
    if proj_type == "std":
        return RIGHT if m >= n else LEFT
    if proj_type == "reverse_std":
        return LEFT if m >= n else RIGHT
    return {"left": LEFT, "right": RIGHT, "full": FULL}[proj_type]


@st.composite
def shape_and_rank(draw: st.DrawFn) -> tuple[int, int, int]:
    """(m, n, r): wide, tall or square; r anywhere in [1, min + 2], often min − 1 or min."""
    kind = draw(st.sampled_from(["wide", "tall", "square"]))
    small = draw(st.integers(2, 12))
    big = small if kind == "square" else draw(st.integers(small + 1, 20))
    m, n = (small, big) if kind == "wide" else (big, small)
    k = min(m, n)
    rank = draw(st.one_of(st.just(k - 1), st.just(k), st.integers(1, k + 2)))
    return m, n, rank


def dense_bases(opt: galore2.GaLoreAdamW, p: torch.Tensor, rank: int, projector: str):
    """The (P, Q) the optimizer is using for ``p`` (regenerated for the random projector)."""
    state = opt.state[p]
    side = int(state["galore.side"])
    plan = Plan(side, p.shape[0], p[0].numel(), rank, p.device)
    return get_projector(projector).bases(state, plan)


def col_space(B: torch.Tensor) -> torch.Tensor:
    """Orthonormal basis (float64) of B's column space."""
    return torch.linalg.qr(B.double(), mode="reduced").Q


def back(N: torch.Tensor, P: torch.Tensor | None, Q: torch.Tensor | None) -> torch.Tensor:
    if P is not None:
        N = P @ N
    if Q is not None:
        N = N @ Q.mT
    return N


def project(G: torch.Tensor, P: torch.Tensor | None, Q: torch.Tensor | None) -> torch.Tensor:
    if P is not None:
        G = P.mT @ G
    if Q is not None:
        G = G @ Q
    return G


def out_of_subspace(delta: torch.Tensor, P: torch.Tensor | None, Q: torch.Tensor | None):
    """‖ΔW − Π(ΔW)‖ where Π projects onto {P·X·Qᵀ} (float64)."""
    inside = delta
    if P is not None:
        U = col_space(P)
        inside = U @ (U.mT @ inside)
    if Q is not None:
        V = col_space(Q)
        inside = (inside @ V) @ V.mT
    return float(torch.linalg.norm(delta - inside))


@budget(150)
@given(
    case=shape_and_rank(),
    dtype=st.sampled_from([torch.float32, torch.bfloat16]),
    proj_type=st.sampled_from(PROJ_TYPES),
    projector=st.sampled_from(PROJECTORS),
    moments=st.sampled_from(["keep", "reset", "project"]),
    gap=st.integers(1, 3),
    steps=st.integers(2, 5),
    seed=st.integers(0, 2**20),
)
def test_projected_steps(case, dtype, proj_type, projector, moments, gap, steps, seed):
    m, n, rank = case
    gen = torch.Generator().manual_seed(seed)
    fp32 = dtype == torch.float32
    # bf16 starts at zero so the first update is not lost in the rounding of the weights.
    init = 0.1 * torch.randn(m, n, generator=gen) if fp32 else torch.zeros(m, n)
    p = torch.nn.Parameter(init.to(dtype))
    start = p.detach().clone()
    opt = galore2.GaLoreAdamW(
        [p],
        lr=LR,
        eps=EPS,
        weight_decay=0.0,
        rank=rank,
        update_proj_gap=gap,
        scale=SCALE,
        proj_type=proj_type,
        projector=projector,
        moments_on_refresh=moments,
        seed=seed,
    )
    side = expected_side(m, n, rank, proj_type)
    if side == NONE:
        ref = torch.nn.Parameter(p.detach().clone())
        ref_opt = torch.optim.AdamW([ref], lr=LR, eps=EPS, weight_decay=0.0)

    for step in range(steps):
        grad = torch.randn(m, n, generator=gen).to(dtype)
        p.grad = grad
        before = p.detach().double().clone()
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # rank >= min(m, n) warns (tested elsewhere)
            opt.step()
        delta = p.detach().double() - before
        state = opt.state[p]

        # (a) finite
        assert torch.isfinite(p).all()
        # (e) side rule
        assert int(state["galore.side"]) == side

        if side == NONE:
            # (b) full-shape moments, no basis, no GaLore counters
            assert not any(k.startswith("proj.") for k in state)
            assert "galore.step" not in state
            for key in ("adam.exp_avg", "adam.exp_avg_sq"):
                assert state[key].shape == (m, n) and state[key].dtype == torch.float32
            if fp32:  # plain AdamW, to rounding
                ref.grad = grad.clone()
                ref_opt.step()
                assert_f32_close(p.detach(), ref.detach(), steps=step + 1)
            continue

        # (b) documented state shapes
        low = {LEFT: (rank, n), RIGHT: (m, rank), FULL: (rank, rank)}[side]
        for key in ("adam.exp_avg", "adam.exp_avg_sq"):
            assert state[key].shape == low and state[key].dtype == torch.float32
        refreshes = (step + 1 + gap - 1) // gap  # at steps 0, T, 2T, ...
        assert int(state["galore.step"]) == step + 1
        assert int(state["galore.refreshes"]) == refreshes
        assert int(state["galore.next_refresh"]) == refreshes * gap
        bytes_ = opt.state_bytes()
        assert bytes_["moments"] == 2 * 4 * low[0] * low[1]
        if projector == "random":
            assert "proj.left" not in state and "proj.right" not in state
            assert bytes_["basis"] == 8  # one int64 seed
        else:
            assert ("proj.left" in state) == (side in (LEFT, FULL))
            assert ("proj.right" in state) == (side in (RIGHT, FULL))
            if side in (LEFT, FULL):
                assert state["proj.left"].shape == (m, rank)
            if side in (RIGHT, FULL):
                assert state["proj.right"].shape == (n, rank)
            assert bytes_["basis"] == 4 * rank * (m * (side != RIGHT) + n * (side != LEFT))

        P, Q = dense_bases(opt, p, rank, projector)
        assert (P is not None) == (side in (LEFT, FULL))
        assert (Q is not None) == (side in (RIGHT, FULL))
        # (c) orthonormal bases, to what fp32 allows
        if projector != "random":
            for B in (P, Q):
                if B is not None:
                    eye = torch.eye(rank, dtype=torch.float64)
                    bound = FP32 * math.sqrt(B.shape[0] * rank)
                    assert torch.linalg.norm(B.double().mT @ B.double() - eye) <= bound

        # (d) the update lies in span(P)·X·span(Q)ᵀ
        # slack for rounding the weights to fp32 (a few ulps of ‖W‖) on top of a relative bound
        size = float(torch.linalg.norm(delta))
        slack = 2.0**-20 * float(torch.linalg.norm(p.detach().double())) if fp32 else 0.0
        if fp32 or step == 0:
            assert out_of_subspace(delta, P, Q) <= (1e-4 if fp32 else 3e-2) * size + slack
        if fp32 and step == 0:
            # first Adam step: m̂ = R, v̂ = R², so ΔW = −lr·α·back(R / (|R| + eps)).
            P64 = None if P is None else P.double()
            Q64 = None if Q is None else Q.double()
            R = project(grad.double(), P64, Q64)
            want = -LR * SCALE * back(R / (R.abs() + EPS), P64, Q64)
            assert torch.linalg.norm(delta - want) <= 1e-4 * torch.linalg.norm(want) + slack

    # (a) the parameter moved
    assert not torch.equal(p.detach(), start)


@budget(80)
@given(
    dims=st.lists(st.integers(1, 9), min_size=2, max_size=4),
    rank=st.integers(1, 12),
    proj_type=st.sampled_from(PROJ_TYPES),
    projector=st.sampled_from(PROJECTORS),
)
def test_side_rule_and_init_state(dims, rank, proj_type, projector):
    """(e) side from the 2-D view (m = shape[0], n = prod(rest)); init_state == first step.
    (``tensor_projection="matrix"``: >2-D weights flattened; Tucker has tests/test_tucker.py.)"""
    p = torch.nn.Parameter(torch.zeros(dims))
    m, n = dims[0], p[0].numel()
    settings = {"rank": rank, "proj_type": proj_type, "projector": projector,
                "tensor_projection": "matrix"}  # fmt: skip
    opt = galore2.GaLoreAdamW([p], **settings)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        opt.init_state()
    state = opt.state[p]
    side = expected_side(m, n, rank, proj_type)
    assert int(state["galore.side"]) == side
    if proj_type == "std" and side != NONE:
        assert (side == RIGHT) == (m >= n)
    if proj_type == "reverse_std" and side != NONE:
        assert (side == LEFT) == (m >= n)
    low = {NONE: tuple(dims), LEFT: (rank, n), RIGHT: (m, rank), FULL: (rank, rank)}[side]
    assert tuple(state["adam.exp_avg"].shape) == low
    assert tuple(state["adam.exp_avg_sq"].shape) == low

    # The first step creates the same keys at the same shapes (init_state is not a fork).
    q = torch.nn.Parameter(torch.zeros(dims))
    opt2 = galore2.GaLoreAdamW([q], **settings)
    q.grad = torch.ones_like(q)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        opt2.step()
    assert set(opt2.state[q]) == set(state)
    for key, value in state.items():
        assert opt2.state[q][key].shape == value.shape, key
        assert opt2.state[q][key].dtype == value.dtype, key


@budget(80)
@given(
    case=shape_and_rank(),
    proj_type=st.sampled_from(PROJ_TYPES),
    projector=st.sampled_from(["svd", "randomized", "power"]),
    seed=st.integers(0, 2**20),
)
# rank-deficient sketches (k = min(r + 8, m, n) > r): 2.0e-4 and 1.3e-4 with CholeskyQR2 alone
@example(case=(10, 9, 8), proj_type="std", projector="randomized", seed=80)
@example(case=(10, 9, 8), proj_type="left", projector="power", seed=140)
def test_low_rank_gradient_basis_spans_it(case, proj_type, projector, seed):
    """A gradient of rank r is captured exactly, to what fp32 allows: R = proj(G) and
    back(R) = G with ‖back(R) − G‖ ≤ c·sqrt(max(m, n))·u·‖G‖ (``FP32``)."""
    m, n, rank = case
    side = expected_side(m, n, rank, proj_type)
    gen = torch.Generator().manual_seed(seed)
    G = torch.randn(m, rank, generator=gen) @ torch.randn(rank, n, generator=gen)
    p = torch.nn.Parameter(torch.zeros(m, n))
    opt = galore2.GaLoreAdamW([p], rank=rank, proj_type=proj_type, projector=projector)
    p.grad = G
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        opt.step()
    if side == NONE:
        assert int(opt.state[p]["galore.side"]) == NONE and "proj.left" not in opt.state[p]
        return
    P, Q = dense_bases(opt, p, rank, projector)
    G64 = G.double()
    P64 = None if P is None else P.double()
    Q64 = None if Q is None else Q.double()
    recon = back(project(G64, P64, Q64), P64, Q64)
    bound = FP32 * math.sqrt(max(m, n)) * torch.linalg.norm(G64)
    assert torch.linalg.norm(recon - G64) <= bound
