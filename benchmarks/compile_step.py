"""torch.compile on the CPU: galore2's ``compile=True`` vs eager, and torch AdamW compiled.

``python -m benchmarks.run --tasks compile_step [--rounds N]`` (a few minutes, most of it
compiling): step_time's model (:data:`benchmarks.step_time.FULL_SIZE`: Llama d=256, 4
layers, rank 64, every linear layer but ``lm_head`` projected, non-refresh steps, fixed
seeded gradients); ``--quick``: step_time's quick size.

Contenders, all on the one model (each keeps its own state): torch AdamW (foreach) eager,
and compiled the way torch's docs recommend — ``torch.compile`` of a function that calls
``opt.step()`` (float ``lr``: nothing schedules it here, so no tensor ``lr`` is needed); galore2
GaLoreAdamW with ``compile`` False and True, per tensor (the CPU default) and with
``foreach=True``, and the same four as plain AdamW (``rank=None``), the like-for-like
comparison with torch's compiled AdamW. galore2's ``compile=True`` compiles only Adam's
dense math (:func:`galore2.optim.adam_paths.adam_math`, ``adam_math_many`` for foreach); the
rest of the step (projection, weight decay, the non-finite check, the step counters) stays
eager.

Every optimizer first takes ``WARMUP`` untimed steps: the first creates state, computes
the basis and compiles (its time is reported, and the number of graphs dynamo compiled
during the warm-up: ``torch._dynamo.utils.counters["stats"]["unique_graphs"]``; compiled
graphs are shared by the process, so a contender that runs after another one with the
same shapes may compile nothing). The timed steps are interleaved across optimizers,
``rounds`` rounds of ``steps`` steps, each step timed on its own; the median is reported
(:func:`benchmarks.timing.time_steps`).
The run fails if a timed step compiles anything.

Then ``torch._dynamo.explain(opt.step)()`` (tracing only, no compilation) on fresh
optimizers after two eager steps, with dynamo's recompile limits raised so that no
per-parameter frame goes uncounted: graph breaks of the whole step — galore2's step reads
host-side values (its int counters, the non-finite flags) and breaks there whatever
``compile`` is — with their distinct reasons, and of the compiled functions themselves
(which must have none).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import nn

import galore2
from galore2.optim.adam_paths import adam_math, adam_math_many

from ._common import render, table
from .step_time import FULL_SIZE, GALORE, HPARAMS, QUICK_SIZE, check_no_refresh, model_config
from .timing import llama, median_ms, seeded_grads, time_calls, time_steps

WARMUP = 5
LIMIT = 100_000  # dynamo's recompile limits while explaining (see _explain_rows)
Step = Callable[[], Any]


def _graphs() -> int:
    return int(torch._dynamo.utils.counters["stats"]["unique_graphs"])


def _torch_compiled(opt: torch.optim.Optimizer) -> Step:
    @torch.compile
    def step() -> None:
        opt.step()

    return step


def contenders(model: nn.Module, rank: int) -> dict[str, tuple[torch.optim.Optimizer, Step]]:
    """name → (optimizer, the call that steps it)."""
    params = list(model.parameters())
    groups = galore2.param_groups(model, "all-linear", rank=rank, **GALORE)
    adamw_eager = torch.optim.AdamW(params, foreach=True, **HPARAMS)
    adamw_compiled = torch.optim.AdamW(params, foreach=True, **HPARAMS)
    out: dict[str, tuple[torch.optim.Optimizer, Step]] = {
        "torch AdamW (foreach), eager": (adamw_eager, adamw_eager.step),
        "torch AdamW (foreach), torch.compile(opt.step)": (
            adamw_compiled,
            _torch_compiled(adamw_compiled),
        ),
    }
    for kind, where in (("GaLoreAdamW", groups), ("GaLoreAdamW rank=None (plain)", params)):
        for foreach in (None, True):
            for compile_ in (False, True):
                opt = galore2.GaLoreAdamW(where, foreach=foreach, compile=compile_, **HPARAMS)
                how = ", foreach=True" if foreach else ""
                out[f"galore2 {kind}{how}, compile={compile_}"] = (opt, opt.step)
    return out


def _explain_rows(size: dict[str, int]) -> list[list[Any]]:
    """Graph breaks and graphs of ``torch._dynamo.explain`` of whole steps, then of the
    compiled functions on a direction's shapes."""
    rows = []
    makers: dict[str, Callable[[nn.Module], torch.optim.Optimizer]] = {
        "torch AdamW (foreach)": lambda m: torch.optim.AdamW(
            m.parameters(), foreach=True, **HPARAMS
        ),
    }
    for foreach in (None, True):
        for compile_ in (False, True):
            how = ", foreach=True" if foreach else ""

            def make(m: nn.Module, foreach: bool | None = foreach, c: bool = compile_) -> Any:
                groups = galore2.param_groups(m, "all-linear", rank=size["rank"], **GALORE)
                return galore2.GaLoreAdamW(groups, foreach=foreach, compile=c, **HPARAMS)

            makers[f"galore2 GaLoreAdamW{how}, compile={compile_}"] = make
    for name, make in makers.items():
        model = llama(model_config(size))
        seeded_grads(model)
        opt = make(model)
        for _ in range(2):
            opt.step()
        torch._dynamo.reset()
        # galore2's per-parameter frames guard on the parameter: without a higher limit,
        # dynamo stops tracing them after 8 and explain would undercount the breaks
        with torch._dynamo.config.patch(recompile_limit=LIMIT, accumulated_recompile_limit=LIMIT):
            e = torch._dynamo.explain(opt.step)()
        reasons = sorted({r.reason.splitlines()[0].strip()[:72] for r in e.break_reasons})
        rows.append([f"`opt.step` of {name}", e.graph_count, e.graph_break_count,
                     "; ".join(reasons)])  # fmt: skip
    u = torch.randn(64, 256)
    m, v = torch.zeros_like(u), torch.zeros_like(u)
    scalars = (0.1, 0.999, 0.001, 0.5, 1e-8)
    torch._dynamo.reset()
    e = torch._dynamo.explain(adam_math)(u, m, v, *scalars)
    rows.append(["`adam_math` (compiled per tensor)", e.graph_count, e.graph_break_count, ""])
    us = [u, u[:16]]
    ms, vs = [torch.zeros_like(x) for x in us], [torch.zeros_like(x) for x in us]
    torch._dynamo.reset()
    e = torch._dynamo.explain(adam_math_many)(us, ms, vs, *scalars[:3], [0.5, 0.4], [1e-8, 2e-8])
    rows.append(["`adam_math_many` (compiled foreach)", e.graph_count, e.graph_break_count, ""])
    return rows


