"""The ``compile`` option: Adam's dense math through ``torch.compile`` (fullgraph).

Compiled steps match eager ones to rounding (per tensor and ``foreach=True``, a GaLore
group and a plain group), the compiled functions trace without a graph break, changing
step counts do not recompile, quantized (8-bit) moments keep the eager path, and the option
validates. The compiled functions are shared by the process (``galore2.optim.compiled.compiled``),
so only the first test that steps a layout pays its compilation (a few seconds on a CPU).
"""

from __future__ import annotations

import inspect

import pytest
import torch
from torch._dynamo.eval_frame import _debug_get_cache_entry_list

import galore2
from galore2.optim import compiled as compiled_mod
from galore2.optim.adam import COMPILE, ScaleByAdam
from galore2.optim.adam_paths import adam_math, adam_math_many
from galore2.storage.moments import is_quantized
from tools import options_table

from ..helpers import assert_f32_close, step_on_weight_dependent_grads

SETTINGS = {"lr": 1e-2, "betas": (0.9, 0.999), "eps": 1e-8, "weight_decay": 0.1}
SHAPES = [(24, 16), (16, 24), (20, 20), (30,), (16,)]  # 3 projected matrices, 2 vectors


def _params() -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return [torch.randn(s, generator=g).requires_grad_() for s in SHAPES]


def _run(
    compile_: bool, foreach: bool, steps: int = 6
) -> tuple[list[torch.Tensor], galore2.GaLoreAdamW]:
    """A rank group (refreshed every 3 steps) and a plain group, gradients that depend on
    the weights (a wrong update changes every later gradient)."""
    params = _params()
    opt = galore2.GaLoreAdamW(
        [{"params": params[:3], "rank": 4, "update_proj_gap": 3}, {"params": params[3:]}],
        foreach=foreach,
        compile=compile_,
        **SETTINGS,
    )
    step_on_weight_dependent_grads(opt, params, steps)
    return params, opt


def _compiles(fn) -> int:
    """How many compiled variants dynamo holds for ``fn`` (its code object's cache entries)."""
    return len(_debug_get_cache_entry_list(fn.__code__))


@pytest.mark.parametrize("foreach", [False, True], ids=["per_tensor", "foreach"])
def test_compiled_steps_match_eager_to_rounding(foreach, monkeypatch):
    used = []
    real = compiled_mod.compiled
    monkeypatch.setattr(compiled_mod, "compiled", lambda fn: used.append(fn) or real(fn))
    compiled_params, opt_c = _run(True, foreach)
    assert set(used) == {adam_math_many if foreach else adam_math}  # the compiled path ran
    used.clear()
    eager_params, opt_e = _run(False, foreach)
    assert used == []  # compile=False never touches torch.compile
    for c, e, p0 in zip(compiled_params, eager_params, _params(), strict=True):
        assert (e.detach() - p0).abs().max() > 1e-2  # it trained
        # compiled (inductor's generated kernels) vs eager: the same arithmetic, fused
        assert_f32_close(c.detach(), e.detach(), steps=6)  # _run's 6 steps
    for pc, pe in zip(compiled_params, eager_params, strict=True):
        sc, se = opt_c.state[pc], opt_e.state[pe]
        assert int(sc["adam.step"]) == int(se["adam.step"])
        for key in ("adam.exp_avg", "adam.exp_avg_sq"):
            torch.testing.assert_close(sc[key], se[key], rtol=1e-4, atol=1e-6)


def test_changing_step_counts_do_not_recompile():
    """The bias corrections change every step; they are traced as symbols, not constants:
    at most one compile per number of dimensions (per tensor) and per group (foreach)."""
    before = torch._dynamo.utils.counters["stats"]["unique_graphs"]
    _run(True, False, steps=2)  # compiles what earlier tests did not
    _run(True, True, steps=2)
    warm = torch._dynamo.utils.counters["stats"]["unique_graphs"]
    assert warm - before <= 4
    _run(True, False, steps=10)  # fresh optimizers: step counts 1..10 again
    _run(True, True, steps=10)
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] == warm
    assert 1 <= _compiles(adam_math) <= 2  # 2-D directions, 1-D ones
    assert 1 <= _compiles(adam_math_many) <= 2  # the rank group's batch, the plain group's


