"""Plain AdamW groups on torch's fused kernel (issue 38 item 3): a group without GaLore whose
step is AdamW runs torch's fused AdamW kernel where the group is batched (off the CPU, or
``foreach=True``) or with ``fused=True``, bit for bit ``torch.optim.AdamW(fused=True)``
(here on torch's fused CPU kernel); ``fused=False`` keeps galore2's own Adam. State keys,
non-finite skips and old checkpoints as before."""

from __future__ import annotations

import copy

import pytest
import torch

import galore2
from benchmarks.step_counts import count_step
from galore2.kernels import ops
from galore2.optim.adamw_step import mixed_path, torch_path

SHAPES = [(12, 8), (8,), (5, 3, 2)]
DTYPES = {torch.float32: "float32", torch.bfloat16: "bfloat16"}


def _params(dtype: torch.dtype, seed: int = 0) -> list[torch.nn.Parameter]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.nn.Parameter(torch.randn(s, generator=gen).to(dtype)) for s in SHAPES]


def _grads(params: list[torch.Tensor], step: int) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(100 + step)
    return [torch.randn(p.shape, generator=gen).to(p.dtype) for p in params]


def _twins(dtype, weight_decay, torch_kwargs, galore_kwargs, maximize=False):
    ours, theirs = _params(dtype), _params(dtype)
    opt = galore2.GaLoreAdamW(ours, lr=1e-2, weight_decay=weight_decay, maximize=maximize,
                              state_dtype=DTYPES[dtype], **galore_kwargs)  # fmt: skip
    ref = torch.optim.AdamW(theirs, lr=1e-2, weight_decay=weight_decay, maximize=maximize,
                            **torch_kwargs)  # fmt: skip
    return ours, opt, theirs, ref


def _run(params, opt, steps: int = 5, start: int = 0) -> None:
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0 / (1 + s))  # lr changes
    sched.last_epoch = start  # a resumed run's schedule
    for g in opt.param_groups:
        g["lr"] = g["initial_lr"] / (1 + start)
    for step in range(start, start + steps):
        for p, g in zip(params, _grads(params, step), strict=True):
            p.grad = g
        opt.step()
        sched.step()


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("weight_decay", [0.0, 0.1])
@pytest.mark.parametrize("ours_kwargs", [{"fused": True}, {"foreach": True}],
                         ids=["fused", "foreach"])  # fmt: skip
def test_bitwise_torch_fused_adamw(dtype, weight_decay, ours_kwargs) -> None:
    """``fused=True``, or the batched path (``foreach=True``, as on accelerators)."""
    ours, opt, theirs, ref = _twins(dtype, weight_decay, {"fused": True}, ours_kwargs)
    _run(ours, opt)
    _run(theirs, ref)
    for p, q in zip(ours, theirs, strict=True):
        assert torch.equal(p, q)
    for p, q in zip(ours, theirs, strict=True):
        assert torch.equal(opt.state[p]["adam.exp_avg"], ref.state[q]["exp_avg"])
        assert torch.equal(opt.state[p]["adam.exp_avg_sq"], ref.state[q]["exp_avg_sq"])
        assert int(opt.state[p]["adam.step"]) == int(ref.state[q]["step"]) == 5


def test_maximize_passes_through() -> None:
    ours, opt, theirs, ref = _twins(torch.float32, 0.1, {"fused": True}, {"fused": True},
                                    maximize=True)  # fmt: skip
    _run(ours, opt)
    _run(theirs, ref)
    assert all(torch.equal(p, q) for p, q in zip(ours, theirs, strict=True))


def test_own_adam_with_fused_false_is_not_torch_path() -> None:
    """``fused=False`` keeps galore2's own arithmetic (which rounds apart from torch's: the
    comparison above would catch a path that was not taken)."""
    ours, opt, theirs, ref = _twins(torch.float32, 0.1, {"fused": True},
                                    {"foreach": True, "fused": False})  # fmt: skip
    _run(ours, opt)
    _run(theirs, ref)
    assert not all(torch.equal(p, q) for p, q in zip(ours, theirs, strict=True))
    scale = max(q.abs().max().item() for q in theirs)
    # the same math: float32 rounding of a few ops per step, 5 steps
    assert max((p - q).abs().max().item() for p, q in zip(ours, theirs, strict=True)) <= (
        50 * torch.finfo(torch.float32).eps * scale
    )


def test_paths_chosen() -> None:
    """The rule's choice: torch's fused kernel on the batched path (foreach=True on the CPU,
    any accelerator unless foreach=False) or with fused=True; not with fused=False, not
    on the CPU's per-tensor path, not when the moments are not in the parameter's dtype
    (torch's kernels keep them so)."""
    p = torch.zeros(4, 4)
    state = {"adam.exp_avg": torch.zeros(4, 4), "adam.exp_avg_sq": torch.zeros(4, 4)}
    assert torch_path([p], [p], [state], {"foreach": True})
    assert not torch_path([p], [p], [state], {"foreach": None})
    assert torch_path([p], [p], [state], {"foreach": None, "fused": True})
    assert not torch_path([p], [p], [state], {"foreach": True, "fused": False})
    meta = torch.zeros(4, 4, device="meta")
    meta_state = {k: torch.zeros(4, 4, device="meta") for k in state}
    assert torch_path([meta], [meta], [meta_state], {"foreach": None})
    assert not torch_path([meta], [meta], [meta_state], {"foreach": False})
    bf16 = p.to(torch.bfloat16)
    assert not torch_path([bf16], [bf16], [state], {"foreach": True})  # fp32 moments


