"""The masked path of the step engine (``capturable=True``): no host read, no host tensor.

Every parameter of a masked batch steps on its gradient with an unusable one replaced by
zeros; the weights and device state of those masked out are put back from a snapshot (the
list work is :mod:`galore2.core.masked`'s). Their skips are counted on the device, one add
per batch, and read into the state only when asked (:meth:`MaskedPath.flush_skips`):
before a checkpoint, a count, or a step whose refresh schedule reads the host counters
those skips set back (:meth:`MaskedPath.due_flush`). The snapshots, flag buffers and
pending counts are kept per group (its ``id()``) and emptied by :meth:`MaskedPath.reset`
(the step engine's :meth:`~galore2.core.step.StepEngine.reset`).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from functools import partial
from typing import Any

import torch
from torch import Tensor

from .. import _numerics
from .batch import Batch, Group
from .masked import (
    CounterSnapshot,
    FlagBuffer,
    MaskedStep,
    Snapshot,
    derive,
    masked_grads,
    usable_or_one,
)
from .nonfinite import SKIPS
from .state import counter_on
from .transform import Transform, walk


class MaskedPath:
    """The masked step of a batch, and the skips it counts on the device.

    ``optimizer`` is read for its ``state``; ``chain`` says which state its rules mask
    themselves; ``modules`` (every module, in order) name the device and host step
    counters and the refresh schedule's questions; ``decay_factor(group)`` is the step's
    decoupled decay factor.
    """

    def __init__(
        self,
        optimizer: Any,
        chain: list[Transform],
        modules: Sequence[Any],
        decay_factor: Callable[[Group], float],
    ) -> None:
        self.opt, self.chain, self.decay_factor = optimizer, chain, decay_factor
        # counters a masked step keeps on the parameters' device (Adam's step): put back for
        # a masked parameter after its step (:class:`~galore2.core.masked.MaskedStep`)
        self.device_counters = frozenset(
            k for m in walk(modules) for k in getattr(m, "device_counters", ())
        )
        # host step counters a masked step advances for every parameter (GaLore's
        # ``galore.step``): set back by a masked parameter's skips when they are read
        # (:meth:`flush_skips`), before any decision that reads them (:meth:`due_flush`)
        self.host_counters = frozenset(
            k for m in walk(modules) for k in getattr(m, "host_step_counters", ())
        )
        self.refresh_askers = [m.refresh_due for m in walk(modules) if hasattr(m, "refresh_due")]
        # skips counted on the device, per batch of parameters (their ids)
        self.pending_skips: dict[tuple[int, ...], tuple[list[Tensor], Tensor]] = {}
        self.reset()

    def reset(self) -> None:
        """Empty the caches; the pending skips are added to the state first."""
        self.flush_skips()
        self.pending_skips = {}
        self.snapshots: dict[int, Snapshot] = {}  # per group, see step
        self.counter_snapshots: dict[int, CounterSnapshot] = {}  # likewise: device counters
        self.flag_buffers: dict[int, FlagBuffer] = {}  # likewise
        self.skip_keys: dict[int, tuple[int, ...]] = {}  # per group: its last batch's key

    def step(self, batch: Batch) -> MaskedStep:
        """The masked step of ``batch`` (``capturable=True``): no host read and no tensor
        created on the host. Every parameter steps on its gradient with an unusable one
        replaced by zeros; the weights and device state of those masked out are put back from
        a snapshot (see :mod:`galore2.core.nonfinite`) — but for the state the chain's rules
        mask themselves (:meth:`~galore2.core.transform.Transform.masked_keys`; each
        direction's flag is its ``ctx.mask`` while the chain runs), which is neither copied
        nor put back.

        The flags stay one stacked device tensor: the skips are counted by one add per batch;
        the gradients are masked and the state is saved and restored a few kernels per
        (device, dtype) (:mod:`galore2.core.masked`); each parameter's decay factor and update
        mask are entries of device tensors, applied by foreach kernels (no ``torch.where``
        with a Python scalar, which would create a tensor on the host every step)."""
        group, ok = batch.group, batch.flags
        if ok is None:  # the engine takes the masked path only for checked flags
            raise RuntimeError("a masked step needs the batch's non-finite flags")
        bad = ~ok
        self._count_skips(batch, bad)
        decay = self.decay_factor(group)
        flags = self.flag_buffers.get(batch.key)
        if flags is None or not flags.fits(ok):
            flags = self.flag_buffers[batch.key] = FlagBuffer(ok.numel(), ok.device)
        flags.write(ok, bad, batch.reused)
        # each parameter's 0-d factor, views of one buffer kept per batch; in float64 for
        # float64 weights (the flags are float32: 1 − lr·λ would be rounded to float32)
        wide = torch.float64 if any(p.dtype == torch.float64 for p in batch.params) else None
        decays = (
            derive(flags.entries, partial(usable_or_one, value=decay, dtype=wide),
                   f"decay {decay!r} {wide}")
            if decay != 1.0
            else None
        )  # fmt: skip
        grads = masked_grads(batch.grads, flags)
        # state the chain's rules mask themselves (Context.mask) is neither copied nor put back
        skipped = frozenset(k for m in self.chain for k in m.masked_keys(group))
        snapshot = self._snapshot(batch, skipped)
        # and what the rules know they leave unchanged this step (GaLore's bases between refreshes)
        now = skipped.union(*(m.step_masked_keys(batch.states, group, batch.ctxs)
                              for m in self.chain))  # fmt: skip
        return MaskedStep(flags, snapshot, now, grads, decays, batch.ctxs,
                          self._counter_snapshot(batch))  # fmt: skip

    def _snapshot(self, batch: Batch, skipped: frozenset[str]) -> Snapshot:
        """The batch's :class:`~galore2.core.masked.Snapshot` (kept per group, remade when
        its state dicts or the keys the rules mask themselves changed): the device state
        but host counters, device step counters and ``skipped``."""
        snapshot = self.snapshots.get(batch.key)
        if snapshot is None or not snapshot.fits(batch.states) or snapshot.skipped != skipped:
            device = batch.params[0].device if batch.params else None
            kept = [
                (i, key)
                for i, state in enumerate(batch.states)
                for key, t in state.items()
                if t.device == device
                and not _counter(t)
                and key not in self.device_counters
                and key not in skipped
            ]
            local = not any(c.placement.distributed for c in batch.ctxs)
            snapshot = self.snapshots[batch.key] = Snapshot(
                batch.states, kept, pack=local, previous=snapshot, skipped=skipped
            )
        return snapshot

    def _counter_snapshot(self, batch: Batch) -> CounterSnapshot | None:
        """The device step counters of a masked batch (:attr:`device_counters`: Adam's
        ``adam.step``…), saved before its chain and put back after it for the masked
        parameters, so that their counts stay the skip path's (a few kernels on 0-d
        tensors, not packed: the rules pack their counters themselves). Counters still on
        the host (a checkpoint loads 0-d integers there) are moved to the parameters'
        device first, as the rules would move them (then every one is in the snapshot)."""
        if not self.device_counters or not batch.params:
            return None
        device = batch.params[0].device
        kept = []
        for i, state in enumerate(batch.states):
            for key in self.device_counters:
                t = state.get(key)
                if t is None:
                    continue
                if t.device != device:  # in the state itself (a sharded one's is a copy)
                    t = state[key] = self.opt.state[batch.owners[i]][key] = counter_on(t, device)
                kept.append((i, key))
        if not kept:
            return None
        found = self.counter_snapshots.get(batch.key)
        if found is None or not found.fits(batch.states, kept):
            found = self.counter_snapshots[batch.key] = CounterSnapshot(
                batch.states, kept, len(batch.states)
            )
        return found

    def _count_skips(self, batch: Batch, bad: Tensor) -> None:
        """Add a batch's masked parameters to the skips counted on the device: one add into
        a counter per batch of parameters (flushed by :meth:`flush_skips`)."""
        key = self.skip_keys.get(batch.key) if batch.reused else None
        if key is None:
            key = self.skip_keys[batch.key] = tuple(map(id, batch.owners))
        found = self.pending_skips.get(key)
        if found is None:
            self.pending_skips[key] = (list(batch.owners), bad.to(torch.int32))
        else:
            found[1].add_(bad)

    def flush_skips(self) -> None:
        """Add the skips counted on the device (the masked step) to the state's counters and
        set the host step counters a masked step advanced (:attr:`host_counters`) back by
        them, as if those steps had been skipped: one host read, here rather than in the step."""
        pending = self.pending_skips
        if not pending:
            return
        params = [p for owners, _ in pending.values() for p in owners]
        counts = _numerics.host_list(torch.cat([c.to(torch.int64) for _, c in pending.values()]))
        for p, n in zip(params, counts, strict=True):
            if n:
                state = self.opt.state[p]
                state[SKIPS] += n
                for key in self.host_counters:
                    if key in state:
                        state[key] -= n  # in place: a packed counter stays in its pack
        for _, c in pending.values():  # zeroed in place: a captured step keeps adding into it
            c.zero_()

    def due_flush(self, batches: list[Batch]) -> None:
        """Before a step whose masked batches may refresh a basis: the pending skips read
        (:meth:`flush_skips`), so the refresh schedule sees the counts the skip path has.
        A host counter is never behind the skip path's (it counts the masked steps too),
        and a refresh is due once it reaches the parameter's next refresh: where none is
        due by the host counters, none is by the skip path's, and nothing is read."""
        if not self.pending_skips or not self.refresh_askers:
            return
        for b in batches:
            if not b.group["capturable"]:  # not masked
                continue
            for p in b.owners:
                state = self.opt.state.get(p)
                if state and any(ask(state, b.group) for ask in self.refresh_askers):
                    self.flush_skips()
                    return

    def due_for_refresh(self, groups: Sequence[Group]) -> list[Tensor]:
        """The parameters of ``groups`` whose next step refreshes a basis or creates their
        state; where one is due by host counters that may still count masked steps, the
        skips are read first (:meth:`flush_skips`): the answer is the skip path's."""
        state_of, askers = self.opt.state, self.refresh_askers

        def due() -> list[Tensor]:
            return [
                p
                for g in groups
                for p in g["params"]
                if not state_of.get(p) or any(ask(state_of[p], g) for ask in askers)
            ]

        found = due()
        if self.pending_skips and any(state_of.get(p) for p in found):
            self.flush_skips()
            found = due()
        return found


def _counter(t: Tensor) -> bool:
    """A host-resident step counter (0-d integer on the CPU), whatever the parameters' device."""
    return t.dim() == 0 and not t.is_floating_point() and t.device.type == "cpu"
