"""galore2.core.packing: same-shape tensors as one stack (a view, or packed once), and the
stacked entries GaLore's inner chain runs on (one op per shape batch, not per matrix)."""

from __future__ import annotations

import io

import pytest
import torch

import galore2
from galore2.core import packing
from galore2.core.transform import StackedState

from ..helpers import assert_f32_close

#: the most steps a test here takes: the step count of the float32 bound between the stacked
#: and the per-tensor paths (tests.helpers.f32_bound)
STEPS = 6


def _tensors(k: int = 4, shape: tuple[int, ...] = (3, 5)) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(0)
    return [torch.randn(shape, generator=gen) for _ in range(k)]


def test_pack_keeps_identity_and_values_and_the_stack_writes_them():
    ts = _tensors()
    ids, values = list(map(id, ts)), [t.clone() for t in ts]
    stack = packing.pack(ts)
    assert list(map(id, ts)) == ids
    assert all(torch.equal(t, v) for t, v in zip(ts, values, strict=True))
    assert {t.untyped_storage().data_ptr() for t in ts} == {stack.untyped_storage().data_ptr()}
    stack.mul_(2.0)
    assert all(torch.equal(t, 2 * v) for t, v in zip(ts, values, strict=True))
    ts[1].add_(1.0)  # and a tensor's write is the stack's
    assert torch.equal(stack[1], 2 * values[1] + 1)


def test_stacked_view_is_a_view_only_of_equally_spaced_tensors():
    buffer = torch.arange(60.0)
    ts = [buffer[i * 15 : i * 15 + 15].view(3, 5) for i in range(4)]
    view = packing.stacked_view(ts)
    assert view is not None and view.shape == (4, 3, 5)
    assert view.data_ptr() == buffer.data_ptr()
    view[2].zero_()
    assert torch.count_nonzero(ts[2]) == 0
    every_other = [buffer[i * 20 : i * 20 + 10].view(2, 5) for i in range(3)]  # gaps: fine
    assert torch.equal(packing.stacked_view(every_other)[1], buffer[20:30].view(2, 5))
    assert packing.stacked_view([ts[0], ts[2], ts[1]]) is None  # out of order
    assert packing.stacked_view([buffer[0:15].view(3, 5), buffer[5:20].view(3, 5)]) is None
    assert packing.stacked_view(_tensors()) is None  # separate storages
    assert packing.stacked_view([ts[0], buffer[15:25].view(2, 5)]) is None  # shapes differ
    assert packing.stacked_view([ts[0], buffer[15:30].double().view(3, 5)]) is None  # storages
    assert packing.stacked_view([buffer[:0], buffer[:0]]) is None  # empty: nothing to stack


def test_as_stacks_views_what_is_stacked_and_packs_the_rest_into_one_buffer():
    a, b = _tensors(3), _tensors(3)
    stacks = packing.as_stacks([a, b])
    assert stacks is not None
    storages = {t.untyped_storage().data_ptr() for t in a + b}
    assert len(storages) == 1  # both lists in one buffer
    again = packing.as_stacks([a, b])  # already stacks: views, nothing moved
    assert again is not None and [s.data_ptr() for s in again] == [s.data_ptr() for s in stacks]
    assert packing.as_stacks([[t.t() for t in _tensors(2)]]) is None  # not contiguous


def test_packed_state_saves_and_loads_with_weights_only():
    ts = _tensors()
    packing.pack(ts)
    buf = io.BytesIO()
    torch.save({i: {"m": t} for i, t in enumerate(ts)}, buf)
    buf.seek(0)
    back = torch.load(buf, weights_only=True)
    assert all(torch.equal(back[i]["m"], t) for i, t in enumerate(ts))


def _model(seed: int = 0) -> torch.nn.Module:
    torch.manual_seed(seed)
    return torch.nn.Sequential(*[torch.nn.Linear(12, 12, bias=False) for _ in range(4)])


def _grads(model: torch.nn.Module, step: int) -> None:
    gen = torch.Generator().manual_seed(step)
    for p in model.parameters():
        p.grad = torch.randn(p.shape, generator=gen)


def _steps(steps: range, *runs: tuple[torch.nn.Module, torch.optim.Optimizer]) -> None:
    """Each (model, optimizer) of ``runs`` steps on the same seeded gradients."""
    for step in steps:
        for model, opt in runs:
            _grads(model, step)
            opt.step()


def _galore(model: torch.nn.Module, **kw) -> torch.optim.Optimizer:
    return galore2.GaLoreAdamW(model.parameters(), lr=1e-2, rank=4, update_proj_gap=50, **kw)


