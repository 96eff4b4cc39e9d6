"""The step's own memory in the plan (issue 39 item 15): measured on the meta device by
``galore2.plan.step``, checked against torch AdamW's known temporaries, and the
extrapolation from a few layers against the step over every layer."""

from __future__ import annotations

import os

import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM

from galore2.plan import OPTIMIZERS, Row
from galore2.plan import planner as planner_module
from galore2.plan import step as step_module
from galore2.plan.planner import build, step_memory
from galore2.plan.state import nbytes
from galore2.plan.step import LiveBytes, StepMemory, TorchAdamW, by_depth, measure

#: a small Llama of 5 layers: the plan measures 2, 3 and 4 of them and extrapolates
TINY = {
    "model_type": "llama", "vocab_size": 96, "hidden_size": 32, "intermediate_size": 80,
    "num_hidden_layers": 5, "num_attention_heads": 4, "num_key_value_heads": 2,
    "tie_word_embeddings": False,
}  # fmt: skip
RANK = 4
MEASURED = [n for n in OPTIMIZERS if n != "adamw8bit"]


def model(device: str, layers: int = 5, dtype=torch.bfloat16):
    cfg = AutoConfig.for_model(**{**TINY, "num_hidden_layers": layers})
    with torch.device(device):
        return AutoModelForCausalLM.from_config(cfg).to(dtype)


def params(m) -> list[torch.Tensor]:
    return [p for p in m.parameters() if p.requires_grad]


def test_foreach_adamw_holds_one_temporary_per_parameter_and_fused_none():
    """torch's foreach AdamW computes √v̂ + eps for the whole list at once: the step's
    peak is one parameter-sized temporary per parameter; fused AdamW has none; per-layer
    (one optimizer per parameter) the largest parameter's."""
    m = model("meta")
    sizes = [p.numel() * p.element_size() for p in params(m)]
    n = TINY["num_hidden_layers"]
    foreach = OPTIMIZERS["adamw_foreach"]
    assert step_memory(foreach, m, "all-linear", {"rank": RANK}, False, n) == StepMemory(
        0, sum(sizes)
    )
    assert step_memory(foreach, m, "all-linear", {"rank": RANK}, True, n) == StepMemory(
        0, max(sizes)
    )
    for per_layer in (False, True):
        got = step_memory(OPTIMIZERS["adamw"], m, "all-linear", {"rank": RANK}, per_layer, n)
        assert got == StepMemory(0, 0)


#: measured in the default run (one of each kind of step); the others with -m slow
FAST = ("adamw_foreach", "galore_adamw", "galore_adamw8bit_int4", "apollo_mini")


@pytest.mark.parametrize("per_layer", [False, True])
@pytest.mark.parametrize(
    "name", [n if n in FAST else pytest.param(n, marks=pytest.mark.slow) for n in MEASURED]
)
def test_extrapolated_step_memory_equals_the_step_over_every_layer(name, per_layer, monkeypatch):
    """The plan measures 2, 3 and 4 layers and extrapolates each phase of the step to 5;
    the step run over all 5 layers counts the same bytes."""
    m = model("meta")
    spec = OPTIMIZERS[name]
    planned = step_memory(spec, m, "all-linear", {"rank": RANK}, per_layer, 5)
    calls = []

    def whole(run, n):
        calls.append(n)
        return by_depth(run, n, depths=(n,))

    monkeypatch.setattr(planner_module, "by_depth", whole)
    direct = planner_module._step_memory(spec, m, "all-linear", {"rank": RANK}, per_layer, 5)
    assert calls == [5]
    assert planned == direct
    if name != "adamw":
        assert planned.transient > 0


def test_meta_tensors_take_the_gpu_paths_and_host_reads_read_ones():
    """The step is measured on the meta device, not the CPU: galore2 and torch pick their
    single-tensor loops for CPU tensors (``device.type == "cpu"``) and the foreach / fused
    paths a GPU runs for any other device, meta included. A host read of a meta tensor
    reads ones (every gradient usable)."""
    live = LiveBytes(torch.device("meta"))
    with live:
        flag = torch.empty(3, dtype=torch.bool, device="meta")
        assert flag.tolist() == [True, True, True]
        assert bool(flag.all()) is True
        assert torch.empty((), device="meta").item() == 1
        assert torch.empty(2, device="meta").cpu().tolist() == [1.0, 1.0]
    m = model("meta", layers=2)
    spec = OPTIMIZERS["galore_adamw"]
    meta = measure(build(spec, m, "all-linear", {"rank": RANK}), params(m), 0,
                   torch.device("meta"))  # fmt: skip
    assert meta.memory.transient > 0
    adam = os.path.join("galore2", "optim", "adam.py")  # phases: the step's call sites
    assert any(f.endswith(adam) for phase in meta.phases for f, _ in phase)


def test_live_bytes_counts_views_once_and_frees():
    live = LiveBytes(torch.device("meta"))
    with live:
        x = torch.empty(10, 10, device="meta")  # 400 bytes
        y = x.view(100)  # same storage
        z = torch.empty(5, device="meta", dtype=torch.bfloat16)  # 10 bytes
        assert live.now == 410 and y.numel() == 100
        del x, y
        assert live.now == 10
        del z
    assert (live.now, live.peak) == (0, 410)


