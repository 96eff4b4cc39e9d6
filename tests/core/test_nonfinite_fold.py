"""The non-finite check folded into the projection (issue 38 item 1).

On the default path (``nonfinite="skip"``, not ``capturable``) a projected matrix that is
not due for a refresh is tested on its projection R = PᵀG (or G·Q), which GaLore makes
for its update anyway (:meth:`GaLore.screened`, :mod:`galore2.optim.lowrank_screen`),
instead of by a second read of G. Here:

* which tensor is tested: R for such matrices (per tensor and per shape batch), G on a
  refresh step, for a plain parameter, with ``capturable=True``, ``nonfinite="raise"`` and
  float16 state;
* on finite gradients the fold changes nothing: a ``"skip"`` run and an ``"ignore"`` run
  (no check at all, the projections made where they always were) end bitwise equal;
* a NaN, an Inf or an overflowing sum of squares in one gradient is skipped exactly as
  before the fold: that parameter's weights and state are untouched (bitwise), the skip
  is counted, and every other parameter steps as in a twin run where that gradient is
  absent (bitwise: the same lists, the same arithmetic; with ``capturable=True`` within
  a few float64 roundings, the masked matrix staying in its shape batch) — per tensor and batched,
  capturable and not, in a member of either shape batch, in a matrix projected alone, in a
  plain parameter (checked against ``torch.optim.AdamW`` in float64 as well), on a
  non-refresh step and on a refresh step.
"""

from __future__ import annotations

import warnings

import pytest
import torch

import galore2
from galore2.core import nonfinite
from galore2.core.nonfinite import SKIPS

# two shape batches (q/k/v: 16 x 12, left-projected as 12 < 16 -> right; up/gate: 12 x 20),
# a matrix projected alone (down), plain parameters: a bias in the low-rank group and a
# matrix in a group without rank
SHAPES = {
    "q": (16, 12), "k": (16, 12), "v": (16, 12), "up": (12, 20), "gate": (12, 20),
    "down": (20, 14), "bias": (12,), "emb": (10, 12),
}  # fmt: skip
PROJECTED = ("q", "k", "v", "up", "gate", "down")
LOW = {"rank": 4, "update_proj_gap": 2, "projector": "svd"}  # refreshes at steps 1, 3, 5
STEPS = 5
PATHS = [(False, False), (True, False), (False, True), (True, True)]  # (foreach, capturable)


def _build(
    foreach: bool, capturable: bool, preset: str = "GaLoreAdamW", **options
) -> tuple[dict, torch.optim.Optimizer]:  # fmt: skip
    gen = torch.Generator().manual_seed(11)
    params = {n: torch.nn.Parameter(torch.randn(s, generator=gen, dtype=torch.float64))
              for n, s in SHAPES.items()}  # fmt: skip
    low = {k: v for k, v in LOW.items() if preset != "APOLLO" or k != "projector"}
    groups = [
        {"params": [params[n] for n in (*PROJECTED, "bias")], **low},
        {"params": [params["emb"]]},
    ]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        opt = getattr(galore2, preset)(groups, lr=1e-2, weight_decay=0.1, foreach=foreach,
                                       capturable=capturable, state_dtype="float64",
                                       **options)  # fmt: skip
    return params, opt


def _grads(params: dict, step: int) -> dict[str, torch.Tensor]:
    out = {}
    for i, (n, p) in enumerate(params.items()):
        gen = torch.Generator().manual_seed(100 * step + i)
        out[n] = torch.randn(p.shape, generator=gen, dtype=torch.float64)
    return out


def _state(opt: torch.optim.Optimizer, p: torch.Tensor) -> dict[str, torch.Tensor]:
    return {k: v.clone() for k, v in opt.state[p].items() if k != SKIPS}


