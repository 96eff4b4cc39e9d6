"""``capturable=True``: the non-finite decision stays on the device (no host read in a
non-refresh step); an unusable gradient's update is masked out, its weights and device
state put back; the skip is counted on the device and shows in ``nonfinite_skips``."""

from __future__ import annotations

import copy
import warnings

import pytest
import torch

import galore2
from benchmarks.contenders import CONTENDERS
from benchmarks.step_counts import contender_maker, count_step
from galore2.core.nonfinite import SKIPS

from ..helpers import TinyNet, assert_f32_close, batch, capturable_twins, galore_groups

# one contender per kind of state and update (test_step_budget.py covers every one by default)
KEYS = ["galore_adamw", "galore_adamw8bit_int4", "galore_adafactor", "galore_ranger21",
        "galore2_fira", "galore2_apollo_mini", "galore2_muon"]  # fmt: skip
assert set(KEYS) <= {c.key for c in CONTENDERS}


@pytest.mark.parametrize(
    "key,foreach", [(k, None) for k in KEYS] + [("galore_adamw", True), ("galore2_fira", True)]
)
def test_no_sync_in_a_capturable_step(key, foreach):
    options = {"capturable": True} | ({} if foreach is None else {"foreach": True})
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        counts = count_step(contender_maker(key, **options))
    assert counts.syncs == 0, (key, counts)


def _grads(model: TinyNet, step: int) -> None:
    x, y = batch(step)
    for p in model.parameters():
        p.grad = None
    (model(x) - y).pow(2).mean().backward()


@pytest.mark.parametrize("foreach", [None, True])  # per tensor; batched (galore2.core.masked)
@pytest.mark.parametrize("bad", [float("nan"), 1e30])  # NaN, and a sum of squares overflowing
# "keep": Adam masks its moments itself; "project": a refresh rotates them, so the snapshot
# saves and puts them back (the masked step here is a refresh step)
@pytest.mark.parametrize("mode", ["keep", "project"])
# the masked step: a plain one (the 4th), a refresh step (the 5th: GaLore refreshes at steps
# 1, 3, 5 here; the basis made from the masked gradient must be put back)
@pytest.mark.parametrize("clean", [3, 4])
def test_masked_step_equals_skip(bad, foreach, mode, clean):
    settings = {"rank": 4, "update_proj_gap": 2, "weight_decay": 0.1, "lr": 1e-2,
                "moments_on_refresh": mode}  # fmt: skip
    model, twin, capt, skip = capturable_twins(foreach, **settings)
    for step in range(clean):  # the same trajectory to rounding
        _grads(model, step)
        _grads(twin, step)
        capt.step()
        skip.step()
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    moments = {k: v.clone() for k, v in capt.state[model.mid.weight].items()}
    refreshes = int(capt.state[model.mid.weight]["galore.refreshes"])
    _grads(model, clean)
    _grads(twin, clean)
    model.mid.weight.grad[0, 0] = bad
    twin.mid.weight.grad[0, 0] = bad
    capt.step()
    skip.step()
    assert torch.equal(model.mid.weight, before["mid.weight"])  # masked: untouched
    for key, value in capt.state[model.mid.weight].items():
        if value.is_floating_point():
            assert torch.equal(value, moments[key]), key
    # Adam's step (a counter, on the device) is put back: the skip path's count
    assert int(capt.state[model.mid.weight]["adam.step"]) == clean
    assert int(skip.state[twin.mid.weight]["adam.step"]) == clean
    # on the 5th step the others refresh; the masked one's zero gradient gives no basis, so
    # its refresh waits (and its old basis is the snapshot's to keep)
    assert int(capt.state[model.mid.weight]["galore.refreshes"]) == refreshes
    for (name, p), q in zip(model.named_parameters(), twin.parameters(), strict=True):
        assert_f32_close(p, q, steps=clean + 1, what=name)
        if name != "mid.weight":
            assert not torch.equal(p, before[name])  # the others were updated
    assert capt.nonfinite_skips == skip.nonfinite_skips == 1
    # the skip read, GaLore's host step counter is set back by it: the skip path's schedule
    for key in ("galore.step", "galore.next_refresh", "galore.refreshes", "adam.step"):
        assert int(capt.state[model.mid.weight][key]) == int(skip.state[twin.mid.weight][key]), key
    order = [id(p) for g in capt.param_groups for p in g["params"]]
    saved = capt.state_dict()["state"][order.index(id(model.mid.weight))]
    assert int(saved[SKIPS]) == 1


@pytest.mark.parametrize(("mode", "saved"), [("keep", False), ("reset", True), ("project", True)])
def test_the_snapshot_leaves_out_what_adam_masks_itself(mode, saved):
    """Adam's float32 moments are masked by Adam (``masked_keys``): the masked step neither
    copies nor puts them back — unless a refresh may reset or rotate them."""
    model = TinyNet()
    opt = galore2.GaLoreAdamW(
        galore_groups(model, rank=4, moments_on_refresh=mode), foreach=True, capturable=True
    )
    _grads(model, 0)
    opt.step()
    names = {name for snapshot in opt._engine.masked.snapshots.values() for name in snapshot.names}
    assert names & {"proj.left", "proj.right"}  # the bases are the snapshot's
    assert ("adam.exp_avg" in names) is saved and ("adam.exp_avg_sq" in names) is saved