def compile_step(quick: bool, rounds: int | None = None) -> str:
    size = QUICK_SIZE if quick else FULL_SIZE
    rounds = rounds or size["rounds"]
    model = llama(model_config(size))
    seeded_grads(model)
    runs = contenders(model, size["rank"])
    first: dict[str, float] = {}
    graphs: dict[str, int] = {}
    for name, (_, step) in runs.items():
        before = _graphs()
        first[name] = time_calls(step, 1)[0]
        for _ in range(WARMUP - 1):
            step()
        graphs[name] = _graphs() - before
    before = _graphs()
    steps = {name: (lambda step=step: step) for name, (_, step) in runs.items()}
    times = time_steps(steps, rounds, size["steps"], warmup=0)
    assert _graphs() == before, "a timed step compiled a graph"
    for opt, _ in runs.values():
        check_no_refresh(opt)
    ms = {name: median_ms(ts) for name, ts in times.items()}
    base = ms["torch AdamW (foreach), eager"]
    ref = ms["torch AdamW (foreach), torch.compile(opt.step)"]
    rows = []
    for name, v in ms.items():
        eager = name.replace("compile=True", "compile=False")
        vs_eager = f"{v / ms[eager]:.2f}×" if eager != name and eager in ms else ""
        rows.append([name, f"{v:.2f}", f"{v / base:.2f}×", f"{v / ref:.2f}×", vs_eager,
                     f"{first[name]:.1f}", graphs[name]])  # fmt: skip
    headers = ["optimizer", "median ms/step", "vs AdamW eager", "vs AdamW compiled",
               "vs its compile=False", "first step s", "graphs compiled"]  # fmt: skip
    explain = table(["traced", "graphs", "graph breaks", "distinct break reasons (first line)"],
                    _explain_rows(size))  # fmt: skip
    return render("compile_step", hidden=size["hidden"], layers=size["layers"],
                  rank=size["rank"], params=sum(p.numel() for p in model.parameters()),
                  warmup=WARMUP, rounds=rounds, steps=size["steps"],
                  threads=torch.get_num_threads(), torch_version=torch.__version__,
                  table=table(headers, rows), explain=explain)  # fmt: skip