def test_bf16_weights_with_fp32_moments_keep_galore2_adam() -> None:
    """torch's kernels keep the moments in the weights' dtype: bf16 weights with the default
    fp32 moments stay on galore2's own Adam (the same results as before)."""
    ours, theirs = _params(torch.bfloat16), _params(torch.bfloat16)
    opt = galore2.GaLoreAdamW(ours, lr=1e-2, foreach=True)
    old = galore2.GaLoreAdamW(theirs, lr=1e-2, foreach=True, fused=False)
    _run(ours, opt)
    _run(theirs, old)
    assert all(torch.equal(p, q) for p, q in zip(ours, theirs, strict=True))


def test_mixed_path_chosen(monkeypatch) -> None:
    """galore2's fused AdamW op for bf16 weights with fp32 moments: on CUDA (meta stands for
    it) where the kernels run, on the batched path; never on the CPU, nor with the kernels
    off (``GALORE2_KERNELS=torch``), nor for other dtypes or moment shapes."""
    monkeypatch.setenv("GALORE2_KERNELS", "auto")

    def tensors(device: str, dtype: torch.dtype = torch.bfloat16, moments=(4, 4)):
        p = torch.zeros(4, 4, dtype=dtype, device=device)
        return p, {k: torch.zeros(moments, device=device)
                   for k in ("adam.exp_avg", "adam.exp_avg_sq")}  # fmt: skip

    p, s = tensors("meta")
    assert mixed_path([p], [p], [s], {"foreach": None}) == ops.triton_would_run()
    assert not mixed_path([p], [p], [s], {"foreach": False})
    assert not mixed_path([p], [p], [s], {"foreach": None, "fused": False})
    cpu, cpu_state = tensors("cpu")
    assert not mixed_path([cpu], [cpu], [cpu_state], {"foreach": True, "fused": True})
    half, half_state = tensors("meta", torch.float16)
    assert not mixed_path([half], [half], [half_state], {"foreach": None})
    flat, flat_state = tensors("meta", moments=(16,))
    assert not mixed_path([flat], [flat], [flat_state], {"foreach": None})
    monkeypatch.setenv("GALORE2_KERNELS", "torch")
    assert not mixed_path([p], [p], [s], {"foreach": None})


@pytest.mark.parametrize("weight_decay", [0.0, 0.1])
def test_mixed_op_torch_path_is_galore2_adam(weight_decay) -> None:
    """The op's torch path (where its kernel does not run) is the step galore2's own Adam
    takes on bf16 weights with fp32 moments (the same kernels: bitwise), at every step."""
    ours, theirs = _params(torch.bfloat16), _params(torch.bfloat16)
    ref = galore2.GaLoreAdamW(theirs, lr=1e-2, weight_decay=weight_decay, foreach=True)
    moments = [(torch.zeros(p.shape), torch.zeros(p.shape)) for p in ours]
    for step in range(4):
        grads = _grads(ours, step)
        for p, g in zip(theirs, grads, strict=True):
            p.grad = g
        ref.step()
        with torch.no_grad():
            ops.adamw_torch(ours, grads, [m for m, _ in moments], [v for _, v in moments],
                            step + 1, 1e-2, 0.9, 0.999, 1e-8, 1 - 1e-2 * weight_decay)  # fmt: skip
        assert all(torch.equal(p, q) for p, q in zip(ours, theirs, strict=True)), step
    for p, (m, v) in zip(theirs, moments, strict=True):
        assert torch.equal(ref.state[p]["adam.exp_avg"], m)
        assert torch.equal(ref.state[p]["adam.exp_avg_sq"], v)


def test_mixed_op_is_one_dispatch_on_meta() -> None:
    """On meta tensors (a count of the GPU step) the op runs nothing and is dispatched once
    per call; a weight and its moments of different shapes is an error naming them."""
    p = torch.empty(3, 5, dtype=torch.bfloat16, device="meta")
    m, v = torch.empty(3, 5, device="meta"), torch.empty(3, 5, device="meta")
    ops.adamw_([p], [p], [m], [v], 1, 1e-2, 0.9, 0.999, 1e-8, 1.0)
    with pytest.raises(ValueError, match=r"adamw_: gradient and moments must have the weight's "
                       r"shape \(3, 5\)"):  # fmt: skip
        ops.adamw_([p], [p], [m.view(15)], [v], 1, 1e-2, 0.9, 0.999, 1e-8, 1.0)


