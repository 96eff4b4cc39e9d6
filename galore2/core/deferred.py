"""The deferred non-finite path: a step without a host read, with the skip's exact results.

On the default path (``capturable=False``) a ``step()`` reads every group's non-finite
flags in one device→host transfer before it launches anything (:mod:`.nonfinite`): the
host waits for the end of backward, and the optimizer's launches cannot overlap it. On a
GPU whose step is launch-bound that wait is the whole step's host time.

A *deferred* batch does not read its flags. Its kernels take them as ``keep`` flags on the
device (:mod:`galore2.kernels.keep`): a parameter whose gradient is unusable is stepped by
no kernel — its weight, its moments and the other state it would write keep their bits —
and every other parameter gets the bits of the host-indexed step. What the host must still
learn (the skip counts, and the step counters the step advanced for every parameter) is
copied to pinned host memory by a queued copy, and read at the start of the next step
(:meth:`DeferredSkips.settle`): by then that copy has long run (a whole forward and
backward were queued after it), so the read waits for nothing — and where the host is
further ahead, it waits for the previous step's flags only, with this step's forward and
backward still queued: the device never runs dry. The settled counts are the skip path's
exactly: ``nonfinite.skips`` plus one, and the step counters the step advanced (a rule's
``host_step_counters`` and ``device_counters``, host tensors on this path) set back by one,
before anything reads them (the refresh schedule, bias corrections, ``state_dict``,
:attr:`~galore2.core.optimizer.ChainOptimizer.nonfinite_skips`).

A batch defers only where every kernel that writes its state and weights takes the flags
(:meth:`StepEngine._defers <galore2.core.step.StepEngine>`): on a device of
:data:`DEVICES` (CUDA: on the CPU a read costs nothing, and the CPU keeps its own
arithmetic), ``nonfinite="skip"`` without ``capturable``, no weight modules, local tensors;
then the plain AdamW group on galore2's fused AdamW op, and GaLore's shape batches along the
data on the grouped kernels with Adam's bf16 directions (the rules' ``defers``). Everything
else reads its flags as before, in the same one read per step.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from typing import Any

import torch
from torch import Tensor

from .. import _numerics
from .module import Context
from .nonfinite import SKIPS
from .transform import FACTORED

#: the device types whose batches may defer: CUDA, and meta (a count of the CUDA step);
#: tests add "cpu", with Triton's interpreter
DEVICES: frozenset[str] = frozenset({"cuda", "meta"})


def active(device: torch.device) -> bool:
    """May a batch on ``device`` defer its flags?"""
    return device.type in DEVICES


class DeferredSkips:
    """The flags of deferred batches, read one step later (see the module docstring).

    ``optimizer`` is read for its ``state``; ``counters`` are the step counters a step
    advances for every parameter it runs (set back for a skipped one when settled)."""

    def __init__(self, optimizer: Any, counters: Iterable[str]) -> None:
        self.opt = optimizer
        self.counters = tuple(counters)
        self.pending: list[tuple[list[Tensor], Tensor, Any]] = []

    def record(self, batches: list[tuple[list[Tensor], Tensor]]) -> None:
        """Queue the copy of deferred batches' flags (per batch: its parameters and ``ok``,
        one bool each, on their device) to the host, read by :meth:`settle`: one launch per
        tensor the flags are views of (every group's flags of a step are views of one
        tensor: :meth:`~galore2.core.nonfinite.NonFinitePolicy.check_many`). On meta tensors
        (a count of the CUDA step: :mod:`benchmarks.roofline`) the copies are counted and
        nothing is read: a meta step has no values."""
        copies: dict[int, tuple[Tensor, Any]] = {}
        for owners, ok in batches:
            base = ok if ok._base is None else ok._base
            found = copies.get(id(base))
            if found is None:
                found = copies[id(base)] = self._copy(base)
            host, done = found
            if host is not None:
                at = ok.storage_offset() - base.storage_offset()
                self.pending.append((list(owners), host[at : at + ok.numel()], done))

    @staticmethod
    def _copy(flags: Tensor) -> tuple[Tensor | None, Any]:
        """``flags`` copied to the host: (pinned copy, its event) on CUDA — queued, never
        waited for here; the flags themselves on the CPU; (None, None) on meta."""
        if flags.device.type == "meta":
            torch.empty_like(flags).copy_(flags)  # stands for the device→host copy
            return None, None
        if flags.device.type != "cuda":
            return flags, None
        host = torch.empty(flags.shape, dtype=flags.dtype, pin_memory=True)
        host.copy_(flags, non_blocking=True)
        done = torch.cuda.Event()
        done.record()
        return host, done

    def settle(self) -> None:
        """Add the recorded skips to the state: per parameter whose gradient was unusable,
        ``nonfinite.skips`` plus one and :attr:`counters` minus one — what the host-indexed
        step leaves. One read of host memory per recorded batch (after its copy ran)."""
        pending, self.pending = self.pending, []
        for owners, host, done in pending:
            if done is not None:
                done.synchronize()  # the previous step's copy: queued before its kernels
            for p, usable in zip(owners, _numerics.host_list(host), strict=True):
                if usable:
                    continue
                state = self.opt.state.get(p)
                if not state:  # a state replaced since (load_state_dict): nothing to count
                    continue
                state[SKIPS] += 1
                for key in self.counters:
                    if key in state:
                        state[key] -= 1  # in place: a packed counter stays in its pack


def flagged(u: Any) -> bool:
    """Does a deferred step's update carry its flags to the kernel that applies it (a
    factored update of a shape batch — low-rank, APOLLO's scaled gradient, Fira's sum of
    both —, :func:`~galore2.core.apply.apply_updates`)?"""
    return isinstance(u, FACTORED) and u.keep is not None


@contextmanager
def flags_on(ctxs: list[Context], flags: Tensor) -> Iterator[None]:
    """Each context's ``keep`` (a deferred batch's ``flags``, its own at ``keep_at``) while
    the batch steps; None again after (contexts are kept between steps)."""
    for i, ctx in enumerate(ctxs):
        ctx.keep, ctx.keep_at = flags, (i,)
    try:
        yield
    finally:
        for ctx in ctxs:
            ctx.keep, ctx.keep_at = None, ()


__all__ = ["DEVICES", "DeferredSkips", "active", "flagged", "flags_on"]