def test_8bit_moments_keep_the_eager_path():
    pytest.importorskip("bitsandbytes")

    def run(compile_: bool) -> tuple[list[torch.Tensor], galore2.GaLoreAdamW8bit]:
        g = torch.Generator().manual_seed(0)
        big = torch.randn(96, 64, generator=g).requires_grad_()  # 6144 ≥ 4096: 8-bit moments
        small = torch.randn(16, generator=g).requires_grad_()  # state_dtype moments: compiled
        opt = galore2.GaLoreAdamW8bit([big, small], compile=compile_, **SETTINGS)
        for step in range(4):
            gen = torch.Generator().manual_seed(200 + step)
            for p in (big, small):
                p.grad = torch.randn(p.shape, generator=gen)
            opt.step()
        return [big, small], opt

    (big_c, small_c), opt = run(True)
    (big_e, small_e), _ = run(False)
    assert is_quantized(opt.state[big_c], "adam.exp_avg")
    assert not is_quantized(opt.state[small_c], "adam.exp_avg")
    assert torch.equal(big_c, big_e)  # quantized: both run the eager kernels, bitwise
    assert_f32_close(small_c.detach(), small_e.detach(), steps=4)  # compiled vs eager


def test_past_the_recompile_limit_the_math_runs_eagerly(monkeypatch):
    """A region allowed one variant: a new batch layout is refused (an error under
    fullgraph); the step warns once and finishes eagerly, matching compile=False."""
    if "recompile_limit" not in inspect.signature(torch.compile).parameters:
        pytest.skip("torch.compile has no recompile_limit here")
    tight = torch.compile(adam_math_many, fullgraph=True, dynamic=True, recompile_limit=1)
    monkeypatch.setattr(compiled_mod, "_COMPILED", {adam_math_many: tight})
    monkeypatch.setattr(compiled_mod, "_OVER_LIMIT", set())

    def run(compile_: bool) -> list[torch.Tensor]:
        g = torch.Generator().manual_seed(3)
        params = [torch.randn(n, generator=g).requires_grad_() for n in (5, 6, 7, 8, 9)]
        groups = [{"params": params[:2]}, {"params": params[2:]}]  # 2 layouts: over 1
        opt = galore2.GaLoreAdamW(groups, foreach=True, compile=compile_, **SETTINGS)
        for _ in range(3):
            for p in params:
                p.grad = torch.ones_like(p) + p.detach()
            opt.step()
        return params

    with pytest.warns(RuntimeWarning, match="recompile limit") as caught:
        compiled_params = run(True)
    assert len([w for w in caught if "recompile limit" in str(w.message)]) == 1
    assert {adam_math_many} == compiled_mod._OVER_LIMIT
    for c, e in zip(compiled_params, run(False), strict=True):
        assert_f32_close(c.detach(), e.detach(), steps=3)


def test_compile_is_a_declared_validated_option():
    assert COMPILE in ScaleByAdam.options
    assert galore2.GaLoreAdamW.declared_options()["compile"].default is False
    params = _params()
    assert galore2.GaLoreAdamW(params).param_groups[0]["compile"] is False
    for bad in ("yes", 1, None):
        with pytest.raises(ValueError, match="compile must be a bool"):
            galore2.GaLoreAdamW(params, compile=bad)
    with pytest.raises(ValueError, match="compile"):
        galore2.GaLoreAdamW([{"params": params, "compile": "true"}])
    assert "| `compile` | `False` | a bool |" in options_table.render()


def test_compiled_functions_have_no_graph_break():
    """Last: ``explain`` resets dynamo, dropping the graphs the tests above compiled."""
    u = torch.randn(8, 4)
    scalars = (0.1, 0.999, 0.001, 0.5, 1e-8)
    one = torch._dynamo.explain(adam_math)(u, torch.zeros_like(u), torch.zeros_like(u), *scalars)
    assert (one.graph_count, one.graph_break_count) == (1, 0)
    us = [u, torch.randn(5)]
    many = torch._dynamo.explain(adam_math_many)(
        us, [torch.zeros_like(x) for x in us], [torch.zeros_like(x) for x in us],
        *scalars[:3], [0.5, 0.4], [1e-8, 2e-8],
    )  # fmt: skip
    assert (many.graph_count, many.graph_break_count) == (1, 0)
    # traced from outside (torch.compile(opt.step)), the math joins the caller's graph
    outer = torch._dynamo.explain(compiled_mod.run_compiled)(
        adam_math, u, torch.zeros_like(u), torch.zeros_like(u), *scalars
    )
    assert (outer.graph_count, outer.graph_break_count) == (1, 0)