@pytest.mark.parametrize("foreach", [None, True])
def test_the_snapshot_puts_back_what_adam_does_not_mask(foreach):
    """bfloat16 moments are the snapshot's (not ``masked_keys``): after a masked step they
    hold their values bitwise, the bases too."""
    settings = {"rank": 4, "update_proj_gap": 2, "lr": 1e-2, "state_dtype": "bfloat16"}
    model, _, capt, _ = capturable_twins(foreach, **settings)
    for step in range(3):
        _grads(model, step)
        capt.step()
    saved = {k: v.clone() for k, v in capt.state[model.mid.weight].items()}
    _grads(model, 3)
    model.mid.weight.grad[0, 0] = float("nan")
    capt.step()
    for key, value in capt.state[model.mid.weight].items():
        if value.is_floating_point():
            assert torch.equal(value, saved[key]), key
    assert capt.state[model.mid.weight]["adam.exp_avg"].dtype == torch.bfloat16


def test_capturable_refuses_raise():
    with pytest.raises(ValueError, match=r"capturable=True .* nonfinite='raise'"):
        galore2.GaLoreAdamW(TinyNet().parameters(), capturable=True, nonfinite="raise")


def test_pending_skips_survive_a_copy():
    model = TinyNet()
    opt = galore2.GaLoreAdamW(model.parameters(), capturable=True)
    _grads(model, 0)
    model.up.weight.grad.fill_(float("nan"))
    opt.step()
    assert copy.deepcopy(opt).nonfinite_skips == 1


@pytest.mark.parametrize("capturable", [False, True])
def test_a_step_keeps_no_gradient_alive(capturable):
    """The step's reused lists (``_gather``) hold parameters and state, never last step's
    gradients: after ``zero_grad(set_to_none=True)`` they are freed."""
    import gc
    import weakref

    torch.manual_seed(0)
    model = TinyNet()
    opt = galore2.GaLoreAdamW(
        galore_groups(model, rank=4, update_proj_gap=2), foreach=True, capturable=capturable
    )
    refs = []
    for step in range(3):
        _grads(model, step)
        refs += [weakref.ref(p.grad) for p in model.parameters()]
        opt.step()
    model.zero_grad(set_to_none=True)
    gc.collect()
    assert all(r() is None for r in refs)


def test_packed_state_is_invisible_to_checkpoints_and_copies():
    """The batched masked step packs a group's same-shape state tensors into one buffer
    (galore2.core.masked): each stays its own tensor object with its values; a checkpoint
    loaded with ``weights_only=True`` into a fresh optimizer, and a deep copy, then run
    bitwise as the original does, each on its own buffer."""
    import io

    # moments reset at a refresh: the snapshot holds Adam's moments too (with "keep", Adam
    # masks them itself and only the bases, three shapes here, are the snapshot's)
    settings = {"rank": 4, "update_proj_gap": 2, "lr": 1e-2, "moments_on_refresh": "reset"}
    model, twin, capt, _ = capturable_twins(True, **settings)
    for step in range(3):
        _grads(model, step)
        capt.step()
    state = [t for p in capt.param_groups[0]["params"] for t in capt.state[p].values()
             if t.is_floating_point()]  # fmt: skip
    storages = {t.untyped_storage().data_ptr() for t in state}
    assert len(storages) == len({(t.shape, t.dtype) for t in state}) < len(state)  # packed
    buf = io.BytesIO()
    torch.save(capt.state_dict(), buf)
    buf.seek(0)
    twin.load_state_dict(model.state_dict())
    restored = galore2.GaLoreAdamW(galore_groups(twin, **settings, foreach=True), capturable=True)
    restored.load_state_dict(torch.load(buf, weights_only=True))
    copied_model, copied = copy.deepcopy((model, capt))
    for step in range(3, 6):
        for m, o in ((model, capt), (twin, restored), (copied_model, copied)):
            _grads(m, step)
            o.step()
    for m in (twin, copied_model):
        for p, q in zip(model.parameters(), m.parameters(), strict=True):
            assert torch.equal(p, q)


def test_snapshot_fits_answers_false_for_another_parameter_at_a_position():
    """Issue 39, 15b: the parameters with a gradient change between steps at the same count
    and the one now at a position has other state keys (a right- vs a left-projected
    matrix): the snapshot is rebuilt (``Snapshot.fits`` answered ``KeyError``), and the
    step is the default path's."""
    torch.manual_seed(0)
    shapes = [(40, 24), (40, 24), (12, 40)]
    ours = [torch.nn.Parameter(torch.randn(s)) for s in shapes]
    theirs = [torch.nn.Parameter(p.detach().clone()) for p in ours]
    capt = galore2.GaLoreAdamW([{"params": ours, "rank": 4}], capturable=True)
    host = galore2.GaLoreAdamW([{"params": theirs, "rank": 4}])
    gen = torch.Generator().manual_seed(1)
    for missing in (1, 2):  # step 1 without b.grad, step 2 without c.grad
        grads = [torch.randn(s, generator=gen) for s in shapes]
        for ps in (ours, theirs):
            for i, (p, g) in enumerate(zip(ps, grads, strict=True)):
                p.grad = None if i == missing else g.clone()
        capt.step()
        host.step()
    for p, q in zip(ours, theirs, strict=True):
        torch.testing.assert_close(p, q, rtol=4 * 2.0**-24, atol=0)


