"""The memory an optimizer step needs beyond weights, gradients and state: measured.

A step's peak lies above what it keeps: torch's foreach AdamW computes √v̂ + eps for the
whole (device, dtype) list at once (one full-size temporary per parameter), galore2's
step holds the projected gradients, their directions and, at a refresh, the bases'
inputs. The planner does not guess these by preset: it runs the step on the meta device
(nothing is allocated) under :class:`LiveBytes`, a ``TorchDispatchMode`` that counts every
storage an op creates on the device and, by a weak reference to the storage, when it is
freed. Its count at any moment is the bytes alive (as the CUDA caching allocator would
hold them, without its 512-byte rounding), whatever code path the optimizer takes, so a
change to the step's kernels shows up in the plan by itself.

:func:`measure` runs two steps (galore2's first one refreshes the bases, the second is an
ordinary step) and returns a :class:`StepMemory`:

* ``held``: bytes the optimizer holds after the steps (every tensor reachable from it)
  beyond the state the planner counts: caches it keeps between steps. Process-wide
  constants (galore2's 8-bit code maps, 2 KB a device) are not counted;
* ``transient``: the peak during the steps minus what is alive after them.

Host reads of meta tensors (galore2's one read of the non-finite flags per step) read
ones: every gradient is usable, so every parameter is stepped. Meta tensors take the
branches a GPU takes (galore2 and torch run single-tensor loops for CPU tensors only), which
is why the step is measured on the meta device and not on small CPU tensors.

The step runs over the root parameters (embeddings, norms, output head) and the first k
decoder layers, for k = 2, 3, 4 (:func:`by_depth`), not the whole model: on the meta
device each op costs a Python meta kernel, and a 32-layer refresh takes minutes. The
bytes alive at each point of the step's code (:class:`LiveBytes` ``phases``: the call
sites of galore2 / torch.optim on the stack, the largest count seen there) grow by the
same bytes per layer, as foreach lists and shape stacks grow by one layer's tensors; so
each point is extrapolated on its own line to the model's L layers and the peak is the
largest of them (the peak may move from the dense parameters' phase at a small depth to
the matrices' phase at L). Where the depths are not on one line, or the points differ
between depths, the step runs over the whole model instead (exact, slower). Per-layer
updates step one parameter at a time (``step_param``; torch AdamW: one optimizer per
parameter, as a post-accumulate-grad hook would run it): their ``transient`` is the
largest of one parameter's.

Rules, not measurements: bitsandbytes' ``AdamW8bit`` (its CUDA kernels update the 8-bit
state in place): 0. Only the torch path of galore2's step runs on the meta device: on a GPU
with Triton, galore2's fused 8-bit Adam kernel writes only the fp32 direction instead of
dequantized moments, so its figure is an upper bound there.
"""

from __future__ import annotations

import gc
import os
import sys
import types
import weakref
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor, nn
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

__all__ = [
    "LiveBytes",
    "StepMemory",
    "TorchAdamW",
    "Trace",
    "by_depth",
    "measure",
    "storage_bytes",
]

_aten = torch.ops.aten
#: depths (decoder layers) the step is measured at before extrapolating: from 2 every
#: shape of a layer has a stack of its own in galore2's batched step
DEPTHS = (2, 3, 4)
#: the code whose call sites name a phase of the step
_OWN = (f"{os.sep}galore2{os.sep}", f"{os.sep}torch{os.sep}optim{os.sep}")
_HERE = __file__


@dataclass(frozen=True)
class StepMemory:
    """Bytes a step needs beyond weights, gradients and state (see the module docstring)."""

    held: int = 0  # kept between steps beyond the counted state
    transient: int = 0  # the step's own peak above what it keeps


@dataclass(frozen=True)
class Trace:
    """One measured run: its :class:`StepMemory`, the bytes alive after it (``end``) and
    the most bytes alive at each phase of the step (``phases``; whole-model steps only)."""

    memory: StepMemory
    end: int
    phases: dict[tuple[tuple[str, int], ...], int]


def storage_bytes(tensors: Iterable[Any], device: torch.device) -> int:
    """Bytes of the distinct storages of ``tensors`` on ``device`` (views counted once)."""
    seen: dict[int, int] = {}
    for t in tensors:
        if isinstance(t, Tensor) and t.device == device:
            st = t.untyped_storage()
            seen[st._cdata] = st.nbytes()
    return sum(seen.values())