def _equal_states(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


#: the masked step keeps a masked matrix in its shape batch (one bmm) where the twin
#: projects its partner alone: float64 sums in another order, a few roundings apart
RTOL = 1e-12


def _same(a: torch.Tensor, b: torch.Tensor, exact: bool) -> bool:
    if exact or not a.is_floating_point():
        return torch.equal(a, b)
    a, b = a.detach(), b.detach()
    scale = float(b.abs().max()) if b.numel() else 0.0
    return bool(torch.isnan(a).equal(torch.isnan(b))) and bool(
        ((a - b).nan_to_num().abs() <= RTOL * scale).all()
    )


@pytest.mark.parametrize("preset", ["GaLoreAdamW", "Fira", "APOLLO"])
@pytest.mark.parametrize("foreach", [False, True])
def test_projected_matrices_are_tested_on_their_projection(
    monkeypatch, foreach: bool, preset: str
) -> None:  # fmt: skip
    """What the check reads: every gradient on a refresh step (step 1), R of each projected
    matrix on a non-refresh step (step 2), the full gradient of plain parameters always —
    for Fira and APOLLO too, whose updates read G itself (a non-finite G makes R
    non-finite: :mod:`galore2.optim.lowrank_screen`)."""
    seen: list[list[tuple[int, ...]]] = []
    usable = nonfinite.usable

    def spy(grads, placements, dtype, batched=False):
        seen.append([tuple(g.shape) for g in grads])
        return usable(grads, placements, dtype, batched)

    monkeypatch.setattr(nonfinite, "usable", spy)
    params, opt = _build(foreach, False, preset)
    full = [tuple(s) for s in SHAPES.values()]
    low = {"q": (16, 4), "k": (16, 4), "v": (16, 4), "up": (4, 20), "gate": (4, 20),
           "down": (20, 4)}  # fmt: skip
    for step in (1, 2):
        seen.clear()
        for n, g in _grads(params, step).items():
            params[n].grad = g
        opt.step()
        tested = sorted(s for call in seen for s in call)
        want = full if step == 1 else [low.get(n, s) for n, s in zip(SHAPES, full, strict=True)]
        assert tested == sorted(want), step


@pytest.mark.parametrize(
    "options", [{"capturable": True}, {"nonfinite": "raise"}, {"state_dtype": "float16"}]
)
def test_no_fold_where_the_gradient_must_be_read(monkeypatch, options: dict) -> None:
    """The masked step (it masks the gradients), ``"raise"`` (it reads every gradient before
    any change) and float16 state (its bound is on ‖g‖) test the full gradients."""
    params = {n: torch.nn.Parameter(torch.randn(s)) for n, s in SHAPES.items() if n != "emb"}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        opt = galore2.GaLoreAdamW([{"params": list(params.values()), **LOW}], foreach=True,
                                  **options)  # fmt: skip
    seen: list[tuple[int, ...]] = []
    usable = nonfinite.usable

    def spy(grads, placements, dtype, batched=False):
        seen.extend(tuple(g.shape) for g in grads)
        return usable(grads, placements, dtype, batched)

    monkeypatch.setattr(nonfinite, "usable", spy)
    for step in (1, 2):
        seen.clear()
        for p in params.values():
            p.grad = torch.randn_like(p) * 1e-3
        opt.step()
        assert set(seen) == {tuple(p.shape) for p in params.values()}, step


@pytest.mark.parametrize("foreach", [False, True])
def test_fold_changes_nothing_on_finite_gradients(foreach: bool) -> None:
    """``"skip"`` (R tested, the kept projections used by the update) and ``"ignore"`` (no
    test: each projection made by the update itself) end bitwise equal, refreshes included."""
    runs = []
    for mode in ("skip", "ignore"):
        params, opt = _build(foreach, False, nonfinite=mode)
        for step in range(1, STEPS + 1):
            for n, g in _grads(params, step).items():
                params[n].grad = g
            opt.step()
        runs.append((params, opt))
    (a, oa), (b, ob) = runs
    for n in SHAPES:
        assert torch.equal(a[n], b[n]), n
        assert _equal_states(_state(oa, a[n]), _state(ob, b[n])), n


def _poison(g: torch.Tensor, kind: str) -> None:
    if kind == "nan":
        g.view(-1)[3] = float("nan")
    elif kind == "inf":
        g.view(-1)[-1] = float("-inf")
    else:  # finite, but its sum of squares (and its projection's) overflows float64
        g.mul_(1e160)


CASES = [
    # (parameter, step, kind): steps 2 and 4 are non-refresh steps, 3 a refresh step
    ("q", 2, "nan"), ("k", 4, "inf"), ("gate", 2, "nan"), ("up", 4, "huge"),
    ("down", 2, "inf"), ("down", 3, "nan"), ("v", 3, "nan"), ("bias", 2, "nan"),
    ("emb", 4, "nan"), ("q", 2, "huge"),
]  # fmt: skip


@pytest.mark.parametrize("preset", ["Fira", "APOLLO"])
@pytest.mark.parametrize("along", [False, True])
@pytest.mark.parametrize(("bad", "at", "kind"), [("q", 2, "nan"), ("gate", 4, "inf")])
def test_fira_and_apollo_skip_a_gradient_tested_on_its_projection(
    monkeypatch, preset: str, along: bool, bad: str, at: int, kind: str
) -> None:  # fmt: skip
    """Fira and APOLLO, batched, their matrices tested on R (a NaN or −Inf in a member of
    either shape batch on a non-refresh step), stacked or along the data: as
    :func:`test_unusable_gradient_skipped_as_before` — that parameter untouched, the skip
    counted, every other parameter bitwise as in the twin run without that gradient."""
    from galore2.optim import lowrank_batch

    if along:  # every shape batch along the data, as where the grouped kernels run
        monkeypatch.setattr(lowrank_batch, "MIN_ALONG_DATA_ELEMENTS", 0)
    _skipped_as_before(True, False, bad, at, kind, preset)


@pytest.mark.parametrize(("foreach", "capturable"), PATHS)
@pytest.mark.parametrize(("bad", "at", "kind"), CASES)
def test_unusable_gradient_skipped_as_before(
    foreach: bool, capturable: bool, bad: str, at: int, kind: str
) -> None:
    """One unusable gradient at step ``at``: that parameter's weights and state untouched
    and the skip counted; every parameter, after every step, as in a twin run where that
    gradient is absent (bitwise: the same lists through the same arithmetic; masked:
    within :data:`RTOL`, see :func:`_same`). The skips are
    read after each step (with ``capturable=True`` that read sets GaLore's host step counter
    of a masked matrix back, see :mod:`galore2.core.nonfinite`)."""
    _skipped_as_before(foreach, capturable, bad, at, kind)


def _skipped_as_before(
    foreach: bool, capturable: bool, bad: str, at: int, kind: str, preset: str = "GaLoreAdamW"
) -> None:  # fmt: skip
    params, opt = _build(foreach, capturable, preset)
    twin, twin_opt = _build(foreach, capturable, preset)
    for step in range(1, STEPS + 1):
        grads = _grads(params, step)
        for n, g in grads.items():
            params[n].grad = g.clone()
            twin[n].grad = None if (step == at and n == bad) else g.clone()
        if step == at:
            _poison(params[bad].grad, kind)
            weight, state = params[bad].detach().clone(), _state(opt, params[bad])
        opt.step()
        twin_opt.step()
        skips = opt.nonfinite_skips  # a masked step's skips read: its host counters set back
        assert skips == (step >= at)
        if step == at:
            assert torch.equal(params[bad], weight)
            assert _equal_states(_state(opt, params[bad]), state)
        for n in SHAPES:
            assert _same(params[n], twin[n], not capturable), (step, n)
            mine, theirs = _state(opt, params[n]), _state(twin_opt, twin[n])
            assert mine.keys() == theirs.keys()
            for k in mine:
                assert _same(mine[k], theirs[k], not capturable), (step, n, k)
    assert opt.nonfinite_skips == 1
    assert int(opt.state[params[bad]][SKIPS]) == 1


@pytest.mark.parametrize(("foreach", "capturable"), PATHS)
def test_plain_parameter_follows_torch_adamw(foreach: bool, capturable: bool) -> None:
    """The plain matrix (no rank) with a NaN in a projected matrix at step 2 and in itself at
    step 4: stepped as ``torch.optim.AdamW`` (float64) stepped without that gradient."""
    params, opt = _build(foreach, capturable)
    ref = torch.nn.Parameter(params["emb"].detach().clone())
    torch_opt = torch.optim.AdamW([ref], lr=1e-2, weight_decay=0.1, foreach=False)
    for step in range(1, STEPS + 1):
        grads = _grads(params, step)
        for n, g in grads.items():
            params[n].grad = g.clone()
        if step == 2:
            _poison(params["q"].grad, "nan")
        if step == 4:
            _poison(params["emb"].grad, "nan")
        opt.step()
        if step != 4:
            ref.grad = grads["emb"].clone()
            torch_opt.step()
        # float64, the same formula in another order: a few roundings a step, 5 steps
        # (≈ 50 · 2⁻⁵³ ≈ 6e-15 of the weights' scale), bounded by 1e-13
        scale = float(ref.detach().abs().max())
        assert float((params["emb"] - ref).detach().abs().max()) <= 1e-13 * scale, step
    assert opt.nonfinite_skips == 2
