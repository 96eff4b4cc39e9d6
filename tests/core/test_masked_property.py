"""Property: a masked step (``capturable=True``) is the skip step (``capturable=False``).

Over which parameters have a gradient at each step (the set changes between steps, also
at the same count), where the unusable gradient is (a projected matrix of either shape
batch, a square one, a member of a two-parameter group of distinct shapes, a dense bias or
norm gain), which rule (GaLoreAdamW with each ``moments_on_refresh``, GaLoreAdafactor,
GaLoreMuon, Fira, APOLLO, GaLoreRanger21, Ranger21; every GaLore preset with a plain group)
and how the group is batched (``foreach``): before every step the capturable optimizer is
copied with ``capturable`` switched off, both step on the same gradients, and then

* every parameter without a usable gradient has its weights and every floating state
  tensor bitwise as they were (the skip path does not touch them; the masked path puts
  them back or masks them);
* the others agree within :data:`RTOL` of each tensor's largest value;
* the counters agree, the step counters of a masked parameter too (device ones are put
  back after its step, host ones set back by its skips when they are read: here by
  ``nonfinite_skips`` after each step);
* the skips are counted for the same parameters.

Float64 parameters and state: the two paths differ by rounding only. Where both batch
the same tensors that is a few units of float64's 2⁻⁵³ per operation; where the skip step
batches differently (a masked matrix leaves its shape batch, whose other members then go
through the per-tensor path) the projections run at ``proj_precision="fp32"``, so one
float32 rounding, 2⁻²⁴ relative, bounds the difference (measured: 7e-9 on APOLLO's norm
limiter). :data:`RTOL` = 2⁻²⁴; a wrong flag moves a value by a step's update (lr = 1e-2
of its scale), five orders of magnitude more.

Stable weight decay is off here (its σ over the parameters stepped, a masked one left out:
``test_masked_counts.py``); Ranger21's masked weights under it and norm loss:
``test_capturable.py``.
"""

from __future__ import annotations

import copy
import warnings

import pytest
import torch
from hypothesis import example, given
from hypothesis import strategies as st

import galore2
from galore2.core.nonfinite import SKIPS

from .test_properties import budget

RTOL = 2.0**-24  # see the module docstring
NAMES = ("t1", "t2", "w1", "w2", "s1", "s2", "p", "q", "bias", "norm")
SHAPES = {
    "t1": (8, 6), "t2": (8, 6),  # tall: right-projected, one shape batch
    "w1": (6, 10), "w2": (6, 10),  # wide: left-projected, a second shape batch
    "s1": (6, 6), "s2": (6, 6),  # square: Muon's momentum and its right basis share a shape
    "p": (10, 6), "q": (6, 8),  # a two-parameter group of distinct shapes (both sides)
    "bias": (6,), "norm": (10,),  # dense: the plain group
}  # fmt: skip
GROUPS = (NAMES[:6], NAMES[6:8], NAMES[8:])
GALORE = {"rank": 4, "update_proj_gap": 2}  # refreshes at steps 1, 3, …: masked ones too
NO_SCHEDULE = {"use_warmup": False, "use_warmdown": False, "use_lookahead": False}
RULES = {
    "galore_adamw": ("GaLoreAdamW", {"weight_decay": 0.1}),
    "galore_adafactor": ("GaLoreAdafactor", {}),
    "galore_adafactor_beta1": ("GaLoreAdafactor", {"beta1": 0.9, "relative_step": False,
                                                   "scale_parameter": False, "lr": 1e-2}),
    "galore_muon": ("GaLoreMuon", {"weight_decay": 0.1}),
    "fira": ("Fira", {}),
    # the norm limiter's 0-d state and the adaptive refresh's similarity share a shape ()
    "fira_adaptive": ("Fira", {"adaptive_refresh": True}),
    "apollo": ("APOLLO", {}),
    "galore_ranger21": ("GaLoreRanger21", {**NO_SCHEDULE, "weight_decay": 0.0,
                                           "norm_loss_factor": 0.5}),
    "ranger21": ("Ranger21", {**NO_SCHEDULE, "weight_decay": 0.0, "norm_loss_factor": 0.5}),
}  # fmt: skip
STEPS = 4


