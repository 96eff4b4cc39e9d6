"""The non-finite gradient policy, in one place: the step is check → chain → apply.

A gradient is *unusable* when it holds a NaN or an Inf, or when its sum of squares
overflows the dtype the group's state is kept in (``state_dtype``: the largest float32
is ~3.4e38, so a float32 gradient with one entry ≥ ~1.8e19 counts). The second moments
(Adam's v, Adafactor's row and column means) accumulate g², so such a gradient would
turn them into Inf — and the weights into NaN, or freeze them — although every entry
is finite. A group's ``nonfinite`` option says what happens to a parameter with an
unusable gradient:

* ``"skip"`` (default): the parameter and its state are left untouched this step and the
  skip is counted in the state (``nonfinite.skips``; :attr:`ChainOptimizer.nonfinite_skips`).
  A built-in LR schedule's counter (``schedule.step``, Ranger21's) still ticks: it is the
  group's clock, not a statistic of the parameter;
* ``"raise"``: ``FloatingPointError`` naming the parameters' shapes (and saying whether
  the gradient is non-finite or its sum of squares overflows), raised by
  :meth:`NonFinitePolicy.raise_if_any` before *any* parameter changes in ``step()``,
  which looks at every gradient first. Per-layer updates (:mod:`galore2.core.per_layer`)
  step one parameter at a time inside backward: there the parameter with the unusable
  gradient and every parameter after it in backward order are left unchanged, while
  those stepped before it in that backward pass keep their update;
* ``"ignore"``: no look at all (NaN propagates, as in ``torch.optim.AdamW``).

The test is one reduction per gradient — its L2 norm, a plain sum of squares computed in
float32 (float64 for float64 state), compared with √(largest value of the state dtype) —
kept on the device. On the default path (``capturable=False``) the flags of every group
of a ``step()`` are read together, in one device→host transfer (the step's only
synchronization, see :func:`read_flags`), and the parameters with an unusable gradient
are left out of the step by index: the chain and every kernel see only the others.
``"raise"`` needs that read too, before anything changes. On CUDA a batch whose every
kernel takes the flags reads them a step later instead (:mod:`galore2.core.deferred`): its
kernels write nothing for an unusable gradient's parameter, and the skip is counted and
the step counters set back before anything reads them — the skip's results, bit for bit.

**Folded into the projection** (:meth:`NonFinitePolicy.folds`): on that default path with
``"skip"`` (and state of float32's range or wider), a matrix GaLore projects that is local
(not sharded) and not due for a refresh is tested on its projection R = PᵀG (or G·Q), not
on G: GaLore makes R before the read, for its update, and keeps it for that update
(:meth:`~galore2.core.transform.Transform.screened`, :mod:`galore2.optim.lowrank_screen`).
R is r/m of G's size, so the check reads a quarter of the bytes at rank m/4 instead of
every gradient once more. Which parameters are skipped:

* a NaN or an Inf anywhere in G makes R non-finite (every entry of G enters r products of
  R, and with IEEE products, as cuBLAS, MKL and OpenBLAS compute them, Inf·0 is NaN; the
  basis is finite: a refresh installs only checked bases), so such a gradient is skipped
  exactly as before, with the same counts;
* the overflow test is made on ‖R‖², the sum of squares the low-rank moments accumulate,
  instead of ‖G‖²: a finite G whose projection overflows is treated as non-finite (for an
  orthonormal basis ‖R‖ ≤ ‖G‖, so its ‖G‖² overflowed too and it was skipped before), and
  a finite G whose ‖G‖² overflows float32 (an entry ≥ ~1.8e19) while ‖R‖² does not is now
  stepped — its moments and its update, made from R, stay finite.

A refresh step's matrices (the refresh reads G in full), plain parameters, sharded
matrices, Fira and APOLLO (their residual G − P·R reads G in full), ``"raise"``,
``capturable=True`` (the masked step masks the gradients) and float16 state (its bound is
on ‖g‖, see below) keep the test on G. Either way nothing non-finite reaches weights or
state, and the step keeps its one host read.

``capturable=True`` (as in ``torch.optim``): the flags are not read in the step; it runs
every parameter on its gradient with unusable entries replaced by zeros, then puts back
the weights and device state of those whose gradient was unusable (``torch.where``
against a copy taken before the chain; Adam masks its float32 moments itself:
:meth:`~galore2.core.transform.Transform.masked_keys`), so a non-refresh step makes no
host read (CUDA graphs, no stall), with the skip's semantics and counts:

* a masked parameter's weights and state are as the skip step leaves them (the weight
  modules — norm loss, stable weight decay — leave its weights by its flag, and stable
  weight decay's σ is over the parameters stepped, a masked one left out);
* its step counters do not advance. The rules' counters live on the device then
  (``adam.step``, Adafactor's, PNM's: each rule's ``device_counters``, from which Adam
  computes its bias corrections there) and are put back after the step, like its other
  state (:class:`~galore2.core.masked.CounterSnapshot`). A host counter that the step
  advances for every parameter (a module's ``host_step_counters``: GaLore's
  ``galore.step``) is set back by the parameter's skips when they are read;
* the skips are counted on the device and read — added to ``nonfinite.skips``, the host
  step counters set back — when :attr:`ChainOptimizer.nonfinite_skips` or
  ``state_dict()`` is read (one read there; the recipe reads them at log steps only), a
  checkpoint is loaded, and before a step where a refresh may be due: a host counter
  is never behind the skip path's count, and a refresh is due once the count reaches the
  parameter's next refresh, so where none is due by the host counters none is by the
  skip path's and nothing is read; where one may be, the pending skips are read (one
  read; a refresh step reads each new basis's certificate anyway), and the refresh
  schedule is the skip path's exactly.

What still differs from ``capturable=False``: the arithmetic of the stepped parameters
(the masked step runs galore2's own Adam where the default path may call torch's fused
kernels, and computes the bias corrections on the device: the same values to rounding,
not always the same bits); its cost (the gradients are copied once and masked, the state
the rules do not mask is copied for the step: at Llama-350M widths the roofline counts
about twice the default path's bytes per layer, see :mod:`benchmarks.roofline`), which is
why the default path keeps its one read; and Lookahead (Ranger21's ``use_lookahead``),
which decides on the host every ``lookahead_k`` steps from each parameter's count: a
masked parameter's count advances, and its slow weights may be synchronized at that step.
:class:`galore2.CapturedStep` replays such steps from a CUDA graph.

``state_dtype="float16"``: float16's largest value is 65504, so a gradient counts as
unusable as soon as ‖g‖² > 65504 (‖g‖ > 255.9), summed over the whole tensor: the second
moment of every element then stays finite (Adam's v is a running mean of g², so it holds
|g| ≤ 255.9 per element in steady state; without this check a single step with
(1 − β₂)·g² > 65504 — |g| > ~8.1e3 at β₂ = 0.999 — made v Inf and froze the element for
good). For large tensors this skips steps whose entries are far below 255.9; use
``state_dtype="bfloat16"`` (float32's range, the same memory) instead — a warning says so.

The decision is made on the gradient as the moment chain will see it (after the
gradient modules: AGC, centralization, normalization), before the chain runs, so no
transform ever sees an unusable input and none needs to check. For a sharded
parameter the decision is the whole gradient's: each rank tests its shard and the flags
are combined in one all-reduce, so every rank skips — or raises — together.
"""