def test_torch_adamw_stand_in_is_torch_adamw():
    """``TorchAdamW`` (the functional call, which also runs fused on the meta device) makes
    the same update and state as ``torch.optim.AdamW`` on the CPU."""
    torch.manual_seed(0)
    ws = [torch.randn(4, 3, dtype=torch.float64), torch.randn(5, dtype=torch.float64)]
    grads = [torch.randn_like(w) for w in ws]
    mine = [w.clone().requires_grad_() for w in ws]
    ref = [w.clone().requires_grad_() for w in ws]
    ours = TorchAdamW(mine, "foreach")
    theirs = torch.optim.AdamW(ref, lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.01)
    for _ in range(3):
        for p, q, g in zip(mine, ref, grads, strict=True):
            p.grad, q.grad = g.clone(), g.clone()
        ours.step()
        theirs.step()
    for p, q in zip(mine, ref, strict=True):
        torch.testing.assert_close(p, q, rtol=0, atol=0)
        assert torch.equal(ours.state[p]["exp_avg_sq"], theirs.state[q]["exp_avg_sq"])
    with pytest.raises(ValueError, match="kernel must be 'fused' or 'foreach'"):
        TorchAdamW(mine, "single")


def test_a_rows_total_takes_the_larger_of_activations_and_step():
    row = Row("adamw", False, True, 1, weights=5, gradients=4, state=3, activations=2,
              step=7, held=1)  # fmt: skip
    assert row.total == 5 + 4 + 3 + 1 + 7 and row.peak == 7
    assert Row("adamw", False, True, 1, 5, 4, 3, 9, step=7).total == 5 + 4 + 3 + 9


def test_depths_off_one_line_run_the_whole_model():
    """A phase that does not grow by the same bytes per layer: the step over every layer."""
    from galore2.plan.step import Trace

    def run(k):
        phases = {("a",): 10 * k * k}  # not linear
        return Trace(StepMemory(0, 0), 0, phases) if k != 9 else Trace(StepMemory(0, 5), 0, {})

    assert by_depth(run, 9) == StepMemory(0, 5)

    def linear(k):  # two phases: the smaller one at few layers overtakes at 9
        return Trace(StepMemory(k, 0), 1, {("a",): 100 + k, ("b",): 40 + 10 * k})

    assert by_depth(linear, 9) == StepMemory(9, 40 + 90 - 1)
    assert step_module.DEPTHS == (2, 3, 4)
    assert nbytes([]) == 0


def test_a_measurement_is_reused_for_the_same_shapes_and_settings_only(monkeypatch):
    """A 7B measurement takes minutes: a second plan of the same shapes and settings (another
    world size, a fresh meta model) reuses it; another shape, rank or per-layer choice is
    measured again. The measurement itself is counted, not run (each is seconds of CPU; what
    it returns: test_extrapolated_step_memory_equals_the_step_over_every_layer)."""
    monkeypatch.setattr(planner_module, "_MEASURED", {})
    runs = []

    def counted(*args):
        runs.append(args[4:])
        return StepMemory(len(runs), 0)  # a new object per measurement

    monkeypatch.setattr(planner_module, "_step_memory", counted)
    spec = OPTIMIZERS["galore_adamw"]
    first = step_memory(spec, model("meta"), "all-linear", {"rank": RANK}, False, 5)
    assert step_memory(spec, model("meta"), "all-linear", {"rank": RANK}, False, 5) is first
    assert len(runs) == 1 and first == StepMemory(1, 0)
    step_memory(spec, model("meta"), "all-linear", {"rank": RANK}, True, 5)
    step_memory(spec, model("meta"), "all-linear", {"rank": 2 * RANK}, False, 5)
    step_memory(spec, model("meta", dtype=torch.float32), "all-linear", {"rank": RANK}, False, 5)
    assert len(runs) == 4


@pytest.mark.parametrize("name", ["apollo_mini"])  # its limiter's gather of the flags
def test_a_step_measures_the_same_whatever_ran_before(name, monkeypatch):
    """The plan of a step does not depend on what the process ran before: the plan
    extrapolated from 2, 3 and 4 layers, made once (every cache of the process it fills
    now warm for those depths) and made again, still equals the whole 5-layer step's. A
    process-wide cache filled inside the step (a deferred step's index tensors kept as
    tables) made the second plan miss an upload the 5-layer step made."""
    m = model("meta")
    spec = OPTIMIZERS[name]
    args = (spec, m, "all-linear", {"rank": RANK}, False, 5)
    planner_module._step_memory(*args)  # the 2-, 3- and 4-layer steps once
    real = planner_module.by_depth
    monkeypatch.setattr(planner_module, "by_depth", lambda run, n: real(run, n, depths=(n,)))
    direct = planner_module._step_memory(*args)
    monkeypatch.setattr(planner_module, "by_depth", real)
    assert planner_module._step_memory(*args) == direct