@pytest.mark.parametrize("capturable", [False, True])
def test_galore_inner_chain_runs_a_shape_batch_as_one_stacked_entry(capturable, monkeypatch):
    """The four same-shape matrices' Adam moments end up one stack (views of one buffer),
    Adam sees one stacked entry for them, and the weights equal the per-tensor path's."""
    seen = []
    real = galore2.optim.adam.ScaleByAdam.update_many

    def spy(self, us, states, group, ctxs):
        seen.append([type(s) is StackedState for s in states])
        return real(self, us, states, group, ctxs)

    monkeypatch.setattr(galore2.optim.adam.ScaleByAdam, "update_many", spy)
    batched, single = _model(), _model()
    ob = _galore(batched, foreach=True, capturable=capturable)
    os_ = _galore(single, foreach=False)
    _steps(range(4), (batched, ob), (single, os_))
    assert seen[-1] == [True]  # one stacked entry for the four matrices
    states = [ob.state[p] for p in batched.parameters()]
    ptrs = {s[k].untyped_storage().data_ptr() for s in states for k in ("adam.exp_avg",
                                                                       "adam.exp_avg_sq")}  # fmt: skip
    assert len(ptrs) == 1
    for p, q in zip(batched.parameters(), single.parameters(), strict=True):
        assert_f32_close(p, q, steps=STEPS)
    for p, q in zip(batched.parameters(), single.parameters(), strict=True):
        for key in ("adam.exp_avg", "adam.exp_avg_sq", "adam.step"):
            assert_f32_close(ob.state[p][key].cpu(), os_.state[q][key], steps=STEPS, what=key)


@pytest.mark.parametrize("capturable", [False, True])
def test_a_stack_whose_members_count_different_steps_corrects_each_by_its_own(capturable):
    """Members of one stacked entry with different Adam step counts (a reset, a parameter
    added later) get each its own bias correction, as on the per-tensor path."""
    batched, single = _model(), _model()
    ob = _galore(batched, foreach=True, capturable=capturable)
    os_ = _galore(single, foreach=False)
    _steps(range(3), (batched, ob), (single, os_))
    for opt, model in ((ob, batched), (os_, single)):
        second = list(model.parameters())[1]
        opt.state[second]["adam.step"].fill_(7)  # in place: the stack still holds
    _steps(range(3, 5), (batched, ob), (single, os_))
    for p, q in zip(batched.parameters(), single.parameters(), strict=True):
        assert_f32_close(p, q, steps=STEPS)
    steps = [int(ob.state[p]["adam.step"]) for p in batched.parameters()]
    assert steps == [5, 9, 5, 5]


def test_a_replaced_state_tensor_is_stacked_again():
    """``load_state_dict`` replaces the state tensors: the next step stacks the new ones
    (the old stack is not written), and the run goes on as the uninterrupted one."""
    a, b = _model(), _model()
    oa, ob = _galore(a, foreach=True), _galore(b, foreach=True)
    _steps(range(3), (a, oa), (b, ob))
    buf = io.BytesIO()
    torch.save(ob.state_dict(), buf)
    buf.seek(0)
    ob.load_state_dict(torch.load(buf, weights_only=True))
    _steps(range(3, 6), (a, oa), (b, ob))
    for p, q in zip(a.parameters(), b.parameters(), strict=True):
        assert torch.equal(p, q)


def _mixed_model(seed: int = 0) -> torch.nn.Module:
    """Four 12×12 matrices with a 12×8 one between them: the shape batch is not every
    parameter in order (its flags are picked from the group's)."""
    torch.manual_seed(seed)
    sizes = [(12, 12), (12, 12), (8, 12), (12, 8), (12, 12)]
    return torch.nn.Sequential(*[torch.nn.Linear(i, o, bias=False) for i, o in sizes])