def _phase() -> tuple[tuple[str, int], ...]:
    """The call sites of galore2's and torch.optim's code on the stack (this file's left out)."""
    out = []
    frame = sys._getframe(2)
    while frame is not None:
        name = frame.f_code.co_filename
        if name != _HERE and any(x in name for x in _OWN):
            out.append((name, frame.f_lineno))
        frame = frame.f_back
    return tuple(out)


class LiveBytes(TorchDispatchMode):
    """Bytes alive on ``device``: storages :meth:`track`-ed before, plus every storage an op
    creates while the mode is on, each until it is freed. ``now`` and ``peak`` (since
    :meth:`reset_peak`) in bytes; ``phases``: the most bytes alive after an op, by the op's
    call sites (:func:`_phase`). Host reads of meta tensors return ones."""

    def __init__(self, device: torch.device) -> None:
        super().__init__()
        self.device = device
        self.now = 0
        self.peak = 0
        self.phases: dict[tuple[tuple[str, int], ...], int] = {}
        self._live: dict[int, tuple[int, weakref.ref]] = {}

    def track(self, tensors: Iterable[Any]) -> None:
        """Count ``tensors``' storages on the device (those alive before the mode)."""
        for t in tensors:
            if isinstance(t, Tensor) and t.device == self.device:
                st = t.untyped_storage()
                key = st._cdata
                if key not in self._live:
                    n = st.nbytes()
                    self._live[key] = (n, weakref.ref(st, lambda _, k=key: self._free(k)))
                    self.now += n
        self.peak = max(self.peak, self.now)

    def reset_peak(self) -> None:
        self.peak = self.now
        self.phases = {}

    def _free(self, key: int) -> None:
        n, _ = self._live.pop(key)
        self.now -= n

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        meta = [a for a in args[:2] if isinstance(a, Tensor) and a.device.type == "meta"]
        if meta and func is _aten._local_scalar_dense.default:
            return True if args[0].dtype == torch.bool else 1
        if meta and func is _aten._to_copy.default:
            device = kwargs.get("device")
            if device is not None and torch.device(device).type != "meta":
                dtype = kwargs.get("dtype") or args[0].dtype
                return torch.ones(args[0].shape, dtype=dtype, device=device)
        if func is _aten.copy_.default and args[1].device.type == "meta" != args[0].device.type:
            return args[0].fill_(1)
        out = func(*args, **kwargs)
        self.track(tree_flatten(out)[0])
        phase = _phase()
        self.phases[phase] = max(self.phases.get(phase, 0), self.now)
        return out


class TorchAdamW:
    """torch's AdamW step on given tensors, by its functional API (``torch.optim.adamw``,
    the call ``torch.optim.AdamW.step`` makes): ``torch.optim.AdamW`` itself refuses
    ``fused=True`` on the meta device. State is created at the first step as AdamW creates
    it (moments like the parameter; the step on the device for ``fused``, else on the CPU).
    """

    def __init__(self, params: Sequence[Tensor], kernel: str) -> None:
        if kernel not in ("fused", "foreach"):
            raise ValueError(f"kernel must be 'fused' or 'foreach', got {kernel!r}")
        self.params, self.kernel = list(params), kernel
        self.state: dict[Tensor, dict[str, Tensor]] = {}

    @torch.no_grad()
    def step(self, params: Sequence[Tensor] | None = None) -> None:
        ps = [p for p in (self.params if params is None else params) if p.grad is not None]
        if not ps:
            return
        fused = self.kernel == "fused"
        for p in ps:
            if p not in self.state:
                on = p.device if fused else torch.device("cpu")
                self.state[p] = {
                    "step": torch.zeros((), dtype=torch.float32, device=on),
                    "exp_avg": torch.zeros_like(p),
                    "exp_avg_sq": torch.zeros_like(p),
                }
        s = [self.state[p] for p in ps]
        from torch.optim.adamw import adamw  # a submodule torch.optim does not import

        adamw(
            ps, [p.grad for p in ps], [x["exp_avg"] for x in s], [x["exp_avg_sq"] for x in s],
            [], [x["step"] for x in s], foreach=not fused, fused=fused, lr=1e-3, beta1=0.9,
            beta2=0.999, weight_decay=0.01, eps=1e-8, amsgrad=False, maximize=False,
        )  # fmt: skip

    def step_param(self, p: Tensor) -> None:
        """One parameter's step: a per-parameter optimizer in a post-accumulate-grad hook."""
        self.step([p])


