"""Tucker (truncated HOSVD) projection of weights with more than two dims."""

from __future__ import annotations

import io

import pytest
import torch
from torch import nn

import galore2
from galore2.projectors import TUCKER, Plan, TuckerProjector, choose_side, get_projector
from galore2.projectors.tucker import contract, expand

from ..dist import spawn
from ..fsdp import tucker_fsdp_cases

# ---- a float64 reference ------------------------------------------------------------------


def hosvd64(G: torch.Tensor, rank: int) -> list[torch.Tensor | None]:
    """Truncated HOSVD in float64: per mode, top-r left singular vectors of the textbook
    unfolding X_(k) (mode k as rows); None where r_k = d_k."""
    X = G.double()
    out: list[torch.Tensor | None] = []
    for k, d in enumerate(X.shape):
        if rank >= d:
            out.append(None)
            continue
        unfolding = X.movedim(k, 0).reshape(d, -1)
        U, _, _ = torch.linalg.svd(unfolding, full_matrices=False)
        out.append(U[:, :rank])
    return out


def core64(G: torch.Tensor, factors: list[torch.Tensor | None]) -> torch.Tensor:
    letters = "abcdefgh"[: G.dim()]
    x = G.double()
    for k, U in enumerate(factors):
        if U is not None:  # x ×_k Uᵀ, written with einsum
            out = letters.replace(letters[k], "z")
            x = torch.einsum(f"{letters},{letters[k]}z->{out}", x, U)
    return x


def back64(N: torch.Tensor, factors: list[torch.Tensor | None]) -> torch.Tensor:
    letters = "abcdefgh"[: N.dim()]
    x = N.double()
    for k, U in enumerate(factors):
        if U is not None:  # x ×_k U
            out = letters.replace(letters[k], "z")
            x = torch.einsum(f"{letters},z{letters[k]}->{out}", x, U)
    return x


def planted(shape: tuple[int, ...], ranks: tuple[int, ...], noise: float, seed: int):
    """A tensor with a dominant multilinear-rank-``ranks`` part (well separated spectra)."""
    gen = torch.Generator().manual_seed(seed)
    core = torch.randn(ranks, generator=gen, dtype=torch.float64)
    for k, r in enumerate(ranks):  # decaying slices: distinct singular values per mode
        weights = torch.tensor([4.0**-i for i in range(r)], dtype=torch.float64)
        core = core * weights.reshape([-1 if j == k else 1 for j in range(len(ranks))])
    x = core
    for k, (d, r) in enumerate(zip(shape, ranks, strict=True)):
        Q, _ = torch.linalg.qr(torch.randn(d, r, generator=gen, dtype=torch.float64))
        x = expand(x, Q, k)
    return (x + noise * torch.randn(shape, generator=gen, dtype=torch.float64)).float()


def tucker_for(G: torch.Tensor, rank: int, projector: str = "svd"):
    plan = Plan(TUCKER, G.shape[0], G[0].numel(), rank, G.device)
    return TuckerProjector(get_projector(projector), G.shape), plan


def group_for(projector: str = "svd", **kw) -> dict:
    return {"oversample": 8, "power_iters": 2, "projector": projector, **kw}


def fresh_state(proj: TuckerProjector, plan: Plan) -> dict[str, torch.Tensor]:
    state = {"galore.refreshes": torch.tensor(0), "galore.seed": torch.tensor(7)}
    proj.init_state(state, plan, {})
    return state


def span(U: torch.Tensor) -> torch.Tensor:
    return U.double() @ U.double().mT