@pytest.mark.parametrize("preset", ["GaLoreAdamW", "Fira", "APOLLO"])
@pytest.mark.parametrize(("make", "at"), [(_model, 2), (_mixed_model, 4)], ids=["batch", "mixed"])
def test_capturable_masking_puts_back_a_stacked_members_state(make, at, preset):
    """``capturable=True`` with a non-finite gradient on one matrix of a stacked shape batch
    (after clean masked steps): its weights and moments (entries of the batch's stacks,
    which Adam masks itself) stay as they were; the others step as the per-tensor
    optimizer's that skips that matrix. GaLoreAdamW masks the low-rank stack before its
    back-projection; Fira's and APOLLO's dense updates are masked as a stack."""
    capt_model, twin = make(), make()
    kw = {"lr": 1e-2, "rank": 4, "update_proj_gap": 50}
    capt = getattr(galore2, preset)(capt_model.parameters(), foreach=True, capturable=True, **kw)
    skip = getattr(galore2, preset)(twin.parameters(), foreach=False, **kw)
    _steps(range(3), (capt_model, capt), (twin, skip))
    bad = list(capt_model.parameters())[at]
    weights = bad.detach().clone()
    moments = {k: v.clone() for k, v in capt.state[bad].items() if v.is_floating_point()}
    _grads(capt_model, 3)
    _grads(twin, 3)
    bad.grad[1, 1] = float("nan")
    list(twin.parameters())[at].grad[1, 1] = float("nan")
    capt.step()
    skip.step()
    assert torch.equal(bad, weights)
    for key, value in moments.items():
        assert torch.equal(capt.state[bad][key], value), key
    for p, q in zip(capt_model.parameters(), twin.parameters(), strict=True):
        assert_f32_close(p, q, steps=STEPS)
    assert capt.nonfinite_skips == skip.nonfinite_skips == 1


@pytest.mark.parametrize("preset", ["GaLoreAdamW", "Fira", "APOLLO"])
def test_gradients_that_are_views_of_one_buffer_are_read_not_written(preset):
    """Gradients that already form a stack (views of one flat buffer, as DDP's bucket views
    are) are projected as that stack, without a copy, and never written: after the step
    they hold what the backward left, and the weights equal those of separate gradients."""
    viewed, separate = _model(), _model()
    make = getattr(galore2, preset)
    kw = {"lr": 1e-2, "rank": 4, "update_proj_gap": 50, "foreach": True}
    ov, os_ = make(viewed.parameters(), **kw), make(separate.parameters(), **kw)
    for step in range(3):
        _grads(separate, step)
        flat = torch.cat([p.grad.flatten() for p in separate.parameters()])
        kept = flat.clone()
        start = 0
        for p in viewed.parameters():
            p.grad = flat[start : start + p.numel()].view(p.shape)
            start += p.numel()
        ov.step()
        os_.step()
        assert torch.equal(flat, kept)
    for p, q in zip(viewed.parameters(), separate.parameters(), strict=True):
        assert_f32_close(p, q, steps=STEPS)


def test_a_stack_re_pointed_by_someone_else_is_made_again():
    """When another owner moves the stacked moments (re-points them at a buffer of its
    own), the next step stacks them where they now are: the moments keep being updated."""
    a, b = _model(), _model()
    oa, ob = _galore(a, foreach=True), _galore(b, foreach=False)
    _steps(range(3), (a, oa), (b, ob))
    # re-pointed in reversed order: not a view of the old stack
    packing.pack([oa.state[p]["adam.exp_avg"] for p in reversed(list(a.parameters()))])
    _steps(range(3, 6), (a, oa), (b, ob))
    for p, q in zip(a.parameters(), b.parameters(), strict=True):
        assert_f32_close(p, q, steps=STEPS)
        assert_f32_close(oa.state[p]["adam.exp_avg"], ob.state[q]["adam.exp_avg"], steps=STEPS)


@pytest.mark.parametrize("projector", ["svd", "random"])
def test_capturable_masking_on_a_refresh_step_puts_back_a_stacked_members_basis(projector):
    """A masked step that is a refresh step (refreshes at steps 1, 3, 5 here) of a stacked
    shape batch: the masked matrix's basis (a random projector's seed too) and all its
    state stay as they were — its zero gradient makes no basis (its refresh waits), and the
    snapshot saves the bases on a refresh step (between refreshes it saves none:
    GaLore.step_masked_keys) — and the others match the skip."""
    kw = {"lr": 1e-2, "rank": 4, "update_proj_gap": 2, "projector": projector}
    capt_model, twin = _model(), _model()
    capt = galore2.GaLoreAdamW(capt_model.parameters(), foreach=True, capturable=True, **kw)
    skip = galore2.GaLoreAdamW(twin.parameters(), foreach=False, **kw)
    _steps(range(4), (capt_model, capt), (twin, skip))
    bad = list(capt_model.parameters())[1]
    weights = bad.detach().clone()
    state = {k: v.clone() for k, v in capt.state[bad].items()}
    _grads(capt_model, 4)
    _grads(twin, 4)
    bad.grad[0, 0] = float("nan")
    list(twin.parameters())[1].grad[0, 0] = float("nan")
    capt.step()
    skip.step()
    assert torch.equal(bad, weights)
    for key, value in state.items():
        if value.is_floating_point() or key == "proj.seed":
            assert torch.equal(capt.state[bad][key], value), key
    for p, q in zip(capt_model.parameters(), twin.parameters(), strict=True):
        assert_f32_close(p, q, steps=STEPS)