def _build(rule: str, mode: str, foreach: bool | None) -> tuple[dict, torch.optim.Optimizer]:
    gen = torch.Generator().manual_seed(7)
    params = {n: torch.nn.Parameter(torch.randn(SHAPES[n], generator=gen, dtype=torch.float64))
              for n in NAMES}  # fmt: skip
    name, options = RULES[rule]
    low_rank = {} if rule == "ranger21" else {**GALORE, "moments_on_refresh": mode}
    if rule not in ("apollo", "ranger21"):  # exact SVD: fast on these sizes (APOLLO's bases are random)
        low_rank["projector"] = "svd"
    groups = [{"params": [params[n] for n in GROUPS[0]], **low_rank},
              {"params": [params[n] for n in GROUPS[1]], **low_rank},
              {"params": [params[n] for n in GROUPS[2]]}]  # fmt: skip
    extra = {} if foreach is None else {"foreach": foreach}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        opt = getattr(galore2, name)(
            groups, capturable=True, **{"lr": 1e-2, "state_dtype": "float64", **options}, **extra
        )
    return params, opt


def _set_grads(params: dict, step: int, present: frozenset[str], bad: str | None) -> None:
    for i, n in enumerate(NAMES):
        if n not in present:
            params[n].grad = None
            continue
        gen = torch.Generator().manual_seed(100 * step + i)
        g = torch.randn(SHAPES[n], generator=gen, dtype=torch.float64)
        if n == bad:
            g.view(-1)[1] = float("nan")
        params[n].grad = g