from __future__ import annotations

import math
import operator
from collections.abc import Callable, Mapping, Sequence
from typing import Any, ClassVar

import torch
from torch import Tensor

from .. import _numerics
from .._numerics import norms_within
from ..placement import Placement
from .options import Bool, Choice, CrossCheck, Option

NONFINITE = Option(
    "nonfinite",
    "skip",
    Choice(("skip", "raise", "ignore")),
    "a NaN/Inf gradient, or one whose sum of squares overflows the state dtype: skip that "
    "parameter's update (counted), raise, or ignore (no check)",
)

CAPTURABLE = Option(
    "capturable",
    False,
    Bool(),
    "keep the non-finite decision on the device (no host read in a non-refresh step): "
    "updates of unusable gradients are masked out, with the skip's counts and counters; "
    "needs nonfinite 'skip' or 'ignore'",
)

_DTYPE = operator.attrgetter("dtype")

SKIPS = "nonfinite.skips"  # the state key counting a parameter's skipped updates


def state_dtype(group: dict[str, Any]) -> torch.dtype:
    """The dtype a group's moments are kept in: its ``state_dtype`` option (declared by the
    moment modules; its canonical values are torch's dtype names), float32 without one."""
    return getattr(torch, group.get("state_dtype", "float32"))


def usable(
    grads: Sequence[Tensor],
    placements: Sequence[Placement],
    dtype: torch.dtype,
    batched: bool = False,
) -> Tensor:
    """Per local gradient, a bool tensor on their device (no host read): is the whole
    (global) gradient usable with state in ``dtype`` (finite, and no shard's sum of squares
    overflows ``dtype``)? Sharded parameters agree through one all-reduce of their flags;
    call it on every rank together."""
    wide = torch.float64 if dtype == torch.float64 else torch.float32
    ok = norms_within(list(grads), math.sqrt(torch.finfo(dtype).max), wide, batched)
    sharded = [i for i, p in enumerate(placements) if p.distributed]
    if sharded:
        index = torch.tensor(sharded, device=ok.device)
        bad = placements[sharded[0]].any_global(~ok[index])
        ok = ok.index_put((index,), ~bad)
    return ok


