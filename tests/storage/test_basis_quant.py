"""Quantized GaLore bases (``basis_dtype`` fp32 / bf16 / int8 / int4, ``basis_hadamard``)."""

from __future__ import annotations

import copy
import io
import math

import pytest
import torch
from torch import nn

import galore2
from galore2.projectors import LEFT, RIGHT, Plan, get_projector
from galore2.storage.basis import FORMATS, Quantization, basis_zeros
from galore2.storage.hadamard import fwht, padded_length, random_signs, rotate, unrotate

from ..dist import spawn
from ..fsdp import fsdp_cases
from ..helpers import TinyNet, galore_groups, max_diff, train

CPU = torch.device("cpu")
QMAX = {"int8": 127, "int4": 7}


def sylvester(n: int) -> torch.Tensor:
    """The normalized n×n Hadamard matrix, float64, by Sylvester's construction."""
    H = torch.ones(1, 1, dtype=torch.float64)
    while H.shape[0] < n:
        H = torch.cat((torch.cat((H, H), dim=1), torch.cat((H, -H), dim=1)), dim=0)
    return H / math.sqrt(n)


def orthonormal(rows: int, r: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.linalg.qr(torch.randn(rows, r, generator=g)).Q


def plan_for(basis: str, rows: int, r: int, group_size: int, hadamard: bool = False) -> Plan:
    return Plan(LEFT, rows, 10 * rows, r, CPU, basis=basis, group_size=group_size,
                hadamard=hadamard, basis_seed=1234)  # fmt: skip


def round_trip(basis: str, x: torch.Tensor, plan: Plan) -> tuple[dict, torch.Tensor]:
    fmt, state = FORMATS[basis], {}
    fmt.allocate(state, "proj.left", tuple(x.shape), "rows", basis_zeros(plan), plan)
    fmt.store(state, "proj.left", x, plan)
    return state, fmt.load(state, "proj.left", plan)


# ---- Hadamard ----------------------------------------------------------------------
@pytest.mark.parametrize("n", [2**k for k in range(9)])
def test_fwht_is_the_normalized_sylvester_matrix_and_its_own_inverse(n):
    x = torch.randn(5, 3, n, dtype=torch.float64, generator=torch.Generator().manual_seed(n))
    H = sylvester(n)
    torch.testing.assert_close(fwht(x), x @ H.T, rtol=0, atol=1e-12)
    torch.testing.assert_close(fwht(fwht(x)), x, rtol=0, atol=1e-12)
    x32 = x.float()
    torch.testing.assert_close(fwht(x32), (x @ H.T).float(), rtol=1e-5, atol=1e-6)


def test_fwht_rejects_non_powers_of_two():
    with pytest.raises(ValueError, match="power-of-two"):
        fwht(torch.zeros(2, 12))


def test_padded_length():
    assert padded_length(256, 256) == 256  # no tail
    assert padded_length(32, 256) == 32  # r < block, a power of two: no padding
    assert padded_length(100, 256) == 128  # tail 100 → 128
    assert padded_length(300, 256) == 320  # 256 + (44 → 64)
    assert padded_length(513, 256) == 513  # tail of 1 is a power of two


@pytest.mark.parametrize("r,block", [(64, 64), (100, 32), (13, 8), (5, 16)])
def test_blockwise_rotation_is_orthogonal(r, block):
    L = padded_length(r, block)
    signs = random_signs(7, L)
    # The rotation as a matrix (rows of the identity, rotated) is orthogonal: MᵀM = I.
    M = rotate(torch.eye(L, dtype=torch.float64), block, signs.double())
    torch.testing.assert_close(M @ M.T, torch.eye(L, dtype=torch.float64), rtol=0, atol=1e-12)
    g = torch.Generator().manual_seed(r)
    x, y = torch.randn(6, L, generator=g), torch.randn(6, L, generator=g)
    rx, ry = rotate(x, block, signs), rotate(y, block, signs)
    torch.testing.assert_close(rx.norm(dim=1), x.norm(dim=1), rtol=1e-5, atol=0)
    torch.testing.assert_close((rx * ry).sum(1), (x * y).sum(1), rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(unrotate(rx, block, signs), x, rtol=0, atol=1e-5)
    assert not torch.allclose(rx, x, atol=1e-2)  # it does rotate


def test_random_signs_are_deterministic_balanced_and_seeded():
    s = random_signs(42, 4096)
    assert s.dtype == torch.float32 and set(s.unique().tolist()) == {-1.0, 1.0}
    assert torch.equal(s, random_signs(42, 4096))
    assert torch.equal(random_signs(42, 100), s[:100])  # a function of (seed, index)
    assert abs(s.mean().item()) < 0.05
    assert abs((s[1:] * s[:-1]).mean().item()) < 0.05  # neighbours uncorrelated
    assert abs((s * random_signs(43, 4096)).mean().item()) < 0.05  # seeds independent


# ---- formats -------------------------------------------------------------------------
def test_fp32_stores_the_basis_itself():
    P = orthonormal(40, 12, 0)
    state, out = round_trip("fp32", P, plan_for("fp32", 40, 12, 8))
    assert list(state) == ["proj.left"] and state["proj.left"].dtype == torch.float32
    assert out is state["proj.left"] and torch.equal(out, P)  # no copy, no rounding


def test_bf16_storage_equals_to_bfloat16():
    G = torch.randn(40, 70, generator=torch.Generator().manual_seed(1))
    plan = plan_for("bf16", 40, 12, 8)._replace(n=70)
    projector = get_projector("svd")
    state: dict = {}
    projector.init_state(state, plan, {})
    new = projector.refresh(G, state, plan, {}, seed=0)
    projector.store(state, new, plan)
    assert state["proj.left"].dtype == torch.bfloat16
    assert torch.equal(state["proj.left"], new["left"].to(torch.bfloat16))
    P, Q = projector.bases(state, plan)
    assert Q is None and P.dtype == torch.float32
    assert torch.equal(P, new["left"].to(torch.bfloat16).float())


@pytest.mark.parametrize("basis", ["int8", "int4"])
@pytest.mark.parametrize("r,group_size", [(100, 32), (37, 8), (20, 256)])
def test_int_round_trip_error_is_at_most_half_a_step(basis, r, group_size):
    """Plain blockwise absmax: scale_j = absmax_j / qmax, |x − deq(q(x))| ≤ scale_j / 2."""
    rows = 30
    g = torch.Generator().manual_seed(r)
    x = torch.randn(rows, r, generator=g) * torch.logspace(-3, 1, rows)[:, None]
    x[3] = 0.0  # an all-zero row: scale 0, decoded exactly
    plan = plan_for(basis, rows, r, group_size)
    state, out = round_trip(basis, x, plan)
    qmax = QMAX[basis]
    # Closed form: the groups are consecutive runs of group_size (the last one shorter).
    k = -(-r // group_size)
    scale = torch.stack(
        [x[:, j * group_size : (j + 1) * group_size].abs().amax(1) / qmax for j in range(k)], 1
    )
    torch.testing.assert_close(state["proj.left.scale"], scale, rtol=1e-6, atol=0)
    per_entry = scale.repeat_interleave(group_size, dim=1)[:, :r]
    err = (out - x).abs()
    assert bool((err <= per_entry / 2 * (1 + 1e-5)).all()), (err / per_entry).max()
    assert torch.equal(out[3], torch.zeros(r))
    assert (err > 0).any()  # it is lossy: the bound is not met trivially
    q = state["proj.left.q"]
    if basis == "int8":
        assert q.dtype == torch.int8 and q.shape == (rows, r)
        assert int(q.abs().max()) == qmax  # each group's absmax maps to ±qmax
    else:
        assert q.dtype == torch.uint8 and q.shape == (rows, (r + 1) // 2)  # two codes a byte
        nibbles = torch.stack((q & 15, q >> 4), 2).reshape(rows, -1)[:, :r].int() - 8
        assert int(nibbles.abs().max()) == qmax


@pytest.mark.parametrize("basis,hadamard", [("bf16", False), ("int8", True), ("int4", False)])
def test_an_empty_shard_round_trips(basis, hadamard):
    """An FSDP rank may hold no rows of P (m < world): every format handles 0 rows."""
    state, out = round_trip(basis, torch.zeros(0, 7), plan_for(basis, 0, 7, 4, hadamard))
    assert out.shape == (0, 7) and all(t.shape[0] == 0 for t in state.values())


@pytest.mark.parametrize("basis", ["int8", "int4"])
def test_hadamard_round_trip_error_bound(basis):
    """Rotated: the per-element bound holds for H·D·x, so ‖x − x̃‖ ≤ ‖scale/2‖ per row."""
    rows, r, block = 16, 44, 16  # 2 blocks of 16, tail 12 padded to 16
    x = orthonormal(rows, r, 3) if rows >= r else orthonormal(r, rows, 3).T.contiguous()
    plan = plan_for(basis, rows, r, block, hadamard=True)
    state, out = round_trip(basis, x, plan)
    L = padded_length(r, block)
    assert L == 48 and state["proj.left.scale"].shape == (rows, 3)
    sizes = torch.tensor([16.0, 16.0, 16.0])
    bound = ((state["proj.left.scale"] / 2).square() * sizes).sum(1).sqrt()
    err = (out - x).norm(dim=1)
    assert bool((err <= bound * (1 + 1e-4)).all())
    assert (err > 0).any()


def test_hadamard_reduces_int4_error_on_a_basis_with_outliers():
    """Rows with one heavy coordinate: plain absmax wastes the range on it."""
    m, r = 512, 64
    g = torch.Generator().manual_seed(0)
    A = 0.05 * torch.randn(m, r, generator=g)
    A[torch.arange(m), torch.randint(0, r, (m,), generator=g)] += 1.0
    P = torch.linalg.qr(A).Q
    errors = {}
    for hadamard in (False, True):
        _, out = round_trip("int4", P, plan_for("int4", m, r, 64, hadamard))
        errors[hadamard] = ((out - P).norm() / P.norm()).item()
    assert errors[True] < 0.5 * errors[False], errors  # measured: 0.076 vs 0.28


# ---- the optimizer ----------------------------------------------------------------
def run(steps: int, **settings) -> tuple[nn.Module, galore2.GaLoreAdamW, list[float]]:
    torch.manual_seed(0)
    model = TinyNet()
    opt = galore2.GaLoreAdamW(
        galore_groups(model, rank=8, update_proj_gap=10, **settings), lr=1e-2, weight_decay=0.01
    )
    return model, opt, train(model, opt, range(steps))


def test_fp32_is_bit_identical_to_the_default():
    a, opt_a, _ = run(25, projector="power", moments_on_refresh="project")
    b, opt_b, _ = run(25, projector="power", moments_on_refresh="project", basis_dtype="fp32")
    assert max_diff(a, b) == 0.0
    for p, q in zip(a.parameters(), b.parameters(), strict=True):
        sa, sb = opt_a.state[p], opt_b.state[q]
        assert sorted(sa) == sorted(sb)
        assert all(torch.equal(sa[k], sb[k]) for k in sa)


@pytest.mark.parametrize("projector", ["randomized", "power"])
def test_int8_basis_trains_like_fp32(projector):
    """40 steps of TinyNet (3 refreshes): final weights within 0.02 of the fp32 run's (they
    move by > 0.3) and the mean loss of the last 10 steps within 1%."""
    ref, _, ref_loss = run(40, projector=projector)
    q, opt, loss = run(40, projector=projector, basis_dtype="int8")
    assert "proj.left.q" in opt.state[q.down.weight]  # it really is quantized
    torch.manual_seed(0)
    start = TinyNet()
    assert max_diff(ref, start) > 0.3
    assert max_diff(q, ref) <= 0.02, max_diff(q, ref)
    tail, ref_tail = sum(loss[-10:]) / 10, sum(ref_loss[-10:]) / 10
    assert abs(tail - ref_tail) <= 0.01 * ref_tail, (tail, ref_tail)


# (m, n) = (24, 40): left, P 24×13; (50, 30): right, Q 30×13 → 54 basis rows, r = 13,
# group 8: one full group and a short one of 5 (plain), or 5 padded to 8 (Hadamard: 16 codes).
ROW_BYTES = {
    ("fp32", False): 4 * 13,
    ("bf16", False): 2 * 13,
    ("int8", False): 13 + 4 * 2,
    ("int4", False): 7 + 4 * 2,  # ⌈13/2⌉ bytes of codes
    ("int8", True): 16 + 4 * 2,
    ("int4", True): 8 + 4 * 2,
}


@pytest.mark.parametrize("basis,hadamard", list(ROW_BYTES))
def test_state_bytes_is_exact(basis, hadamard):
    p, q = nn.Parameter(torch.randn(24, 40)), nn.Parameter(torch.randn(50, 30))
    group = {"params": [p, q], "rank": 13, "basis_dtype": basis, "basis_group_size": 8,
             "basis_hadamard": hadamard}  # fmt: skip
    opt = galore2.GaLoreAdamW([group], lr=1e-3)
    p.grad, q.grad = torch.randn(24, 40), torch.randn(50, 30)
    opt.step()
    nbytes = opt.state_bytes()
    assert nbytes["basis"] == 54 * ROW_BYTES[basis, hadamard]
    assert nbytes["moments"] == 4 * 2 * 13 * (40 + 50)
    stored = sum(v.numel() * v.element_size() for s in opt.state.values() for v in s.values())
    assert nbytes["total"] == stored
    assert FORMATS[basis].nbytes((54, 13), params=Quantization(8, hadamard)) == nbytes["basis"]


@pytest.mark.parametrize("hadamard", [False, True])
def test_int4_basis_is_under_016_of_fp32_at_rank_256(hadamard):
    with torch.device("meta"):
        layer = nn.Linear(4096, 1024, bias=False)  # 1024×4096: left, P 1024×256
    sizes = {}
    for basis in ("fp32", "int4"):
        group = {"params": [layer.weight], "rank": 256, "basis_dtype": basis,
                 "basis_hadamard": hadamard and basis == "int4"}  # fmt: skip
        opt = galore2.GaLoreAdamW([group], lr=1e-3)
        opt.init_state()
        sizes[basis] = opt.state_bytes()["basis"]
    assert sizes["fp32"] == 1024 * 256 * 4
    assert sizes["int4"] == 1024 * (128 + 4)  # 256 codes in 128 bytes + one fp32 scale
    assert sizes["int4"] <= 0.16 * sizes["fp32"]


SETTINGS = [
    {"basis_dtype": "int8", "basis_group_size": 4},
    {"basis_dtype": "int4", "basis_group_size": 4, "basis_hadamard": True, "projector": "power",
     "moments_on_refresh": "project"},
]  # fmt: skip


@pytest.mark.parametrize("settings", SETTINGS)
def test_state_dict_round_trip_resumes_bit_identically(settings):
    settings = {"rank": 6, "update_proj_gap": 4, **settings}  # r = 6: one group of 4 and a tail
    torch.manual_seed(0)
    model = TinyNet()
    start = copy.deepcopy(model)
    opt = galore2.GaLoreAdamW(galore_groups(model, **settings), lr=1e-2)
    train(model, opt, range(12))

    resumed = copy.deepcopy(start)
    first = galore2.GaLoreAdamW(galore_groups(resumed, **settings), lr=1e-2)
    train(resumed, first, range(6))
    buf = io.BytesIO()
    torch.save({"model": resumed.state_dict(), "opt": first.state_dict()}, buf)
    buf.seek(0)
    saved = torch.load(buf, weights_only=True)
    fresh = copy.deepcopy(start)
    fresh.load_state_dict(saved["model"])
    second = galore2.GaLoreAdamW(galore_groups(fresh, **settings), lr=1e-2)
    second.load_state_dict(saved["opt"])
    assert "proj.left.q" in second.state[fresh.down.weight]
    train(fresh, second, range(6, 12))
    assert max_diff(fresh, model) == 0.0


def test_changing_the_format_of_stored_bases_is_a_clear_error():
    """Loading codes into an optimizer with other basis settings is refused (they are not
    resumable options); a group switched to another format afterwards fails loudly at the
    next step instead of misreading the codes."""
    torch.manual_seed(0)
    model = TinyNet()
    settings = {"rank": 6, "basis_dtype": "int8", "basis_group_size": 4}
    opt = galore2.GaLoreAdamW(galore_groups(model, **settings), lr=1e-2)
    train(model, opt, range(2))
    fp32 = galore2.GaLoreAdamW(galore_groups(model, rank=6), lr=1e-2)
    with pytest.raises(ValueError, match="basis_dtype: checkpoint 'int8', this optimizer 'fp32'"):
        fp32.load_state_dict(opt.state_dict())
    other = galore2.GaLoreAdamW(galore_groups(model, **settings), lr=1e-2)
    other.load_state_dict(opt.state_dict())
    train(model, other, range(2, 3))  # the checkpoint's format: fine
    other.param_groups[0]["basis_dtype"] = "int4"
    with pytest.raises(ValueError, match=r"\['basis_dtype'\] changed from 'int8' to 'int4'"):
        train(model, other, range(3, 4))


@pytest.mark.parametrize("side", [LEFT, RIGHT])
def test_project_mode_rotates_moments_with_the_dequantized_bases(side):
    """At a refresh, M ← β₁·(C·M) + (1 − β₁)·R with C = P̃_newᵀ·P̃_old (left) — the bases as
    dequantized from the int4 + Hadamard state — and V with C∘C."""
    m, n, r = (20, 44, 10) if side == LEFT else (44, 20, 10)  # r = 10: groups 4, 4, 2
    p = nn.Parameter(torch.randn(m, n))
    group = {"params": [p], "rank": r, "update_proj_gap": 3,
             "basis_dtype": "int4", "basis_hadamard": True, "basis_group_size": 4,
             "moments_on_refresh": "project"}  # fmt: skip
    opt = galore2.GaLoreAdamW([group], lr=1e-2)
    gen = torch.Generator().manual_seed(5)
    grads = [torch.randn(m, n, generator=gen) for _ in range(4)]
    for G in grads[:3]:
        p.grad = G.clone()
        opt.step()
    state = opt.state[p]
    plan = Plan(side, m, n, group["rank"], CPU, basis="int4", group_size=4, hadamard=True,
                basis_seed=int(state["galore.seed"]))  # fmt: skip
    projector = get_projector("randomized")
    key = 0 if side == LEFT else 1
    old = projector.bases(state, plan)[key].clone()
    M, V = state["adam.exp_avg"].clone(), state["adam.exp_avg_sq"].clone()
    p.grad = grads[3].clone()
    opt.step()  # step 3: a refresh
    assert int(state["galore.refreshes"]) == 2
    new = projector.bases(state, plan)[key]
    b1, b2 = group.get("betas", (0.9, 0.999))
    if side == LEFT:
        C = new.T @ old
        R = new.T @ grads[3]
        M_expected, V_expected = C @ M, (C * C) @ V
    else:
        C = old.T @ new
        R = grads[3] @ new
        M_expected, V_expected = M @ C, V @ (C * C)
    assert (C - torch.eye(C.shape[0])).norm() > 0.5  # the basis moved: rotation matters
    torch.testing.assert_close(
        state["adam.exp_avg"], b1 * M_expected + (1 - b1) * R, rtol=1e-4, atol=1e-5
    )
    torch.testing.assert_close(
        state["adam.exp_avg_sq"], b2 * V_expected + (1 - b2) * R * R, rtol=1e-4, atol=1e-6
    )


def test_fsdp_int4_hadamard_matches_single_process():
    spawn(fsdp_cases.int4_hadamard_matches_single_process, 2)


@pytest.mark.parametrize("basis", ["int8", "int4"])
def test_a_group_with_subnormal_absmax_stores_scale_zero(basis):
    """absmax below fp32's smallest normal × q_max: scale 0 and codes 0 (a subnormal scale
    would make codes of x / s overflow or lose all precision)."""
    plan = plan_for(basis, rows=2, r=8, group_size=4)
    x = torch.zeros(2, 8)
    x[0, :4] = torch.tensor([1e-39, -5e-40, 0.0, 2e-40])  # subnormal group
    x[0, 4:] = 0.25  # a normal group beside it
    x[1] = torch.linspace(-1, 1, 8)
    state, back = round_trip(basis, x, plan)
    scales = state["proj.left.scale"]
    assert scales[0, 0] == 0 and scales[0, 1] > 0 and (scales[1] > 0).all()
    assert torch.equal(back[0, :4], torch.zeros(4)) and torch.isfinite(back).all()