@pytest.mark.parametrize("shape, rank", [((10, 7, 5), 4), ((9, 6, 4, 3), 3), ((6, 12, 5, 2), 4)])
def test_hosvd_matches_float64_reference(shape, rank):
    ranks = tuple(min(rank, d) for d in shape)
    G = planted(shape, ranks, noise=1e-3, seed=sum(shape))
    proj, plan = tucker_for(G, rank)
    assert proj.ranks(plan) == ranks
    assert proj.modes(plan) == tuple(k for k, d in enumerate(shape) if rank < d)
    state = fresh_state(proj, plan)
    new = proj.refresh(G, state, plan, group_for(), seed=1)
    proj.store(state, new, plan)
    ref = hosvd64(G, rank)
    ours = proj.bases(state, plan)
    for k, (U, R) in enumerate(zip(ours, ref, strict=True)):
        if R is None:  # identity mode: no factor, no state
            assert U is None and f"proj.mode{k}" not in state
            continue
        assert U.shape == (shape[k], ranks[k])
        assert torch.allclose(
            U.double().mT @ U.double(), torch.eye(ranks[k], dtype=torch.float64), atol=1e-5
        )
        assert (span(U) - span(R)).abs().max() < 1e-4, f"mode {k}"
    # the same signs as ours: then core and back-projection must match the reference
    aligned = [
        None if R is None else R * torch.sign((U.double() * R).sum(0))
        for U, R in zip(ours, ref, strict=True)
    ]
    core = proj.project(G, state, plan)
    assert core.shape == ranks
    assert torch.allclose(core.double(), core64(G, aligned), atol=1e-4, rtol=1e-4)
    N = torch.randn(ranks, dtype=torch.float32)
    back = proj.project_back(N, state, plan, torch.float32)
    assert back.shape == shape
    assert torch.allclose(back.double(), back64(N, aligned), atol=1e-5)
    # the HOSVD reconstruction error is what the float64 one is
    rec = proj.project_back(core, state, plan, torch.float32).double()
    rec64 = back64(core64(G, aligned), aligned)
    assert torch.allclose(rec, rec64, atol=1e-4)


@pytest.mark.parametrize("projector", ["randomized", "power"])
def test_sketched_factors_find_the_planted_subspaces(projector):
    shape, rank = (12, 9, 7, 3), 3
    G = planted(shape, (3, 3, 3, 3), noise=0.0, seed=3)  # multilinear rank exactly 3
    proj, plan = tucker_for(G, rank, projector)
    state = fresh_state(proj, plan)
    proj.store(state, proj.refresh(G, state, plan, group_for(projector), seed=4), plan)
    state["galore.refreshes"] += 1
    if projector == "power":  # a warm refresh from the stored factors
        proj.store(state, proj.refresh(G, state, plan, group_for(projector), seed=5), plan)
    for U, R in zip(proj.bases(state, plan), hosvd64(G, rank), strict=True):
        assert (U is None) == (R is None)
        if R is not None:
            assert (span(U) - span(R)).abs().max() < 1e-4


def test_choose_side_for_tensors():
    assert choose_side((16, 8, 3, 3), "std", 4, "tucker") == TUCKER
    assert choose_side((16, 8, 3, 3), "std", 4, "matrix") == galore2.projectors.LEFT
    assert choose_side((4, 32, 48), "std", 8, "tucker") == TUCKER  # mode 0 kept, 1 and 2 cut
    assert choose_side((3, 3, 3), "std", 3, "tucker") == galore2.projectors.NONE
    assert choose_side((8, 16), "std", 4, "tucker") == galore2.projectors.LEFT  # matrices


def test_rotation_is_the_change_of_basis():
    gen = torch.Generator().manual_seed(0)
    shape, rank = (8, 6, 5), 3
    olds = [torch.linalg.qr(torch.randn(d, rank, generator=gen))[0] for d in shape]
    news = [torch.linalg.qr(torch.randn(d, rank, generator=gen))[0] for d in shape]
    plan = Plan(TUCKER, 8, 30, rank, torch.device("cpu"))
    rotate = TuckerProjector.rotation(tuple(olds), tuple(news), plan)
    M = torch.randn(rank, rank, rank, generator=gen)
    full = M
    for k, U in enumerate(olds):  # back to the full space, then into the new factors
        full = expand(full, U, k)
    want = full
    for k, U in enumerate(news):
        want = contract(want, U, k)
    assert torch.allclose(rotate(M, False), want, atol=1e-5)
    V = M.square()
    assert (rotate(V, True) >= 0).all()


# ---- through the optimizer ------------------------------------------------------------------


class ConvNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(8, 16, 3)
        self.conv2 = nn.Conv2d(16, 16, 3)
        self.head = nn.Linear(16, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.relu(self.conv1(x))
        h = self.conv2(h).mean(dim=(2, 3))
        return self.head(h)


def conv_data():
    gen = torch.Generator().manual_seed(1)
    return torch.randn(32, 8, 9, 9, generator=gen), torch.randint(0, 10, (32,), generator=gen)


def conv_groups(model: ConvNet, **kw) -> list[dict]:
    mats = [model.conv1.weight, model.conv2.weight, model.head.weight]
    rest = [model.conv1.bias, model.conv2.bias, model.head.bias]
    return [
        {"params": mats, "rank": 4, "update_proj_gap": 20, "scale": 1.0, **kw},
        {"params": rest},
    ]


def train_conv(model: ConvNet, opt: torch.optim.Optimizer, steps: int) -> list[float]:
    x, y = conv_data()
    losses = []
    for _ in range(steps):
        opt.zero_grad()
        loss = nn.functional.cross_entropy(model(x), y)
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return losses


def state_nbytes(state: dict) -> int:
    return sum(v.numel() * v.element_size() for v in state.values() if isinstance(v, torch.Tensor))


@pytest.mark.parametrize("moments", ["keep", "project"])
def test_conv_net_gets_tucker_state_and_learns(moments):
    torch.manual_seed(0)
    model = ConvNet()
    opt = galore2.GaLoreAdamW(
        conv_groups(model, projector="randomized", moments_on_refresh=moments), lr=1e-2
    )
    losses = train_conv(model, opt, 60)
    assert losses[-1] < 0.5 * losses[0], losses[::10]
    for conv in (model.conv1, model.conv2):
        state = opt.state[conv.weight]
        assert int(state["galore.side"]) == TUCKER
        assert state["adam.exp_avg"].shape == (4, 4, 3, 3)  # kernel modes: identity
        assert state["adam.exp_avg_sq"].shape == (4, 4, 3, 3)
        assert state["proj.mode0"].shape == (16, 4)
        assert state["proj.mode1"].shape == (conv.weight.shape[1], 4)
        assert "proj.mode2" not in state and "proj.mode3" not in state
        assert int(state["galore.refreshes"]) == 3  # steps 0, 20, 40
        # far smaller than AdamW's two full-size moments
        assert state_nbytes(state) < 0.3 * 2 * conv.weight.numel() * 4
    head = opt.state[model.head.weight]
    assert int(head["galore.side"]) == galore2.projectors.LEFT and "proj.left" in head
    by_kind = opt.state_bytes()
    basis = sum(
        v.numel() * 4 for s in opt.state.values() for k, v in s.items() if k.startswith("proj.")
    )
    assert by_kind["basis"] == basis
    plain = torch.optim.AdamW(model.parameters())
    for p in model.parameters():
        p.grad = torch.zeros_like(p)
    plain.step()
    convs = [model.conv1.weight, model.conv2.weight]
    assert sum(state_nbytes(opt.state[p]) for p in convs) < 0.3 * sum(
        state_nbytes(plain.state[p]) for p in convs
    )


class Experts(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        gen = torch.Generator().manual_seed(0)
        self.w = nn.Parameter(0.1 * torch.randn(4, 32, 48, generator=gen))  # (expert, in, out)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.einsum("bei,eio->beo", x, self.w)


def test_stacked_expert_weight_is_tucker_projected():
    model = Experts()
    gen = torch.Generator().manual_seed(2)
    x = torch.randn(64, 4, 32, generator=gen)
    delta = planted((4, 32, 48), (4, 4, 4), noise=0.0, seed=9)  # a low multilinear rank move
    target = torch.einsum("bei,eio->beo", x, model.w.detach() + delta)
    opt = galore2.GaLoreAdamW(
        [{"params": [model.w], "rank": 8, "update_proj_gap": 10, "scale": 1.0}], lr=1e-2
    )
    losses = []
    for _ in range(40):
        opt.zero_grad()
        loss = (model(x) - target).square().mean()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    assert losses[-1] < 0.2 * losses[0], losses[::5]
    state = opt.state[model.w]
    assert int(state["galore.side"]) == TUCKER
    assert state["adam.exp_avg"].shape == (4, 8, 8)  # 4 experts ≤ rank: mode 0 kept
    assert "proj.mode0" not in state
    assert state["proj.mode1"].shape == (32, 8) and state["proj.mode2"].shape == (48, 8)


def test_matrix_projection_keeps_the_flattening():
    """tensor_projection="matrix" is the old behaviour: the same run as a 2-D weight."""
    gen = torch.Generator().manual_seed(5)
    W0 = torch.randn(16, 8, 3, 3, generator=gen)
    grads = [torch.randn(16, 8, 3, 3, generator=gen) for _ in range(9)]
    W4 = nn.Parameter(W0.clone())
    W2 = nn.Parameter(W0.reshape(16, 72).clone())
    kw = {"rank": 4, "update_proj_gap": 4, "projector": "randomized"}
    opt4 = galore2.GaLoreAdamW([{"params": [W4], "tensor_projection": "matrix", **kw}], lr=1e-2)
    opt2 = galore2.GaLoreAdamW([{"params": [W2], **kw}], lr=1e-2)
    for g in grads:
        W4.grad, W2.grad = g.clone(), g.reshape(16, 72).clone()
        opt4.step()
        opt2.step()
    assert torch.equal(W4.detach().reshape(16, 72), W2.detach())
    s4, s2 = opt4.state[W4], opt2.state[W2]
    assert int(s4["galore.side"]) == galore2.projectors.LEFT
    assert s4["proj.left"].shape == (16, 4) and s4["adam.exp_avg"].shape == (4, 72)
    assert all(torch.equal(s4[k], s2[k]) for k in s2)


def test_nonfinite_or_zero_gradient_at_a_refresh_keeps_the_factors():
    torch.manual_seed(0)
    W = nn.Parameter(torch.randn(12, 6, 5))
    opt = galore2.GaLoreAdamW(
        [{"params": [W], "rank": 3, "update_proj_gap": 2, "projector": "svd"}], lr=1e-2
    )
    gen = torch.Generator().manual_seed(3)
    for _ in range(2):  # refresh at step 0
        W.grad = torch.randn(12, 6, 5, generator=gen)
        opt.step()
    state = opt.state[W]
    factors = {k: v.clone() for k, v in state.items() if k.startswith("proj.")}
    before = W.detach().clone()
    bad = torch.randn(12, 6, 5, generator=gen)
    bad[3, 2, 1] = float("nan")
    W.grad = bad  # due refresh at step 2: non-finite → factors kept, update skipped
    opt.step()
    assert opt.nonfinite_skips == 1 and torch.equal(W.detach(), before)
    assert int(state["galore.refreshes"]) == 1
    assert all(torch.equal(state[k], v) for k, v in factors.items())
    W.grad = torch.zeros(12, 6, 5)  # zero gradient: factors kept, the refresh stays due
    opt.step()
    assert int(state["galore.refreshes"]) == 1
    assert all(torch.equal(state[k], v) for k, v in factors.items())
    W.grad = torch.randn(12, 6, 5, generator=gen)  # retried: now it refreshes
    opt.step()
    assert int(state["galore.refreshes"]) == 2
    assert not torch.equal(state["proj.mode0"], factors["proj.mode0"])
    proj, plan = tucker_for(W.detach(), 3)
    inf = torch.full((12, 6, 5), float("inf"))
    assert proj.refresh(inf, state, plan, group_for(), seed=0) is None


@pytest.mark.parametrize("projector", ["randomized", "random"])
def test_state_dict_round_trip_resumes_bit_identically(projector):
    def make():
        torch.manual_seed(0)
        model = ConvNet()
        kw = {"projector": projector, "moments_on_refresh": "project", "update_proj_gap": 4}
        return model, galore2.GaLoreAdamW(conv_groups(model, **kw), lr=3e-3)

    model, opt = make()
    train_conv(model, opt, 6)
    buf = io.BytesIO()
    torch.save({"model": model.state_dict(), "opt": opt.state_dict()}, buf)
    buf.seek(0)
    saved = torch.load(buf, weights_only=True)
    resumed, opt2 = make()
    resumed.load_state_dict(saved["model"])
    opt2.load_state_dict(saved["opt"])
    train_conv(model, opt, 7)  # crosses the refreshes at steps 8 and 12
    train_conv(resumed, opt2, 7)
    for p, q in zip(model.parameters(), resumed.parameters(), strict=True):
        assert torch.equal(p, q)
    key = "proj.seed" if projector == "random" else "proj.mode0"
    assert torch.equal(opt.state[model.conv1.weight][key], opt2.state[resumed.conv1.weight][key])


def test_random_projector_uses_seeded_factors():
    torch.manual_seed(0)
    model = ConvNet()
    opt = galore2.GaLoreAdamW(conv_groups(model, projector="random", update_proj_gap=3), lr=3e-3)
    losses = train_conv(model, opt, 30)
    assert losses[-1] < losses[0]
    state = opt.state[model.conv1.weight]
    assert not any(k.startswith("proj.mode") for k in state)  # nothing but the seed stored
    proj, plan = tucker_for(model.conv1.weight.detach(), 4, "random")
    f1, f2 = proj.bases(state, plan), proj.bases(state, plan)
    assert f1[0].shape == (16, 4) and torch.equal(f1[0], f2[0]) and f1[2] is None


@pytest.mark.parametrize("projector", ["power", "random"])
def test_quantized_factors_and_adaptive_refresh(projector):
    torch.manual_seed(0)
    model = ConvNet()
    kw = {"adaptive_refresh": True, "update_proj_gap": 5, "projector": projector}
    if projector != "random":
        kw["basis_dtype"] = "int8"
    mats = [model.conv1.weight, model.conv2.weight]  # Tucker weights only
    rest = [p for p in model.parameters() if all(p is not q for q in mats)]
    opt = galore2.GaLoreAdamW(
        [{"params": mats, "rank": 4, "scale": 1.0, **kw}, {"params": rest}], lr=1e-2
    )
    losses = train_conv(model, opt, 21)
    assert losses[-1] < 0.8 * losses[0]
    state = opt.state[model.conv1.weight]
    assert int(state["galore.refreshes"]) >= 3
    assert 0.0 <= float(state["galore.similarity"]) <= 1.0 + 1e-6
    if projector != "random":
        assert "proj.mode0" not in state and state["proj.mode0.q"].dtype == torch.int8
        rows = 16 + 8 + 16 + 16  # U_0, U_1 of both convs, r = 4: 4 codes + 1 fp32 scale
        assert opt.state_bytes()["basis"] == rows * (4 + 4)  # fp32: rows * 16


# ---- FSDP2 ---------------------------------------------------------------------------------


def test_fsdp_matches_single_process_and_traffic_model():
    """2 gloo ranks (one spawn for both checks): FSDP2 equals one process for every
    projector, and collective_bytes predicts the collectives issued for Tucker weights."""
    spawn(tucker_fsdp_cases.run_all, 2)


@pytest.mark.parametrize("shape", [(10, 7, 5), (6, 5, 4, 3)])
@pytest.mark.parametrize("foreach", [None, True])
def test_tucker_update_carries_scale_and_weight_decay(shape, foreach):
    """Issue 39, item 24: a Tucker weight's update is ``scale · (N ×_k U_k)``, applied as
    galore-torch applies a projected one — ``W ← (W − lr·α·ΔW)(1 − lr·λ)`` — with α ≠ 1 and
    λ ≠ 0, against a float64 reference computed here: the core, Adam on it and the
    back-projection by einsum, from the factors the optimizer stored (a refresh at the first
    step only; their finding is :func:`test_hosvd_matches_float64_reference`'s).

    Float64 weights, state and projection (the factors are stored in float32, read exactly
    into float64): the two paths differ by float64 rounding only — the weights' own (two
    roundings a step on each side: 8·t units of 2⁻⁵³ of max |W| after t steps) and the
    update's (sums of at most ``numel`` terms: ``numel`` units of 2⁻⁵³ of its largest
    entry). Without α·(1 − lr·λ) the update is 4× as large, without its 1 − lr·λ alone
    0.5% larger: about 10¹² and 10⁹ times the bound."""
    lr, alpha, lam, rank = 1e-2, 0.25, 0.5, 3
    beta1, beta2, eps = 0.9, 0.999, 1e-8
    gen = torch.Generator().manual_seed(sum(shape))
    w = nn.Parameter(torch.randn(shape, generator=gen, dtype=torch.float64))
    other = nn.Parameter(torch.randn(shape[0], 9, generator=gen, dtype=torch.float64))
    opt = galore2.GaLoreAdamW(
        [{"params": [w, other], "rank": rank, "update_proj_gap": 100, "scale": alpha}],
        lr=lr, weight_decay=lam, betas=(beta1, beta2), eps=eps, state_dtype="float64",
        foreach=foreach,
    )  # fmt: skip
    ref = w.detach().clone()
    m = v = None
    for t in range(1, 4):
        g = torch.randn(shape, generator=gen, dtype=torch.float64)
        w.grad, other.grad = g, torch.randn(other.shape, generator=gen, dtype=torch.float64)
        opt.step()
        state = opt.state[w]
        assert int(state["galore.side"]) == TUCKER and int(state["galore.refreshes"]) == 1
        factors = [
            state[f"proj.mode{k}"].double() if f"proj.mode{k}" in state else None
            for k in range(len(shape))
        ]
        core = core64(g, factors)
        m = (1 - beta1) * core if m is None else beta1 * m + (1 - beta1) * core
        v = (1 - beta2) * core**2 if v is None else beta2 * v + (1 - beta2) * core**2
        N = (m / (1 - beta1**t)) / ((v / (1 - beta2**t)).sqrt() + eps)
        ref = (ref - lr * alpha * back64(N, factors)) * (1 - lr * lam)
        update = lr * alpha * back64(N, factors).abs().max()
        tol = 2.0**-53 * (8 * t * ref.abs().max() + w.numel() * update)
        assert (ref - w.detach()).abs().max() <= tol, t