def test_nonfinite_gradient_skipped() -> None:
    """A non-finite gradient never reaches the weights: that parameter is skipped (counted),
    the others take torch's step."""
    ours, opt, theirs, ref = _twins(torch.float32, 0.1, {"fused": True}, {"fused": True})
    before = ours[1].detach().clone()
    grads = _grads(ours, 0)
    for p, q, g in zip(ours, theirs, grads, strict=True):
        p.grad = g.clone()
        q.grad = g.clone()
    ours[1].grad[3] = float("nan")
    theirs[1].grad = None  # torch's step on the usable ones
    opt.step()
    ref.step()
    assert torch.equal(ours[1], before)
    assert opt.nonfinite_skips == 1
    assert torch.equal(ours[0], theirs[0]) and torch.equal(ours[2], theirs[2])


def test_state_dict_unchanged_and_old_checkpoints_load() -> None:
    """The same state keys as galore2's own Adam; a checkpoint written by it (no ``fused`` in
    its groups) loads and continues on torch's fused kernel, bit for bit torch's."""
    ours = _params(torch.float32)
    old_opt = galore2.GaLoreAdamW(ours, lr=1e-2, weight_decay=0.1, foreach=True, fused=False)
    _run(ours, old_opt, steps=3)
    saved = copy.deepcopy(old_opt.state_dict())
    for g in saved["param_groups"]:
        del g["fused"]  # written before the option existed
    new_params = [torch.nn.Parameter(p.detach().clone()) for p in ours]
    new = galore2.GaLoreAdamW(new_params, lr=1e-2, weight_decay=0.1, foreach=True)
    new.load_state_dict(saved)
    assert new.param_groups[0].get("fused") is None
    _run(new_params, new, steps=2, start=3)
    fresh = galore2.GaLoreAdamW(_params(torch.float32), lr=1e-2, weight_decay=0.1, foreach=True)
    _run(list(fresh.param_groups[0]["params"]), fresh, steps=1)
    keys = {k for s in fresh.state.values() for k in s}
    assert keys == {k for s in old_opt.state.values() for k in s}
    assert keys == {k for s in new.state.values() for k in s}
    assert all(int(s["adam.step"]) == 5 for s in new.state.values())
    # bit for bit torch's fused AdamW loaded with the same moments at step 3
    theirs = [torch.nn.Parameter(p.detach().clone()) for p in ours]
    ref = torch.optim.AdamW(theirs, lr=1e-2, weight_decay=0.1, fused=True)
    ref.load_state_dict(_torch_state(saved))
    _run(theirs, ref, steps=2, start=3)
    assert all(torch.equal(p, q) for p, q in zip(new_params, theirs, strict=True))


def _torch_state(saved: dict) -> dict:
    """galore2's AdamW state dict as torch.optim.AdamW's (the same moments, its key names)."""
    state = {
        i: {"step": s["adam.step"].to(torch.float32), "exp_avg": s["adam.exp_avg"],
            "exp_avg_sq": s["adam.exp_avg_sq"]}  # fmt: skip
        for i, s in saved["state"].items()
    }
    groups = [
        {"params": g["params"], "lr": g["lr"], "initial_lr": g["initial_lr"], "betas": g["betas"],
         "eps": g["eps"], "weight_decay": g["weight_decay"], "amsgrad": False,
         "maximize": False, "foreach": None, "capturable": False, "differentiable": False,
         "fused": True, "decoupled_weight_decay": True}  # fmt: skip
        for g in saved["param_groups"]
    ]
    return {"state": state, "param_groups": groups}


def test_plain_group_is_one_fused_launch() -> None:
    """Counted (benchmarks.step_counts, the batched path): the plain group's AdamW step is
    one fused launch per (device, dtype) list plus one fill of the step counters; galore2's
    own Adam takes a zeroing, torch's fused Adam and two foreach launches."""

    def launches(**kwargs):
        model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Linear(16, 4))
        return count_step(lambda m: galore2.GaLoreAdamW(m.parameters(), lr=1e-2,
                                                        weight_decay=0.1, foreach=True,
                                                        **kwargs), model)  # fmt: skip

    fused, own = launches(fused=True), launches(fused=False)
    assert fused.ops is not None and own.ops is not None
    assert fused.ops["_fused_adamw_"] == 1 and fused.ops["full"] == 1
    for op in ("_foreach_lerp_", "_foreach_addcmul_", "_foreach_div", "_foreach_sqrt"):
        assert fused.ops[op] == own.ops[op] == 0, op
    # galore2's own Adam: torch's fused Adam on the moments writing the direction into a
    # zeroed buffer, then the decay and the apply (two foreach launches)
    assert own.ops["_fused_adamw_"] == 0 and own.ops["_fused_adam_"] == 1
    assert own.ops["_foreach_zero_"] == 1 and fused.ops["_foreach_zero_"] == 0
    assert fused.syncs == own.syncs == 1  # the non-finite flags' one read, as before
    # the non-finite check's 4 launches (a norm of the list, stack, compare, cat) + 2
    assert (fused.launches, own.launches) == (6, 9)
