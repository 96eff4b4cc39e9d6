"""A roofline of one optimizer step, counted on the CPU: kernels, bytes, matmul FLOPs.

``python -m benchmarks.run --tasks roofline`` (about a minute; ``--quick``: Llama-350M
widths only): for every galore2 preset (:data:`galore2.presets.PRESETS`, built by the
recipe, :func:`recipes.optimizers.build_optimizer`: its parameter split, rank and preset
fields), GaLoreAdamW with ``capturable=True`` and the baseline ``torch.optim.AdamW(fused=True)``,
one non-refresh ``step()`` (after two warm-up steps, ``update_proj_gap`` 10**9) of a Llama
of the widths of recipe config ``llama_350m`` (hidden 1024, ffn 2736, 16 heads, vocab 32000,
rank 256) and ``llama_7b`` (4096 / 11008 / 32 heads, rank 1024) with bf16 weights, on the
path accelerators take by default (``foreach=True``), with 2 and 4 decoder layers.

Nothing is computed: galore2's optimizers step on the meta device (shapes and dtypes only;
value reads answer "usable", see :func:`benchmarks.step_counts.meta_reads`), torch's fused
AdamW on fake CUDA tensors (``FakeTensorMode``: its device check passes, its step counters
live on the device as on a GPU). Counted per step by :class:`RooflineCounter`, a
:class:`~benchmarks.step_counts.StepCounter` (which defines a launch and a sync) that also
measures each launch:

* **bytes** — every tensor argument read once (an in-place op's ``self`` too, but for ops
  that only write it: :data:`WRITE_ONLY`, :data:`WRITE_ONLY_ARGS`; ``out=`` tensors are
  not read), plus what it writes: the arguments its schema marks as written (an in-place
  ``self``, ``out=``) and the outputs that alias no argument, or else its outputs;
  ``_fused_adam(w)_`` writes the weights and both moments. 0-d tensors (step
  counters, scalars) are left out;
* **FLOPs** — 2·m·k·n per matrix product (a batch: times its count) of its last two
  matrix operands (an ``out=`` tensor is not one), by the operands' dtype; float32
  products count as TF32 while ``torch.backends.cuda.matmul.allow_tf32`` is set
  (galore2's ``proj_precision="tf32"``).

From the 2- and 4-layer counts: the **per-layer** increment ((4-layer − 2-layer) / 2), the
**depth-independent** part (2-layer − 2 × per-layer: embeddings, head, final norm, fixed
costs) and the extrapolation to the full depth (24 layers, 32 layers). The predicted H100
time of a step is the largest of kernels × 25 µs (the host's time per eager launch measured
on an H200 machine, :data:`HOST_LAUNCH_S`; the device's own 5 µs is smaller), bytes ÷ 3
TB/s and, per dtype, FLOPs ÷ the dense tensor-core peak (:data:`PEAK`), next to torch fused
AdamW's at the same depth.
Raw figures go to ``results/roofline.json``.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch._subclasses.fake_tensor import FakeTensorMode

from galore2.optim import lowrank_batch
from galore2.presets import PRESETS
from recipes import optimizers
from recipes.config import ModelConfig, OptimConfig
from recipes.model import build_model
from recipes.resolve import parse_args

from ._common import render, table
from .step_counts import MATMULS, Counts, StepCounter, count_step, meta_reads

#: seconds per launch, bytes per second, FLOPs per second by dtype: one H100 SXM (dense)
LAUNCH_S = 5e-6
#: the host's time per launch of an eager step (galore2's own figure, measured on an H200
#: machine: galore2.optim.lowrank_batch.HOST_LAUNCH_S), which a launch-bound step waits for
HOST_LAUNCH_S = lowrank_batch.HOST_LAUNCH_S
BANDWIDTH = 3e12
PEAK = {"bf16": 989e12, "fp16": 989e12, "tf32": 494e12, "fp32": 67e12, "fp64": 67e12}
#: in-place ops that only write ``self`` (it is not read)
WRITE_ONLY = frozenset(
    {"copy_", "zero_", "fill_", "normal_", "uniform_", "random_", "bernoulli_",
     "exponential_", "_foreach_copy_", "_foreach_zero_"}
)  # fmt: skip
#: torch's fused Adam kernels: the arguments they write (weights, exp_avgs, exp_avg_sqs)
FUSED_ADAM = {"_fused_adam_": (0, 2, 3), "_fused_adamw_": (0, 2, 3)}
#: ops whose written arguments (by name) are only written, never read (galore2's custom ops)
WRITE_ONLY_ARGS = {"adam_directions_": frozenset({"outs"}), "mm_each_": frozenset({"outs"}),
                   "project_norms_each": frozenset({"outs"})}  # fmt: skip
#: galore2's grouped matmuls: the arguments holding each entry's two factors and its output
#: (whose dtype the product runs at: a float32 basis is rounded to a bf16 output's)
LIST_MATMULS = {"mm_each_": ("As", "Bs", "outs"), "addmm_each_": ("As", "Bs", "ps"),
                "addmm_scaled_each_": ("As", "Bs", "ps"),
                "residual_norms_each": ("As", "Bs", "Gs"),
                "project_norms_each": ("Gs", "Bs", "outs")}  # fmt: skip
#: grouped ops taking a second product per entry where their argument ``c`` is not 0 (Fira's
#: projection, then P·R for its residual's norms, of the same size; APOLLO's c = 0: G's
#: own norms, no second product)
SECOND_PRODUCT = frozenset({"project_norms_each"})
_DTYPES = {torch.bfloat16: "bf16", torch.float16: "fp16", torch.float32: "fp32",
           torch.float64: "fp64"}  # fmt: skip
#: the recipe configs whose widths and ranks are measured (rank 256, 1024)
WIDTHS = ("llama_350m", "llama_7b")
BASELINE = "torch AdamW (fused)"
LAYERS = (2, 4)


@dataclass
class RooflineCounts(Counts):
    read: int = 0  # bytes
    written: int = 0
    flops: Counter[str] = field(default_factory=Counter)  # by dtype
    copies: list[tuple[tuple[int, ...], str, str]] = field(default_factory=list)  # _to_copy

    @property
    def bytes(self) -> int:
        return self.read + self.written


def _tensors(x: Any) -> list[torch.Tensor]:
    return [t for t in torch.utils._pytree.tree_leaves(x) if isinstance(t, torch.Tensor)]


def _nbytes(ts: list[torch.Tensor]) -> int:
    seen: set[int] = set()
    total = 0
    for t in ts:
        if t.dim() == 0 or id(t) in seen:
            continue
        seen.add(id(t))
        total += t.numel() * t.element_size()
    return total


def _flop_dtype(x: torch.Tensor) -> str:
    """The dtype a product with operand ``x`` runs at (fp32 as TF32 where torch allows it)."""
    dtype = _DTYPES.get(x.dtype, str(x.dtype))
    if dtype == "fp32" and torch.backends.cuda.matmul.allow_tf32:
        return "tf32"
    return dtype


class RooflineCounter(StepCounter):
    """:class:`~benchmarks.step_counts.StepCounter` that also counts each launch's bytes and
    matmul FLOPs (see the module docstring)."""

    def __init__(self, steps: set[int] | None = None) -> None:
        super().__init__(steps)
        self.counts = RooflineCounts(ops=Counter())

    def launched(self, func: Any, args: tuple, kwargs: dict, out: Any) -> None:
        c = self.counts
        assert isinstance(c, RooflineCounts)
        name = func.overloadpacket.__name__
        schema = func._schema.arguments
        values = [*args, *(kwargs.get(a.name) for a in schema[len(args) :])]
        marked = [i for i, a in enumerate(schema) if a.alias_info is not None and a.alias_info.is_write]
        if name in FUSED_ADAM:
            writes = list(FUSED_ADAM[name])
        else:
            writes = marked
        not_read = {i for i in marked if schema[i].kwarg_only}  # out= tensors
        if name in WRITE_ONLY:
            not_read.add(0)
        only = WRITE_ONLY_ARGS.get(name, ())
        not_read |= {i for i in marked if schema[i].name in only}
        reads = [t for i, v in enumerate(values) if i not in not_read for t in _tensors(v)]
        c.read += _nbytes(reads)
        written = [t for i in writes if i < len(values) for t in _tensors(values[i])]
        if writes:  # and the outputs that alias no argument (an op that writes and returns)
            outs = out if isinstance(out, (tuple, list)) else (out,)
            fresh = [o for o, r in zip(outs, func._schema.returns, strict=False)
                     if r.alias_info is None]  # fmt: skip
            written += _tensors(fresh)
        c.written += _nbytes(written if writes else _tensors(out))
        if name == "_to_copy" and args[0].dim() > 0:
            c.copies.append((tuple(args[0].shape), _DTYPES.get(args[0].dtype, str(args[0].dtype)),
                             _DTYPES.get(out.dtype, str(out.dtype))))  # fmt: skip
        if name in LIST_MATMULS:  # one product per entry of the lists
            names = [a.name for a in schema]
            xs, ys, outs = (values[names.index(n)] for n in LIST_MATMULS[name])
            times = 2 if name in SECOND_PRODUCT and values[names.index("c")] != 0 else 1
            for x, y, o in zip(xs, ys, outs, strict=True):
                c.flops[_flop_dtype(o)] += 2 * times * x.numel() * y.shape[-1]
        elif name in MATMULS:  # its factors: an ``out=`` tensor (written, kwarg-only) is not one
            operands = [v for i, v in enumerate(values) if i not in not_read]
            mats = [t for t in _tensors(operands) if t.dim() >= 2]
            if len(mats) >= 2:
                x, y = mats[-2], mats[-1]
                c.flops[_flop_dtype(x)] += 2 * x.numel() * y.shape[-1]


# ---- the models and optimizers -------------------------------------------------------


def galore2_maker(name: str, optim: OptimConfig, **options: Any) -> Callable[[nn.Module], Any]:
    """Preset ``name`` as the recipe builds it (split, rank, preset fields), no refresh after
    the first step, on the batched path (``foreach=True``), with ``options`` but those the
    preset fixes itself (APOLLO's projector)."""
    fixed = PRESETS[name].preset_defaults
    options = {**optim.options, "foreach": True, "update_proj_gap": 10**9,
               **{k: v for k, v in options.items() if k not in fixed},
               **optimizers.preset_fields(name)}  # fmt: skip
    cfg = dataclasses.replace(optim, name=name, options=options)
    return lambda model: optimizers.build_optimizer(model, cfg, 1000)


def fused_adamw_maker(optim: OptimConfig) -> Callable[[nn.Module], Any]:
    """``torch.optim.AdamW(fused=True)`` on the recipe's split (decay on ≥2-D weights)."""
    return lambda model: torch.optim.AdamW(
        optimizers.param_groups(model, optim, False), lr=optimizers.setting(optim, "lr"), fused=True
    )


def rows(optim: OptimConfig, **options: Any) -> list[tuple[str, Callable[[nn.Module], Any]]]:
    """(label, maker) of every galore2 row: each preset, then GaLoreAdamW capturable and with
    bf16 moments (the weights' dtype, as torch keeps them: its plain group can run torch's
    fused kernel) (``options``: see :func:`galore2_maker`)."""
    out = [(cls.__name__, galore2_maker(name, optim, **options)) for name, cls in PRESETS.items()]
    variants = {"capturable=True": {"capturable": True}, "state_dtype=bfloat16":
                {"state_dtype": "bfloat16"}}  # fmt: skip
    for label, extra in variants.items():
        out.append((f"GaLoreAdamW, {label}", galore2_maker("galore_adamw", optim, **extra, **options)))
    return out


def count_galore2(
    make: Callable[[nn.Module], Any], model_cfg: ModelConfig, device: str = "meta"
) -> RooflineCounts:
    """One counted step of ``make`` on the model of ``model_cfg`` (bf16) on ``device``: meta
    (the benchmark: nothing computed), or the CPU (real values: fast at small widths, where
    meta's Python kernels of the warm-up's subspace refresh are the slower)."""
    with meta_reads() if device == "meta" else contextlib.nullcontext():
        model = build_model(model_cfg, device=device, dtype=torch.bfloat16)
        counts = count_step(make, model, mode=RooflineCounter)
    assert isinstance(counts, RooflineCounts)
    return counts


def count_fused(make: Callable[[nn.Module], Any], model_cfg: ModelConfig) -> RooflineCounts:
    """One counted step of torch's optimizer ``make`` on fake CUDA tensors of the model's
    parameters (bf16): torch checks its fused kernels' device, which meta is not."""
    meta = build_model(model_cfg, device="meta", dtype=torch.bfloat16)
    with FakeTensorMode():
        holder = nn.Module()
        holder.params = nn.ParameterList(
            nn.Parameter(torch.empty(p.shape, dtype=p.dtype, device="cuda"))
            for p in meta.parameters()
        )
        counts = count_step(make, holder, mode=RooflineCounter)
    assert isinstance(counts, RooflineCounts)
    return counts


# ---- the figures ------------------------------------------------------------------------


def figures(c: RooflineCounts) -> dict[str, Any]:
    """What a row keeps of one count (``ops``: every dispatched op by name, views too)."""
    return {"kernels": c.launches, "matmuls": c.matmuls, "syncs": c.syncs, "read": c.read,
            "written": c.written, "bytes": c.bytes, "flops": dict(c.flops),
            "to_copy": len(c.copies), "ops": dict(c.ops or {}),
            "copies": dict(Counter(f"{'x'.join(map(str, shape))} {a}->{b}"
                                   for shape, a, b in c.copies))}  # fmt: skip


def extrapolate(
    at: dict[int, dict[str, Any]], depth: int, layers: tuple[int, int] = LAYERS
) -> dict[str, Any]:
    """Per-layer increments, depth-independent part and the figures at ``depth`` layers from
    the counts at 2 and 4 layers (``layers``; ``at[2]``, ``at[4]``)."""
    lo, hi = at[layers[0]], at[layers[1]]
    span = layers[1] - layers[0]

    def split(a: float, b: float) -> tuple[float, float]:
        per = (b - a) / span
        return per, a - layers[0] * per

    out: dict[str, Any] = {}
    for key in ("kernels", "bytes", "syncs"):
        per, fixed = split(lo[key], hi[key])
        out[key] = {"per_layer": per, "fixed": fixed, "total": fixed + depth * per}
    out["flops"] = {}
    for dtype in set(lo["flops"]) | set(hi["flops"]):
        per, fixed = split(lo["flops"].get(dtype, 0), hi["flops"].get(dtype, 0))
        out["flops"][dtype] = {"per_layer": per, "fixed": fixed, "total": fixed + depth * per}
    out["time_s"] = predicted(out)
    return out


def predicted(x: dict[str, Any]) -> float:
    """max(kernels × the host's 25 µs per launch (never less than the device's 5 µs), bytes
    ÷ 3 TB/s, Σ FLOPs ÷ peak of their dtype) at ``x``'s depth."""
    flops = sum(v["total"] / PEAK[d] for d, v in x["flops"].items())
    launch = max(LAUNCH_S, HOST_LAUNCH_S)
    return max(x["kernels"]["total"] * launch, x["bytes"]["total"] / BANDWIDTH, flops)


def measure(
    model_cfg: ModelConfig,
    optim: OptimConfig,
    labels: list[str] | None = None,
    layers: tuple[int, int] = LAYERS,
    **options: Any,
) -> dict[str, Any]:
    """Every row's figures at 2 and 4 layers (``layers``) of ``model_cfg``'s widths and
    their extrapolation to its ``n_layers``, galore2's at ``optim``'s rank (``options``: more
    galore2 options, see :func:`galore2_maker`); ``labels``: only those galore2 rows (the
    baseline always)."""
    depth = model_cfg.n_layers
    out: dict[str, Any] = {"depth": depth, "rank": optimizers.setting(optim, "rank"), "rows": {}}
    for label, make in [(BASELINE, None), *rows(optim, **options)]:
        if labels is not None and make is not None and label not in labels:
            continue
        at = {}
        for n in layers:
            mc = dataclasses.replace(model_cfg, n_layers=n)
            c = count_fused(fused_adamw_maker(optim), mc) if make is None else count_galore2(make, mc)
            at[n] = figures(c)
        out["rows"][label] = {"layers": {str(k): v for k, v in at.items()},
                              **extrapolate(at, depth, layers)}  # fmt: skip
    return out


def _gb(x: float) -> str:
    return f"{x / 1e9:.3f}"


def render_table(result: dict[str, Any]) -> str:
    rows_ = result["rows"]
    base = rows_[BASELINE]
    depth = result["depth"]
    body = []
    for label, r in rows_.items():
        at4 = r["layers"][str(LAYERS[1])]
        flops = ", ".join(f"{d} {v['total'] / 1e9:.0f}" for d, v in sorted(r["flops"].items())
                          if v["total"]) or "0"  # fmt: skip
        body.append([
            label,
            at4["kernels"],
            f"{r['kernels']['per_layer']:g}",
            f"{r['kernels']['total']:.0f}",
            _gb(r["bytes"]["per_layer"]),
            f"{r['bytes']['per_layer'] / base['bytes']['per_layer']:.2f}×",
            _gb(r["bytes"]["fixed"]),
            f"{r['bytes']['fixed'] / base['bytes']['fixed']:.2f}×",
            _gb(r["bytes"]["total"]),
            flops,
            at4["syncs"],
            at4["to_copy"],
            f"{r['time_s'] * 1e3:.2f}",
            f"{r['time_s'] / base['time_s']:.2f}×",
        ])  # fmt: skip
    head = ["optimizer", "kernels (4 layers)", "kernels / layer", f"kernels ({depth} layers)",
            "GB / layer", "÷ fused AdamW", "GB fixed", "÷ fused AdamW", f"GB ({depth} layers)",
            f"GFLOP ({depth} layers)", "syncs", "`_to_copy` (4 layers)",
            f"H100 ms ({depth} layers)", "÷ fused AdamW"]  # fmt: skip
    return table(head, body)


def roofline(quick: bool = False, suite: Any = None) -> str:
    results = {}
    for config in WIDTHS[:1] if quick else WIDTHS:
        cfg = parse_args(["--config", config])
        results[config] = measure(cfg.model, cfg.optim)
    if suite is not None:
        path = Path(suite.raw) / "roofline.json"
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(results, indent=1) + "\n")
    tables = {
        w: render("roofline", "width", config=w, rank=r["rank"], depth=r["depth"],
                  table=render_table(r))
        for w, r in results.items()
    }  # fmt: skip
    return render("roofline", tables="\n\n".join(tables.values()),
                  launch_us=max(LAUNCH_S, HOST_LAUNCH_S) * 1e6, bandwidth=BANDWIDTH / 1e12)  # fmt: skip
