"""CUDA-graph capture of a capturable optimizer's non-refresh steps (:class:`CapturedStep`).

With ``capturable=True`` a non-refresh step reads nothing on the host and makes no tensor
there (Adam counts its steps on the device, the non-finite decision stays there: see
:mod:`galore2.core.nonfinite`), so it can be captured once as a CUDA graph and replayed:
one graph launch instead of the step's Python and kernel launches (torch's capturable
AdamW and Dion's CUDA-graph optimizer do the same). Steps that cannot replay run eagerly:

* refresh steps (a basis is due: the SVD and its checks read the host);
* the first ``warmup`` steps (eagerly on a side stream, as CUDA graphs require), and a step
  whose tensors moved (a parameter's ``.grad`` is a new tensor, ``load_state_dict``) or
  whose group settings changed (``lr``, ``weight_decay``, betas: the graph holds them as
  constants; compared by value, so a tensor ``lr`` an LR scheduler rewrites in place
  counts as changed) — that step is captured again. A scheduler that changes the lr every
  step therefore captures every step; one that changes it every k steps replays between.

What a replay does not run is the host's part of the step: the host-resident counters
(GaLore's ``galore.step``) are advanced by what the captured step added to them, so the
refresh schedule and checkpoints stay exact.

Requirements: every group ``capturable=True``; parameters on CUDA; gradients written into
the same tensors every step (``zero_grad(set_to_none=False)``, or accumulate into them);
modules known to replay correctly (each answers ``capture_problem(group)``: Adam with
``state_dtype`` moments, GaLore with a stored basis — not 8-bit moments, not the seeded
random projector of APOLLO, not a built-in LR schedule). A refusal is a ``ValueError``
raised by the constructor.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from .. import _numerics
from .module import not_known_to_replay
from .transform import walk

#: group keys the graph does not read (everything else is frozen into it)
_NOT_SETTINGS = frozenset({"params", "param_names", "initial_lr", "name"})


def capture_problems(optimizer: Any) -> list[str]:
    """Why ``optimizer``'s non-refresh steps cannot be replayed from a CUDA graph (empty: they
    can, see the module docstring)."""
    problems = []
    for i, group in enumerate(optimizer.param_groups):
        if not group.get("capturable"):
            problems.append(f"param_groups[{i}] has capturable=False")
    if getattr(optimizer, "_schedule", None) is not None:
        problems.append("its built-in LR schedule computes each step's lr on the host")
    modules = list(walk(getattr(optimizer, "_all_modules", ())))
    if not hasattr(optimizer, "_all_modules"):
        problems.append(f"{type(optimizer).__name__} is not a galore2 optimizer")
    for m in modules:
        ask = getattr(m, "capture_problem", None)
        if ask is None:
            problems.append(not_known_to_replay(m))  # not a Module: no default answer
            continue
        for group in optimizer.param_groups:
            why = ask(group)
            if why is not None:
                problems.append(why)
                break
    return list(dict.fromkeys(problems))


class CapturedStep:
    """``optimizer.step()`` captured once as a CUDA graph and replayed; refresh steps eager.

    Call it where ``optimizer.step()`` was called::

        step = galore2.CapturedStep(opt)
        for x, y in data:
            loss_fn(model(x), y).backward()
            step()
            opt.zero_grad(set_to_none=False)  # the graph reads the same .grad tensors

    Args:
        optimizer: a galore2 optimizer whose groups all have ``capturable=True``.
        warmup: eager steps before the first capture (on a side stream).

    Raises:
        ValueError: the optimizer's steps cannot replay (the reasons listed; see the
            module docstring).
    """

    def __init__(self, optimizer: Any, *, warmup: int = 3) -> None:
        problems = capture_problems(optimizer)
        if problems:
            raise ValueError(
                "CapturedStep: this optimizer's steps cannot be replayed from a CUDA graph: "
                + "; ".join(problems)
            )
        if not isinstance(warmup, int) or isinstance(warmup, bool) or warmup < 1:
            raise ValueError(f"CapturedStep: warmup must be an int >= 1, got {warmup!r}")
        self.optimizer = optimizer
        self.warmup = warmup
        self.graph: torch.cuda.CUDAGraph | None = None
        #: steps run eagerly, steps replayed, graphs captured
        self.eager_steps = self.replays = self.captures = 0
        self._warm = 0
        self._checked = 0  # eager steps up to which the state's addresses were checked
        self._tensors: tuple[int, ...] | None = None  # the captured graph's tensors
        self._state: Any = None  # the optimizer's state mapping when captured
        self._grads: list[int] = []
        self._settings: list[dict[str, Any]] | None = None
        self._counters: list[Tensor] = []  # host counters a replay must advance
        self._deltas: list[int] = []
        self._keep: list[Tensor] = []  # constants the graph reads, kept alive

    # ---- the step ------------------------------------------------------------------
    def __call__(self) -> None:
        """One optimizer step: replayed when the captured graph fits it, else eager."""
        opt = self.optimizer
        params = [p for g in opt.param_groups for p in g["params"]]
        if any(p.device.type != "cuda" for p in params):
            raise RuntimeError("CapturedStep: CUDA graphs need every parameter on a CUDA device")
        if any(p.grad is None for p in params) or self._refresh_due():
            self._eager()
            return
        settings = self._group_settings()
        if self.graph is not None and settings == self._settings and self._same_tensors():
            self.graph.replay()
            if self._counters:
                torch._foreach_add_(self._counters, self._deltas)
            self.replays += 1
            return
        if self._warm < self.warmup:
            self._eager(side_stream=True)
            self._warm += 1
            return
        self._capture(settings)

    step = __call__

    def _eager(self, side_stream: bool = False) -> None:
        if side_stream:
            stream = torch.cuda.Stream()
            stream.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(stream):
                self.optimizer.step()
            torch.cuda.current_stream().wait_stream(stream)
        else:
            self.optimizer.step()
        self.eager_steps += 1

    def _capture(self, settings: list[dict[str, Any]]) -> None:
        """Capture one step (its host part runs now, its kernels are recorded), then replay
        it once: that is this step. Host counters it advanced are advanced by replays too."""
        self.graph = None
        torch.cuda.synchronize()
        counters = self._host_counters()
        before = [int(t) for t in counters]
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            self.optimizer.step()
        changed = [(t, int(t) - b) for t, b in zip(counters, before, strict=True) if int(t) != b]
        self._counters = [t for t, _ in changed]
        self._deltas = [d for _, d in changed]
        self._keep = list(_numerics._CONSTANTS.values())
        graph.replay()
        self.graph = graph
        self._tensors = self._identity()
        self._state = self.optimizer.state
        self._grads = self._grad_addresses()
        self._settings = settings
        self.captures += 1
        self._checked = self.eager_steps

    # ---- what the graph depends on ---------------------------------------------------
    def _states(self) -> list[dict[str, Tensor]]:
        opt = self.optimizer
        return [opt.state[p] for g in opt.param_groups for p in g["params"] if p in opt.state]

    def _host_counters(self) -> list[Tensor]:
        return [
            t
            for s in self._states()
            for t in s.values()
            if t.dim() == 0 and not t.is_floating_point() and t.device.type == "cpu"
        ]

    def _refresh_due(self) -> bool:
        """Would the next step refresh a basis or create state (the optimizer's
        ``due_for_refresh``: GaLore's ``refresh_due``, the predicate of its schedule
        (:func:`galore2.optim.refresh.due`) its step uses, edits of ``update_proj_gap``
        re-planned first)? Then it runs eagerly."""
        return bool(self.optimizer.due_for_refresh())

    def _same_tensors(self) -> bool:
        """Does the captured graph still address this step's tensors? Gradients are checked
        at every step; the state and the weights after every eager step (only those change
        them: a refresh writes in place, ``load_state_dict`` replaces the state mapping)."""
        if self.optimizer.state is not self._state or self._grad_addresses() != self._grads:
            return False
        if self._checked < self.eager_steps:
            self._checked = self.eager_steps
            return self._identity() == self._tensors
        return True

    def _grad_addresses(self) -> list[int]:
        return [
            p.grad.data_ptr() if p.grad is not None else 0
            for g in self.optimizer.param_groups
            for p in g["params"]
        ]

    def _identity(self) -> tuple[int, ...]:
        """Addresses of every tensor the step reads or writes: parameters, gradients, state."""
        opt = self.optimizer
        out = []
        for g in opt.param_groups:
            for p in g["params"]:
                out += [p.data_ptr(), p.grad.data_ptr() if p.grad is not None else 0]
                out += [t.data_ptr() for t in opt.state.get(p, {}).values()]
        return tuple(out)

    def _group_settings(self) -> list[dict[str, Any]]:
        """The groups' settings by value: a replay needs them equal to the captured ones."""
        return [
            {k: _frozen(v) for k, v in g.items() if k not in _NOT_SETTINGS}
            for g in self.optimizer.param_groups
        ]


def _frozen(value: Any) -> Any:
    """``value`` as a comparable copy: a tensor by its values (an LR scheduler rewrites a
    tensor ``lr`` in place: the same object, another value — compared as it is, the step
    would replay the lr it was captured with), tuples and lists item by item."""
    if isinstance(value, Tensor):
        return ("tensor", value.dtype, tuple(value.shape), tuple(value.reshape(-1).tolist()))
    if isinstance(value, (tuple, list)):
        return type(value)(_frozen(v) for v in value)
    return value