def measure(
    opt: Any,
    params: Sequence[Tensor],
    state: int,
    device: torch.device,
    per_layer: bool = False,
) -> Trace:
    """Two steps of ``opt`` over ``params`` (each given a gradient like itself, dropped
    after) under :class:`LiveBytes`; ``state``: the state bytes on ``device`` the planner
    counts for them. ``per_layer``: ``opt.step_param(p)`` twice per parameter, one gradient
    alive at a time.

    Python's cycle collector is off meanwhile: whatever the step leaves in reference cycles
    stays alive until the explicit collections here (objects made while it is off stay in
    the young generation), so the count does not depend on when the collector would run."""
    live = LiveBytes(device)
    live.track([*params, *_state_tensors(opt)])
    units = [[p] for p in params] if per_layer else [list(params)]
    transient, end, phases = 0, 0, {}
    enabled = gc.isenabled()
    gc.disable()
    try:
        with live:
            for unit in units:
                for p in unit:
                    p.grad = torch.empty_like(p)
                live.track([p.grad for p in unit])
                live.reset_peak()
                for _ in range(2):
                    if per_layer:
                        opt.step_param(unit[0])
                    else:
                        opt.step()
                gc.collect(0)
                transient = max(transient, live.peak - live.now)
                end, phases = live.now, live.phases
                for p in unit:
                    p.grad = None
    finally:
        for p in params:
            p.grad = None
        gc.collect(0)
        if enabled:
            gc.enable()
    held = storage_bytes(_kept(opt), device) - state
    return Trace(StepMemory(held, transient), end, {} if per_layer else phases)


def _state_tensors(opt: Any) -> list[Tensor]:
    return [v for s in opt.state.values() for v in s.values() if isinstance(v, Tensor)]


#: objects :func:`_kept` does not look into: code, classes and modules lead to
#: process-wide constants (galore2's 8-bit code maps, cached per device), not to the
#: optimizer's memory
_OPAQUE = (type, types.ModuleType, types.FunctionType, types.BuiltinFunctionType,
           types.MethodType, types.CodeType, types.FrameType, weakref.ref)  # fmt: skip


def _kept(opt: Any) -> list[Tensor]:
    """Every tensor ``opt`` holds (its state, caches, anything reachable from it), but the
    parameters and their gradients."""
    seen: set[int] = set()
    out: list[Tensor] = []
    todo = [opt]
    while todo:
        x = todo.pop()
        if id(x) in seen or isinstance(x, _OPAQUE):
            continue
        seen.add(id(x))
        if isinstance(x, nn.Parameter):
            continue
        if isinstance(x, Tensor):
            out.append(x)
            continue
        todo += gc.get_referents(x)
    return out


def _line(values: Sequence[int], depths: Sequence[int], n: int) -> int | None:
    """The value at ``n`` of the line through (depths, values), None when they are not on
    one line of integer slope."""
    gaps = [(b - a, d - c) for a, b, c, d in zip(values, values[1:], depths, depths[1:])]
    slopes = {dv // dd for dv, dd in gaps}
    if len(slopes) != 1 or any(dv % dd for dv, dd in gaps):
        return None
    return values[0] + (n - depths[0]) * slopes.pop()


def by_depth(
    run: Callable[[int], Trace], n_layers: int, depths: Sequence[int] = DEPTHS
) -> StepMemory:
    """The step's memory with ``n_layers`` decoder layers from ``run(k)`` at ``depths``
    (module docstring), or ``run(n_layers)`` where they do not extrapolate."""
    if n_layers <= depths[-1]:
        return run(n_layers).memory
    traces = [run(k) for k in depths]
    held = _line([t.memory.held for t in traces], depths, n_layers)
    end = _line([t.end for t in traces], depths, n_layers)
    if traces[0].phases:  # the whole step: each phase on its own line
        same = all(t.phases.keys() == traces[0].phases.keys() for t in traces)
        peaks = [_line([t.phases[k] for t in traces], depths, n_layers)
                 for k in traces[0].phases] if same else [None]  # fmt: skip
        peak = None if None in peaks or end is None else max(peaks) - end
    else:  # one parameter at a time: the largest one's
        peak = _line([t.memory.transient for t in traces], depths, n_layers)
    if held is None or peak is None:
        return run(n_layers).memory
    return StepMemory(held, max(peak, 0))
