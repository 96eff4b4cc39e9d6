"""The masked step (``capturable=True``) keeps the skip path's counts between reads.

``test_masked_property.py`` reads the skips after every step; here nothing is read for
several steps (a run that logs now and then), across refresh steps, so the counters must
be right where the step itself uses them: the device step counters (Adam's bias
corrections, Adafactor's β̂₂, PNM) are put back for a masked parameter after its step, and
GaLore's host step counter, which a masked step advances, is set back by the pending skips
read before any step where a refresh may be due (:meth:`MaskedPath.due_flush`). Over
the presets (GaLoreAdamW, 8-bit, Adafactor, Muon, Ranger21 with stable weight decay, plain
AdamW), a NaN in a projected matrix and in a dense parameter, at steps where a refresh is
due: the masked optimizer and a ``capturable=False`` twin end with the same counters,
refreshes at the same steps, skips counted alike, the masked parameters' weights and state
bitwise where the twin's are, and every weight within :data:`RTOL` (float64; the two paths
differ by rounding only, see ``test_masked_property.py``).
"""

from __future__ import annotations

import copy
import warnings

import pytest
import torch

import galore2
from galore2.core.nonfinite import SKIPS

RTOL = 2.0**-24  # as test_masked_property.py: one float32 rounding (fp32 projections)
SHAPES = {"a": (8, 6), "b": (8, 6), "c": (6, 10), "bias": (6,), "norm": (10,)}
PROJECTED = ("a", "b", "c")
LOW_RANK = {"rank": 4, "update_proj_gap": 2, "projector": "svd"}  # refreshes at 1, 3, 5…
NO_SCHEDULE = {"use_warmup": False, "use_warmdown": False, "use_lookahead": False}
PRESETS = {
    "galore_adamw": ("GaLoreAdamW", True, {"weight_decay": 0.1}),
    "galore_adamw8bit": ("GaLoreAdamW8bit", True, {"weight_decay": 0.1}),
    "galore_adafactor": ("GaLoreAdafactor", True, {}),
    "galore_muon": ("GaLoreMuon", True, {"weight_decay": 0.1}),
    # stable weight decay: σ over the parameters stepped (a masked one left out, as skipped)
    "ranger21": ("Ranger21", False, {**NO_SCHEDULE, "weight_decay": 0.1}),
    "adamw": ("GaLoreAdamW", False, {"weight_decay": 0.1}),
}
STEPS = 7
#: (step, parameter) of each NaN: steps 2 (a refresh step: GaLore's third) and 3, then a
#: second NaN in the same parameter at step 5 (a refresh step): the masked parameter's
#: refresh waits for a usable gradient, as the skip path's does
NANS = {"a": [(2, "a"), (3, "a"), (4, "bias"), (5, "a")], "bias": [(2, "bias"), (3, "c")]}


def _build(preset: str) -> tuple[dict, torch.optim.Optimizer]:
    gen = torch.Generator().manual_seed(3)
    params = {n: torch.nn.Parameter(torch.randn(s, generator=gen, dtype=torch.float64))
              for n, s in SHAPES.items()}  # fmt: skip
    name, low_rank, options = PRESETS[preset]
    if low_rank:
        groups = [{"params": [params[n] for n in PROJECTED], **LOW_RANK},
                  {"params": [params["bias"], params["norm"]]}]  # fmt: skip
    else:
        groups = [{"params": list(params.values())}]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        opt = getattr(galore2, name)(
            groups, capturable=True, foreach=True, lr=1e-2, state_dtype="float64", **options
        )
    return params, opt


def _grads(params: dict, step: int, bad: str | None) -> None:
    for i, (n, p) in enumerate(params.items()):
        gen = torch.Generator().manual_seed(50 * step + i)
        p.grad = torch.randn(p.shape, generator=gen, dtype=torch.float64)
        if n == bad:
            p.grad.view(-1)[0] = float("nan")