def read_flags(flags: Sequence[Tensor | None]) -> list[list[bool] | None]:
    """Several groups' flags in one host read (:func:`galore2._numerics.host_list`): the
    step's one device→host synchronization. None stays None (a group that checks nothing)."""
    present = [f for f in flags if f is not None and f.numel()]
    values = _numerics.host_list(torch.cat(present)) if present else []
    out: list[list[bool] | None] = []
    start = 0
    for f in flags:
        if f is None:
            out.append(None)
            continue
        out.append(values[start : start + f.numel()])
        start += f.numel()
    return out


def _host_sees_raise(group: Mapping[str, Any]) -> None:
    if group["capturable"] and group["nonfinite"] == "raise":
        raise ValueError(
            "capturable=True keeps the non-finite decision on the device, but "
            "nonfinite='raise' needs the host to see it; use nonfinite='skip' (masked "
            "on the device) or 'ignore' with capturable=True"
        )


class NonFinitePolicy:
    """Decides which parameters of a step are updated; see the module docstring.

    The step asks :meth:`check` of every group (device flags, no host read), reads all
    groups' flags at once (:func:`read_flags`) and hands each group's to :meth:`keep`."""

    options: ClassVar[tuple[Option, ...]] = (NONFINITE, CAPTURABLE)
    checks: ClassVar[tuple[CrossCheck, ...]] = (
        CrossCheck(("capturable", "nonfinite"), _host_sees_raise),
    )
    kinds: ClassVar[dict[str, str]] = {SKIPS: "other"}
    #: made at a parameter's first skip: a checkpoint may lack it
    optional_keys: ClassVar[frozenset[str]] = frozenset({SKIPS})

    @staticmethod
    def raise_if_any(
        groups: Sequence[dict[str, Any]],
        items: Callable[[dict[str, Any]], Sequence[tuple[Tensor, Tensor, Placement]]],
    ) -> None:
        """``nonfinite="raise"``: look at every gradient of those groups before any change
        (one host read for all of them).

        ``items(group)`` gives (parameter, gradient, placement) of each parameter to step."""
        checked = []
        for group in groups:
            if group["nonfinite"] != "raise":
                continue
            found = items(group)
            dtype = state_dtype(group)
            local = [pl.local(g) for _, g, pl in found]
            if local:
                flags = usable(local, [pl for *_, pl in found], dtype, _batched(group, local))
                checked.append((found, local, dtype, flags))
        values = read_flags([flags for *_, flags in checked])
        for (found, local, dtype, _), ok in zip(checked, values, strict=True):
            assert ok is not None
            bad = [i for i, f in enumerate(ok) if not f]
            if bad:  # the raise path only: tell NaN/Inf from an overflowing sum of squares
                nonfinite = [i for i in bad if not bool(torch.isfinite(local[i]).all())]
                shapes = [tuple(found[i][0].shape) for i in nonfinite]
                big = [tuple(found[i][0].shape) for i in bad if i not in nonfinite]
                what = [f"non-finite gradient in parameters of shape {shapes}"] if shapes else []
                if big:
                    what.append(
                        f"gradient whose sum of squares overflows {str(dtype)[6:]} (the "
                        f"state dtype) in parameters of shape {big}"
                    )
                raise FloatingPointError(
                    f"{'; '.join(what)} (nonfinite='raise'); use nonfinite='skip' to skip "
                    "such updates instead"
                )

    @staticmethod
    def check(
        group: dict[str, Any], grads: Sequence[Tensor], placements: Sequence[Placement]
    ) -> Tensor | None:
        """Device flags of a group's usable gradients (see the module docstring); None when
        the group checks nothing (``"ignore"``). ``"raise"`` groups were checked before the
        step; they are checked again here, after the gradient modules (a module producing
        NaN is then skipped, like ``"skip"``)."""
        if group["nonfinite"] == "ignore" or not grads:
            return None
        return usable(grads, placements, state_dtype(group), _batched(group, grads))

    @staticmethod
    def check_many(
        requests: Sequence[tuple[dict[str, Any], Sequence[Tensor], Sequence[Placement]]],
    ) -> list[Tensor | None]:
        """:meth:`check` of several groups' (group, gradients, placements) at once: the
        unsharded gradients of groups that share a state dtype, a device and the batched
        reduction go through one :func:`usable` (one ``_foreach_norm``, one compare for all
        of them on an accelerator, not one per group); each group gets its slice (a view).
        Groups with a sharded parameter are checked alone (their flags agree across ranks
        through a collective of their own)."""
        out: list[Tensor | None] = [None] * len(requests)
        together: dict[tuple, list[int]] = {}
        for i, (group, grads, placements) in enumerate(requests):
            if group["nonfinite"] == "ignore" or not grads:
                continue
            if any(p.distributed for p in placements):
                out[i] = NonFinitePolicy.check(group, grads, placements)
                continue
            wide = torch.float64 in set(map(_DTYPE, grads))  # norms_within's own rule
            key = (state_dtype(group), grads[0].device, _batched(group, grads), wide)
            together.setdefault(key, []).append(i)
        for (dtype, _, batched, _), members in together.items():
            grads = [g for i in members for g in requests[i][1]]
            places = [p for i in members for p in requests[i][2]]
            ok = usable(grads, places, dtype, batched)
            sizes = [len(requests[i][1]) for i in members]
            for i, flags in zip(members, ok.split(sizes), strict=True):
                out[i] = flags
        return out

    @staticmethod
    def folds(group: dict[str, Any]) -> bool:
        """Is the group's test folded into its first rule's own work (see the module
        docstring: a projected matrix's R tested instead of its gradient)? On the default
        path only: ``"skip"``, not ``capturable`` (the masked step masks the gradients),
        state in a dtype of float32's range or wider (float16's bound, 255.9 on ‖g‖, is kept
        on the gradient). ``"raise"`` reads every gradient before any change anyway."""
        return (
            group["nonfinite"] == "skip"
            and not group["capturable"]
            and state_dtype(group) != torch.float16
        )

    @staticmethod
    def keep(ok: list[bool] | None, states: Sequence[dict[str, Tensor]]) -> list[bool]:
        """Which of a group's parameters to update, from its read flags (None: all); the
        skip of each one not updated is counted in its state."""
        if ok is None:
            return [True] * len(states)
        for state, f in zip(states, ok, strict=True):
            if not f:
                state[SKIPS] += 1
        return ok


def _batched(group: dict[str, Any], grads: Sequence[Tensor]) -> bool:
    """One foreach reduction for the group: on accelerators, or when it asks (``foreach``)."""
    return bool(group.get("foreach")) or grads[0].device.type != "cpu"