NO_SCHEDULE = {"use_warmup": False, "use_warmdown": False, "use_lookahead": False}


@pytest.mark.parametrize("name", ["Ranger21", "GaLoreRanger21"])
@pytest.mark.parametrize("foreach", [None, True])
def test_ranger21_weight_modules_leave_a_masked_parameter(name, foreach):
    """Issue 39, item 1: norm loss and stable weight decay act on the weights after the
    update; with ``capturable=True`` a parameter whose gradient is NaN keeps its weights
    bitwise (they moved by 8e-3 with these factors), the others move."""
    torch.manual_seed(0)
    model = TinyNet()
    groups = (galore2.param_groups(model, rank=4, update_proj_gap=2)
              if name.startswith("GaLore") else model.parameters())  # fmt: skip
    opt = getattr(galore2, name)(
        groups, capturable=True, foreach=foreach, weight_decay=0.5, norm_loss_factor=0.5,
        lr=1e-2, **NO_SCHEDULE,
    )  # fmt: skip
    for step in range(3):
        _grads(model, step)
        if step == 2:
            model.mid.weight.grad[0, 0] = float("nan")
            model.norm.weight.grad[0] = float("nan")
            before = {n: p.detach().clone() for n, p in model.named_parameters()}
        opt.step()
    for n, p in model.named_parameters():
        assert torch.equal(p, before[n]) is (n in ("mid.weight", "norm.weight")), n


@pytest.mark.parametrize("nan", [False, True])
def test_per_layer_updates_with_capturable(nan):
    """Issue 39, item 9: per-layer updates of a capturable optimizer (``KeyError:
    'proj.left'`` on the first backward) step as the default optimizer's, a NaN gradient
    masked (weights and state kept) where the default skips it."""
    torch.manual_seed(0)
    model = TinyNet().double()
    twin = copy.deepcopy(model)
    updates = []
    for m, capturable in ((model, True), (twin, False)):
        groups = galore2.param_groups(m, rank=4, update_proj_gap=2)
        opt = galore2.GaLoreAdamW(groups, capturable=capturable, weight_decay=0.1)
        updates.append((m, galore2.per_layer(m, opt)))
    for step in range(3):  # the NaN in the last
        before = model.mid.weight.detach().clone()
        for m, up in updates:
            x, y = batch(step)
            loss = (m(x.double()) - y.double()).pow(2).mean()
            if nan and step == 2:
                loss = loss + m.mid.weight[0, 0] * float("nan")
            up.backward(loss)
    assert torch.equal(model.mid.weight, before) is nan
    for p, q in zip(model.parameters(), twin.parameters(), strict=True):
        torch.testing.assert_close(p, q, rtol=1e-9, atol=0)


@pytest.mark.parametrize("foreach", [None, True])
def test_muon_square_matrix_momentum_put_back_with_its_basis_skipped(foreach):
    """Issue 39, item 18: in GaLoreMuon the momentum of a square matrix (m×r) and its right
    basis (n×r) share a shape and dtype (float32 weights: the basis is float32 too), so the
    snapshot packs them into one bucket; on a step with no refresh the bases are left out
    (the rule knows it does not write them) but the momentum is not — the bucket is saved
    and a masked matrix's momentum put back (it decayed by β when the bucket was left
    unsaved because one of its keys was skipped). ``foreach=True``: the group's lists run
    batched (the step knows its refresh schedule); None: per tensor."""
    torch.manual_seed(0)
    square = torch.nn.Parameter(torch.randn(6, 6))
    tall = torch.nn.Parameter(torch.randn(8, 6))  # a second matrix: the group's lists batch
    opt = galore2.GaLoreMuon(
        [{"params": [square, tall], "rank": 4, "update_proj_gap": 3, "projector": "svd"}],
        capturable=True, foreach=foreach, weight_decay=0.1, lr=1e-2,
    )  # fmt: skip
    gen = torch.Generator().manual_seed(1)
    for step in range(3):  # refreshes at the 1st; the NaN at the 2nd and 3rd (no refresh)
        for p in (square, tall):
            p.grad = torch.randn(p.shape, generator=gen)
        if step:
            square.grad[1, 2] = float("nan")
            before = square.detach().clone(), {k: v.clone() for k, v in opt.state[square].items()}
        opt.step()
        if step:
            assert torch.equal(square, before[0])
            state = opt.state[square]
            assert {"muon.momentum", "proj.right"} <= state.keys()
            for key, value in before[1].items():
                if key not in ("adam.step", "galore.step", "muon.step"):  # they advance
                    assert torch.equal(state[key], value), key
    assert opt.nonfinite_skips == 2