def _close(mine: torch.Tensor, ref: torch.Tensor) -> bool:
    """Within RTOL of ``ref``'s largest value, NaN where ``ref`` is (an adaptive refresh's
    similarity before its first measure)."""
    nan = ref.isnan()
    if not torch.equal(mine.isnan(), nan):
        return False
    if not ref.numel():
        return True
    mine, ref = mine.masked_fill(nan, 0.0), ref.masked_fill(nan, 0.0)
    return bool((mine - ref).abs().max() <= RTOL * ref.abs().max())


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Bitwise equal, NaN where the other is NaN."""
    return torch.equal(a.isnan(), b.isnan()) and torch.equal(a.nan_to_num(0.0), b.nan_to_num(0.0))


def run(rule: str, mode: str, foreach: bool | None, steps: list[tuple[frozenset, str | None]]):
    """The property over ``steps`` ((names with a gradient, name with a NaN or None))."""
    params, opt = _build(rule, mode, foreach)
    for step, (present, bad) in enumerate(steps):
        twins, host = copy.deepcopy((params, opt))
        for group in host.param_groups:
            group["capturable"] = False
        before = {n: (p.detach().clone(), {k: v.clone() for k, v in opt.state[p].items()})
                  for n, p in params.items()}  # fmt: skip
        for ps in (params, twins):
            _set_grads(ps, step, present, bad)
        opt.step()
        host.step()
        opt.nonfinite_skips  # noqa: B018 - the device skips flushed into the state
        for n in NAMES:
            p, q = params[n], twins[n]
            where = f"{rule} {mode} foreach={foreach} step {step} {n} (nan in {bad})"
            stepped = n in present and n != bad
            if stepped:
                assert _close(p.detach(), q.detach()), where
            else:
                assert _same(p.detach(), before[n][0]), where
                assert _same(q.detach(), before[n][0]), where
            mine, ref = opt.state[p], host.state[q]
            assert mine.keys() == ref.keys(), where
            for key, value in ref.items():
                got = mine[key]
                if not value.is_floating_point():  # counters
                    assert int(got) == int(value), (where, key, int(got), int(value))
                elif stepped:
                    assert _close(got.cpu(), value.cpu()), (where, key)
                else:  # as it was (or as both made it: a first step's state)
                    assert _same(got, before[n][1].get(key, value)), (where, key)
                    assert _same(value, before[n][1].get(key, value)), (where, key)
                    assert _same(got, value), (where, key)


ALL = frozenset(NAMES)
# the findings of issue 39, each as an explicit example (GaLoreAdamW's moments in the
# snapshot with "reset": Adam does not mask them itself then)
EXAMPLES = {
    # 15b: the parameter at a position changes, with other state keys (left vs right basis)
    "15b": ("galore_adamw", "keep", True,
            [(ALL - {"t2"}, None), (ALL - {"s1"}, None), (ALL - {"t1"}, "w1"), (ALL, None)]),
    # 16: a bucket of one parameter's two tensors in a 2-parameter group (owners [0, 0]):
    # p's Adam moments, the snapshot's on a refresh step (the 3rd) with "reset"
    "16": ("galore_adamw", "reset", True, [(ALL, None), (ALL, "q"), (ALL, "q"), (ALL, None)]),
    # 17: a NaN in a dense parameter (the plain group) that is not the first of its chunk's
    # updates: per tensor (norm: position 1 of a chunk of one) and batched
    "17": ("galore_adamw", "keep", None, [(ALL, None), (ALL, "norm"), (ALL, "bias"), (ALL, None)]),
    "17b": ("galore_adamw", "keep", True, [(ALL, None), (ALL, "norm"), (ALL, "bias"), (ALL, None)]),
    # 18: Muon's momentum of a square matrix and its right basis share a shape: alone in
    # its shape batch (s2 has no gradient), s1's are packed into one snapshot bucket, whose
    # bases are skipped on a non-refresh step (the 2nd) but not its momentum
    "18": ("galore_muon", "keep", None,
           [(ALL - {"s2"}, None), (ALL - {"s2"}, "s1"), (ALL, None), (ALL, "s2")]),
    # 18b: Fira's norm limiter (not skipped) and the similarity (a refresh's only) in one
    # bucket of 0-d tensors, a NaN on a non-refresh step
    "18b": ("fira_adaptive", "keep", None, [(ALL, None), (ALL, "t1"), (ALL, None), (ALL, "w2")]),
    # 19: Adafactor's state of a unique shape (unstacked bucket)
    "19": ("galore_adafactor_beta1", "keep", True,
           [(ALL, None), (ALL, "p"), (ALL, "q"), (ALL, "t2")]),
    # 20: one parameter loses its gradient while another regains it (same count)
    # (t1 and t2 share a shape; then w1 of another shape is the one missing)
    "20": ("galore_adamw", "reset", True,
           [(ALL - {"t1"}, None), (ALL - {"t2"}, "t1"), (ALL - {"w1"}, "s1"), (ALL, "w2")]),
    # 21: a NaN in a member of the second shape batch
    "21": ("fira", "keep", True, [(ALL, None), (ALL, "w2"), (ALL, None), (ALL, "w1")]),
}  # fmt: skip


@pytest.mark.parametrize("finding", list(EXAMPLES))
def test_masked_step_is_the_skip_step_on_each_finding(finding):
    run(*EXAMPLES[finding])


steps_strategy = st.lists(
    st.tuples(st.frozensets(st.sampled_from(NAMES), min_size=1), st.sampled_from((None, *NAMES))),
    min_size=STEPS,
    max_size=STEPS,
)


@budget(12)
@given(
    rule=st.sampled_from(list(RULES)),
    mode=st.sampled_from(["keep", "reset", "project"]),
    foreach=st.sampled_from([None, True]),
    steps=steps_strategy,
)
@example(rule="galore_ranger21", mode="keep", foreach=True,
         steps=[(ALL, None), (ALL, "t1"), (ALL, "norm"), (ALL - {"q"}, "p")])  # fmt: skip
@example(rule="ranger21", mode="keep", foreach=None,
         steps=[(ALL, None), (ALL, "bias"), (ALL, "s1"), (ALL, None)])  # fmt: skip
def test_masked_step_is_the_skip_step(rule, mode, foreach, steps):
    run(rule, mode, foreach, steps)