def _close(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Within RTOL of ``b``'s largest value, NaN where ``b`` is (a similarity not measured
    yet); 8-bit codes (integers) are compared by :func:`torch.equal` by the caller."""
    nan = b.isnan()
    if not torch.equal(a.isnan(), nan):
        return False
    if not b.numel():
        return True
    a, b = a.masked_fill(nan, 0.0), b.masked_fill(nan, 0.0)
    return bool((a - b).abs().max() <= RTOL * b.abs().max())


@pytest.mark.parametrize("where", list(NANS))
@pytest.mark.parametrize("preset", list(PRESETS))
def test_masked_counts_are_the_skip_counts_between_reads(preset, where):
    params, opt = _build(preset)
    twins, host = copy.deepcopy((params, opt))
    for group in host.param_groups:
        group["capturable"] = False
    nans = dict(NANS[where])
    for step in range(STEPS):
        bad = nans.get(step)
        before = {n: (p.detach().clone(), {k: v.clone() for k, v in opt.state[p].items()})
                  for n, p in params.items()}  # fmt: skip
        twin_before = {n: q.detach().clone() for n, q in twins.items()}
        for ps in (params, twins):
            _grads(ps, step, bad)
        opt.step()
        host.step()
        for n, p in params.items():
            q = twins[n]
            at = f"{preset}: step {step}, {n} (NaN in {bad})"
            # a refresh is counted when it happens (never set back): the same steps
            for key in ("galore.refreshes", "galore.next_refresh"):
                if key in host.state[q]:
                    assert int(opt.state[p][key]) == int(host.state[q][key]), (at, key)
            if n == bad:  # untouched on both paths, bitwise
                assert torch.equal(p.detach(), before[n][0]), at
                assert torch.equal(q.detach(), twin_before[n]), at
                for key, value in opt.state[p].items():
                    if value.is_floating_point():
                        assert torch.equal(value, before[n][1][key]), (at, key)
                    elif key in ("adam.step", "adafactor.step", "pnm.step"):  # put back
                        assert int(value) == int(before[n][1][key]), (at, key)
            else:
                assert _close(p.detach(), q.detach()), at
    # one read, at the end: the skips, and every counter as the skip path left it
    assert opt.nonfinite_skips == host.nonfinite_skips == len(NANS[where])
    for n, p in params.items():
        q = twins[n]
        mine, ref = opt.state[p], host.state[q]
        assert mine.keys() == ref.keys(), n
        for key, value in ref.items():
            if value.is_floating_point():
                assert _close(mine[key].cpu(), value.cpu()), (preset, n, key)
            elif value.dim():  # 8-bit codes: those of the same moments
                assert value.dtype == mine[key].dtype, (preset, n, key)
            else:
                assert int(mine[key]) == int(value), (preset, n, key, int(mine[key]), int(value))
    counts = {n: int(opt.state[p][SKIPS]) for n, p in params.items()}
    expected = {n: sum(1 for _, b in NANS[where] if b == n) for n in params}
    assert counts == expected


def test_no_read_between_refreshes_with_skips_pending():
    """Skips pending, a non-refresh step reads nothing; a step where a refresh may be due
    reads them once (the flush) before the chain, so the schedule is the skip path's."""
    from galore2 import _numerics

    params, opt = _build("galore_adamw")
    reads = []
    real = _numerics.host_list

    def counted(t):
        reads.append(t.numel())
        return real(t)

    _grads(params, 0, None)
    opt.step()  # the first step makes the state (a refresh)
    _grads(params, 1, "bias")
    opt.step()  # masked: a skip pending (a dense parameter: the refresh schedule as it was)
    _numerics.host_list = counted
    try:
        _grads(params, 2, None)  # a refresh step (GaLore's third): the pending skip read first
        opt.step()
        at_refresh = len(reads)
        _grads(params, 3, None)  # a plain step: nothing read
        opt.step()
    finally:
        _numerics.host_list = real
    assert at_refresh == 1
    assert len(reads) == 1
    assert int(opt.state[params["bias"]][SKIPS]) == 1


def test_due_for_refresh_is_the_skip_paths_with_skips_pending():
    """``due_for_refresh()`` (what :class:`galore2.CapturedStep` asks before each step)
    answers the skip path's schedule while skips are pending: a matrix masked at its
    second step is not due at the third, as the others are."""
    params, opt = _build("galore_adamw")
    twins, host = copy.deepcopy((params, opt))
    for group in host.param_groups:
        group["capturable"] = False
    names = {id(p): n for n, p in params.items()} | {id(q): n for n, q in twins.items()}
    for step, bad in enumerate([None, "a"]):
        for ps in (params, twins):
            _grads(ps, step, bad)
        opt.step()
        host.step()
    due = sorted(names[id(p)] for p in opt.due_for_refresh())
    assert due == sorted(names[id(q)] for q in host.due_for_refresh()) == ["b", "c"]
    assert int(opt.state[params["a"]][SKIPS]) == 1  # read for the answer
