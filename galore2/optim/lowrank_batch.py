"""GaLore's projections batched per shape: one ``bmm`` for every same-shape matrix of a group.

The batched path (``foreach``) of :class:`~galore2.optim.galore.GaLore` would project and
back-project each matrix with its own matmul: two matmuls (and their Python) per projected
matrix. Weights of a transformer repeat a few shapes in every layer (q/k/v/o, gate/up,
down), so here the gradients of the matrices that share (side, shape, dtype, device) are
stacked and projected by one ``torch.bmm`` against their stacked bases, and back-projected
by another; the result is a dense update per matrix (a view of the batch), applied by the
optimizer's foreach kernels. Fira and APOLLO take the same projection; their combination
is :func:`.residual.combine_buckets` on the same stacks.

**Along the data** (GaLore or APOLLO, not Fira, on an unmasked step:
:func:`.lowrank_plan.along`; every batch where galore2's grouped kernels run, else
matrices of at least :data:`MIN_ALONG_DATA_ELEMENTS`, which no batch reaches on today's
GPU hosts: :func:`along_data`): the gradients are not stacked — each is read once, in its
own dtype, into its entry of the r-sized stack R (:meth:`ShapeBatch.project` with
``stack=False``: one grouped launch for the batch, ``galore2::mm_each_``, reading the
stored bases as they are) — and the update goes out as factors (:func:`factors`), which
the optimizer writes into each weight (``galore2::addmm_each_``: scale, decay and update
in the matmul, one launch for the batch): no tensor of a weight's size is made, each
gradient is read once and each weight read and written once. APOLLO's update is its
gradients scaled, read where they are (``galore2::scaled_add_each_``).

The side's products (and which basis they read) are its projection's
(:class:`~galore2.optim.projection.LeftProjection` / ``RightProjection``: ``basis_key``,
``project_stack``, ``back_stack``); this module only plans, groups and stacks.

**The plan** (:class:`BatchPlan`): which matrices of a group's lists batch together, built
once and reused while the lists hold the same state dicts and contexts (``load_state_dict``
replaces the state dicts, a changed parameter its context: the plan is rebuilt). Only the
refresh schedule is read at every step: the ``galore.step`` and ``galore.next_refresh``
counters of the batched matrices (see :meth:`BatchPlan.due`); a matrix due for a refresh
leaves its batch for that step and takes the per-tensor path (:meth:`GaLore._project`),
which refreshes it. Which matrices are due, live or skipped at a step, and how their stacks
go through the inner chain, is :mod:`.lowrank_plan`'s.

**Stacked entries**: where every rule of the inner chain takes them
(:meth:`~galore2.core.transform.Transform.stacks`), a batch goes through the inner chain as
one entry — its k × r × n stack of projected gradients, with a
:class:`~galore2.core.transform.StackedState` whose moments are k × r × n stacks of the
matrices' own (:meth:`ShapeBatch.stacked_state`, packed once by :mod:`galore2.core.packing`)
— so a rule's kernels run once per shape, not once per matrix.

**Stacked bases** (:class:`ShapeBatch`): a basis changes only at a refresh, so a batch
keeps its bases stacked (up to :data:`MAX_CACHED_BYTES` per batch: where a step is
launch-bound), and re-stacks them when one of the stored tensors was replaced or written
(its ``_version`` moved: a refresh, ``load_state_dict`` into it). The random projector
stores a seed only: its Gaussian bases are regenerated from the seeds into one stack
(one draw per matrix, one scaling, in the projection's dtype), kept whatever its size and
drawn again when a seed changed (a refresh): its state stays a seed; the kept stack is a
cache, not state.

Only the common case takes this path (:func:`stackable`): a left or right projection of a
local (not sharded) 2-D weight, a dense fp32 / bf16 basis (or the random projector's),
read by the base projector's products. Every other matrix goes through
:meth:`GaLore._project` / :meth:`GaLore._back` as before.

Only matrices of at most :data:`MAX_MATRIX_BYTES` batch: there a step is launch-bound and
the stacking copies are cheap (Llama-350M's 1024×1024 and 1024×2736). Larger ones keep
their own matmuls — stacking 32 of Llama-7B's 4096×4096 matrices into one ``bmm`` was no
faster on an H100, the copies cost what the launches saved. A batch holds at most
:data:`MAX_BATCH_BYTES` of gradients (its stacks are temporaries of that size).
Results equal the per-matrix path up to the matmul's summation order (within 1e-6).
"""

from __future__ import annotations

import operator
from typing import Any

import torch
from torch import Tensor

from ..core import masked, packing
from ..core.counters import Counters
from ..core.transform import Context, LowRankUpdate, StackedState, State
from ..kernels.ops_lowrank import grouped_would_run, operand_dtypes
from ..projectors import PROJ_PRECISION, Plan, Projector, get_projector
from ..projectors.base import projection_precision
from ..projectors.random import RandomProjector
from .projection import BY_SIDE, Projection, entries, plan_for
from .refresh import is_due

MAX_MATRIX_BYTES = 16 * 2**20
MAX_BATCH_BYTES = 256 * 2**20
#: the largest stack of a batch's stored bases kept between steps (see ShapeBatch.bases)
MAX_CACHED_BYTES = 4 * 2**20
#: the host time of one eager launch (an op's Python and dispatch) on a GPU's host: about
#: 25 µs, measured on an H200 machine with torch 2.11 (BENCHMARKS.md, "GPU session": with
#: Llama-350M's 168 matrices along the data, 336 launches more, GaLoreAdamW's step took
#: 14.95 ms against 6.59 stacked in the same call: 8.36 ms, 24.9 µs a launch)
HOST_LAUNCH_S = 25e-6
#: the device bandwidth those launches are weighed against (an H100's 3.35 TB/s)
DEVICE_BYTES_PER_S = 3.35e12
#: bytes a matrix's element saves along the data (no gradient stack written and read, no
#: dense update written and read, the weight's decay and update in the matmul)
SAVED_BYTES_PER_ELEMENT = 12
#: the smallest matrix whose batch goes along the data (:func:`along_data`): where the
#: device time of the bytes saved passes the host time of its two launches (a projection
#: and an ``addmm_`` per matrix, against one ``bmm`` each way per batch). About 14 M
#: elements, more than :data:`MAX_MATRIX_BYTES` allows a batch in 16-bit or fp32: every
#: batch is stacked on today's hosts. (It was 1 MiB, from a model that charged a launch
#: only its ~5 µs of device time: on an H200 GaLoreAdamW's step then took 30.8 ms of host
#: time for 3.6 ms of device work.)
MIN_ALONG_DATA_ELEMENTS = round(2 * HOST_LAUNCH_S * DEVICE_BYTES_PER_S / SAVED_BYTES_PER_ELEMENT)
_DENSE_BASES = ("fp32", "bf16")
_NONE = 0  # galore.side of a matrix GaLore does not project


def group_batchable(group: dict[str, Any]) -> bool:
    """Can any matrix of this group batch (a dense stored basis or the random projector's,
    read by the base projector's products)?"""
    if group.get("basis_dtype", "fp32") not in _DENSE_BASES:
        return False
    projector = type(get_projector(group["projector"]))
    return (
        projector.project is Projector.project and projector.back_factors is Projector.back_factors
    )


def along_data(u: Tensor) -> bool:
    """Does a shape batch of matrices like ``u`` go along the data where it may (each
    gradient projected where it is, each update written into its weight, decay and update in
    the matmul: no weight-sized copy), rather than by one ``bmm`` each way per shape (the
    gradients stacked and the dense updates applied by foreach kernels)?

    Where the grouped kernels run (:func:`~galore2.kernels.ops_lowrank.grouped_would_run`:
    an NVIDIA GPU with Triton) always: there each way is one launch for the whole batch, as
    the ``bmm`` is. Elsewhere each matrix takes its own ``mm`` and ``addmm_``, so only where
    a matrix holds at least :data:`MIN_ALONG_DATA_ELEMENTS`: there the bytes saved cost
    more device time than the host spends on the launches added."""
    return u.numel() >= MIN_ALONG_DATA_ELEMENTS or grouped_would_run(u)


def stackable(u: Tensor, ctx: Context, kind: type[Projection]) -> bool:
    """Can this matrix's projection (of class ``kind``) join a shape batch (when not due)?"""
    return (
        kind.stackable
        and u.dim() == 2
        and u.numel() * u.element_size() <= MAX_MATRIX_BYTES
        and not ctx.placement.distributed
    )


class ShapeBatch:
    """Same-shape matrices of a group projected by one ``bmm`` (see the module docstring).

    Args:
        kind: their projection's class (left or right).
        idx: their positions in the group's lists.
        states: their state dicts.
        dtype: their gradients' dtype (the stacks' and the bases' dtype).
        plan: their first matrix's :class:`~galore2.projectors.Plan` (:func:`.plan_for`),
            the geometry they share: device, the basis's rows (m for a left basis, n for a
            right one), rank (the random projector's basis columns), ``proj_precision``.
    """

    __slots__ = ("cast", "device", "dtype", "held", "idx", "inner", "kind", "plan", "rank",
                 "rows", "stack", "states", "versions")  # fmt: skip

    def __init__(
        self, kind: type[Projection], idx: list[int], states: list[State], dtype: torch.dtype,
        plan: Plan,
    ) -> None:  # fmt: skip
        self.kind, self.idx, self.states, self.dtype, self.plan = kind, idx, states, dtype, plan
        self.device, self.rank = plan.device, plan.rank
        self.rows = plan.m if kind.left else plan.n
        self.stack: Tensor | None = None  # the kept stack of bases
        self.held: list[Tensor] = []  # the state tensors ``stack`` was read from
        self.versions: list[int] = []  # and their versions then
        self.inner: _InnerStacks | None = None  # the inner chain's stacked state
        self.cast: tuple[Tensor, Tensor] | None = None  # (kept stack, it in another dtype)

    def _hold(self, key: str) -> None:
        self.held = [s[key] for s in self.states]
        self.versions = [t._version for t in self.held]

    def _current(self, key: str) -> bool:
        """Is ``stack`` still what it was read from (the same tensors, unwritten)?"""
        held = self.held
        if len(held) != len(self.states):
            return False
        for s, t, v in zip(self.states, held, self.versions, strict=True):
            if s[key] is not t or t._version != v:
                return False
        return True

    def bases(self, projector: Projector, at: torch.dtype | None = None) -> Tensor:
        """The batch's bases stacked (k × rows × r, in their stored dtype; the random
        projector's regenerated from their seeds, in ``at`` when that is the gradients'
        dtype: the dtype the projection and the back-projection read them in).

        A stack of at most :data:`MAX_CACHED_BYTES` is kept, and made again only when one of
        the state tensors it was made from (bases, or seeds) was replaced or written (a
        refresh, ``load_state_dict``); a larger one is made at every step (a second copy of
        the bases would cost more memory than making it costs time) — but the random
        projector's, which is kept whatever its size: drawn once per refresh (APOLLO), not
        by one ``normal_`` per matrix and step, for the memory of the bases in ``at`` (bf16
        weights: half of what a stored fp32 basis takes; the draw is the only copy)."""
        random = isinstance(projector, RandomProjector)
        key = "proj.seed" if random else self.kind.basis_key
        if self.stack is not None and self._current(key):
            return self.stack
        if random:  # regenerated from the seeds (the projector stores nothing else)
            seeds = [int(s[key]) for s in self.states]
            stacked = projector.stacked(seeds, self.kind.left, self.rows, self.rank, self.device)
            if at == self.dtype and stacked.dtype != at:  # the values .to(at) gives anyway
                stacked = stacked.to(at)
        else:
            stacked = torch.stack([s[key] for s in self.states])
        self.stack = None
        if random or stacked.numel() * stacked.element_size() <= MAX_CACHED_BYTES:
            self._hold(key)
            self.stack = stacked
        return stacked

    def cast_bases(self, B: Tensor, dtype: torch.dtype) -> Tensor:
        """The stack ``B`` of :meth:`bases` in ``dtype``; the cast of a kept stack is kept
        with it (made again when the stack is), so a step casts no basis."""
        if B.dtype == dtype:
            return B
        cast = self.cast
        if cast is not None and cast[0] is B and cast[1].dtype == dtype:
            return cast[1]
        out = B.to(dtype)
        self.cast = (B, out) if B is self.stack else None
        return out

    def _cast_each(
        self, projector: Projector, at: torch.dtype, live: list[int] | None
    ) -> Tensor | None:
        """The stored bases of the matrices ``live`` (None: all) copied into one new stack in
        dtype ``at`` (one ``_foreach_copy_``: each basis read once, the cast written once)
        where :meth:`bases` would stack them in their stored dtype only for
        :meth:`cast_bases` to cast that stack (a stack it does not keep, of dense bases
        stored in another dtype); None otherwise (then that path runs). The same values:
        a copy into ``at`` rounds as ``.to(at)`` does."""
        if isinstance(projector, RandomProjector):
            return None
        key = self.kind.basis_key
        kept = self.stack is not None and self._current(key)
        if kept:
            return None  # bases() has it (with its cast)
        first = self.states[0][key]
        stacked = len(self.states) * first.numel() * first.element_size()
        if first.dtype == at or stacked <= MAX_CACHED_BYTES:
            return None  # no cast, or a stack bases() keeps with its cast
        states = self.states if live is None else [self.states[j] for j in live]
        out = torch.empty((len(states), *first.shape), dtype=at, device=first.device)
        torch._foreach_copy_(list(out.unbind(0)), [s[key] for s in states])
        return out

    def _stored_each(
        self, projector: Projector, at: torch.dtype, live: list[int] | None, u: Tensor
    ) -> list[Tensor] | None:  # fmt: skip
        """The live matrices' stored bases themselves (no stack, no cast) where the grouped
        kernels project them (:func:`~galore2.kernels.ops_lowrank.grouped_would_run`): the
        kernel reads each where it is, a float32 basis rounded to bf16 as it loads it
        (:func:`~galore2.kernels.ops_lowrank.operand_dtypes`: the values of casting it
        first), so a step neither stacks nor casts a basis; None otherwise (a stack then:
        the random projector's kept draw, or :meth:`bases`)."""
        if isinstance(projector, RandomProjector) or not grouped_would_run(u):
            return None
        key = self.kind.basis_key
        states = self.states if live is None else [self.states[j] for j in live]
        first = states[0][key]
        if operand_dtypes(at, first.dtype, at) is None:
            return None
        return [s[key] for s in states]

    def stacked_state(self, keys: tuple[str, ...]) -> StackedState | None:
        """The inner chain's state of the whole batch as one stacked entry (its ``keys``
        stacked: :mod:`~galore2.core.packing` views them, or packs them once), or None when
        they cannot stack (a quantized moment, mixed shapes or dtypes). Kept while the
        states hold the same tensors at the same addresses."""
        kept = self.inner
        if kept is not None and kept.asked == keys and kept.holds(self.states):
            return kept.state
        self.inner = _InnerStacks.build(self.states, keys)
        return self.inner.state if self.inner is not None else None

    def project(
        self, us: list[Tensor], projector: Projector, live: list[int] | None,
        stack: bool = True, residual: float | None = None,
    ) -> tuple[Tensor | None, Tensor | list[Tensor], Tensor | list[Tensor], Tensor,
               tuple[Tensor, Tensor] | None]:  # fmt: skip
        """(the stacked gradients G, the stacked bases B as stored, B in the projection's
        operand dtype Y (B itself when that is its dtype: a back-projection in that dtype
        reads Y rather than casting B again), R = PᵀG or G·Q): one ``bmm`` at the
        precision of :attr:`plan`, R in the gradients' dtype (as
        :meth:`Projector.project` does per matrix). G is a new stack, or a view of the
        gradients when they are one already (check ``G._base``: then not to be written).
        ``live``: the positions (in :attr:`idx`) that project this step (None: all).
        ``stack=False`` (the caller needs no G): gradients that are not a stack already are
        not copied into one — each is read where it is by its own matmul into its entry of
        R — and G is None; and bases stored in another dtype than the projection's are cast
        straight into Y (:meth:`_cast_each`), which B then is too — or, where the grouped
        kernels run, not stacked at all: B and Y are then the list of the stored bases
        (:meth:`_stored_each`). Last, the channel norms of ``G + c·P·R`` and of R
        (:meth:`.Projection.project_norms_each`; Fira's residual's, or APOLLO's G's for
        c = 0: :func:`.residual.projected_norms`) where ``residual`` (c) is given, the
        gradients are not stacked and one grouped launch takes the projection and both
        norms (the gradients in R's dtype: each read once); else None."""
        idx = self.idx if live is None else [self.idx[j] for j in live]
        listed = [us[i] for i in idx]
        dtype = self.dtype
        at, context = projection_precision(listed[0], self.plan.precision)
        held = None if stack else self._stored_each(projector, at, live, listed[0])
        fuse = residual is not None and not stack and listed[0].dtype == at == dtype and (
            grouped_would_run(listed[0], "project_norms_list")
        )  # fmt: skip
        if held is not None and fuse:
            with context:
                R, *norms = self.kind.project_norms_each(listed, held, residual)
            return None, held, held, R, (norms[0], norms[1])
        if held is not None:  # the stored bases as they are, read by one grouped launch
            with context:
                R = self.kind.project_each([g if g.dtype == at else g.to(at) for g in listed], held)
            return None, held, held, (R if R.dtype == dtype else R.to(dtype)), None
        cast = None if stack else self._cast_each(projector, at, live)
        if cast is not None:  # the live bases straight from the state into a stack in ``at``
            B = Y = cast
        else:
            B = self.bases(projector, at)
            Y = self.cast_bases(B, at)
        if live is not None and cast is None:
            pick = torch.tensor(live, device=B.device)
            B, Y = B[pick], (None if Y is B else Y[pick])
            Y = B if Y is None else Y
        # the gradients as they are when they form a stack (the masked copies of a
        # capturable step): no copy; the caller must then not write G
        G = packing.stacked_view(listed)
        if G is None and fuse:  # the stack Y's entries, read by the one launch
            with context:
                R, *norms = self.kind.project_norms_each(listed, entries(Y), residual)
            return None, B, Y, R, (norms[0], norms[1])
        if G is None and not stack:
            with context:  # a gradient not in ``at`` is cast alone (fp32 ones at bf16)
                R = self.kind.project_each([g if g.dtype == at else g.to(at) for g in listed], Y)
            return None, B, Y, (R if R.dtype == dtype else R.to(dtype)), None
        if G is None:
            G = torch.stack(listed)
        X = G if G.dtype == at else G.to(at)
        with context:
            R = self.kind.project_stack(X, Y)
        return G, B, Y, (R if R.dtype == dtype else R.to(dtype)), None


class _InnerStacks:
    """A batch's :class:`~galore2.core.transform.StackedState` and what it was made of (the
    stacked state tensors and where they were)."""

    __slots__ = ("addresses", "asked", "keys", "state", "tensors")

    def __init__(
        self, asked: tuple[str, ...], keys: tuple[str, ...], state: StackedState,
        tensors: list[Tensor],
    ) -> None:  # fmt: skip
        self.asked, self.keys, self.state, self.tensors = asked, keys, state, tensors
        self.addresses = packing.addresses(tensors)

    @staticmethod
    def build(states: list[State], asked: tuple[str, ...]) -> _InnerStacks | None:
        keys = tuple(k for k in asked if k in states[0])  # those of the chain's pick
        if not keys or any(k not in s for s in states for k in keys):
            return None
        lists = [[s[key] for s in states] for key in keys]
        for ts in lists:
            first = ts[0]
            if not first.is_floating_point() or any(
                type(t) is not Tensor or t.shape != first.shape or t.dtype != first.dtype
                for t in ts
            ):
                return None
        stacks = packing.as_stacks(lists)
        if stacks is None:
            return None
        state = StackedState(dict(zip(keys, stacks, strict=True)), states)
        return _InnerStacks(asked, keys, state, [t for ts in lists for t in ts])

    def holds(self, states: list[State]) -> bool:
        """Are the stacked tensors still the states' (by identity), where they were?"""
        ts = self.tensors
        k = len(states)
        for j, key in enumerate(self.keys):
            if not all(map(operator.is_, map(operator.itemgetter(key), states),
                           ts[j * k : (j + 1) * k])):  # fmt: skip
                return False
        return packing.addresses(ts) == self.addresses


class BatchPlan:
    """Which matrices of a group's lists batch (see the module docstring).

    Built from the lists of one :meth:`GaLore.update_many` call: ``projected`` (the positions
    GaLore projects), ``singles`` (projected, never batched: their own matmuls every step) and
    ``batches`` (:class:`ShapeBatch`, two matrices or more each); ``can_batch``: the group's
    :func:`group_batchable` then, ``rank`` and ``precision`` its ``rank`` and
    ``proj_precision`` (its batches' plans carry them: :meth:`fits`).
    """

    __slots__ = ("batched", "batches", "can_batch", "ctxs", "precision", "projected", "rank",
                 "singles", "states")  # fmt: skip

    def __init__(
        self, us: list[Tensor], states: list[State], ctxs: list[Context], group: dict[str, Any],
        can_batch: bool,
    ) -> None:  # fmt: skip
        self.states, self.ctxs = states, ctxs
        self.can_batch, self.rank = can_batch, group["rank"]
        self.precision = PROJ_PRECISION.of(group)
        self.projected: list[int] = []
        self.singles: list[int] = []
        by_key: dict[tuple, list[int]] = {}
        for i, (u, state, ctx) in enumerate(zip(us, states, ctxs, strict=True)):
            side = int(state["galore.side"])
            if side == _NONE:
                continue
            self.projected.append(i)
            kind = BY_SIDE[side]
            if can_batch and stackable(u, ctx, kind):
                by_key.setdefault((kind, u.shape, u.dtype, u.device), []).append(i)
            else:
                self.singles.append(i)
        self.batches: list[ShapeBatch] = []
        for (kind, _, dtype, _), same in by_key.items():
            size = us[same[0]].numel() * us[same[0]].element_size()
            per = max(1, MAX_BATCH_BYTES // max(size, 1))
            for part in (same[i : i + per] for i in range(0, len(same), per)):
                if len(part) < 2:  # alone: its own matmuls (stacking would only add copies)
                    self.singles += part
                    continue
                plan = plan_for(states[part[0]], group, ctxs[part[0]])
                part_states = [states[i] for i in part]
                self.batches.append(ShapeBatch(kind, part, part_states, dtype, plan))
        self.singles.sort()
        #: the batched matrices' states, in batch order (what :meth:`due` reads)
        self.batched = [s for b in self.batches for s in b.states]

    def fits(self, group: dict[str, Any], can_batch: bool) -> bool:
        """Was it made for this group's batchability, ``rank`` and ``proj_precision``?"""
        return (
            self.can_batch == can_batch
            and self.rank == group["rank"]
            and self.precision == PROJ_PRECISION.of(group)
        )

    def holds(self, states: list[State], ctxs: list[Context]) -> bool:
        """Is this plan still the plan of these lists (the same state dicts and contexts)?"""
        if len(states) != len(self.states):
            return False
        return all(a is b for a, b in zip(states, self.states, strict=True)) and all(
            a is b and not a.refreshed for a, b in zip(ctxs, self.ctxs, strict=True)
        )

    def due(self, counters: Counters) -> list[list[int]] | None:
        """Per batch, the positions (in its ``idx``) of the matrices due for a refresh this
        step (:func:`.refresh.is_due`, as the per-tensor path asks it); None when none is
        (the usual step). Two reads of packed host counters."""
        steps = read_counters(counters, self.batched, "galore.step")
        nexts = read_counters(counters, self.batched, "galore.next_refresh")
        if not any(map(is_due, steps, nexts)):
            return None
        out, start = [], 0
        for batch in self.batches:
            k = len(batch.idx)
            out.append([j for j in range(k) if is_due(steps[start + j], nexts[start + j])])
            start += k
        return out


def read_counters(counters: Counters, states: list[State], key: str) -> list[int]:
    """The values of the host counters ``state[key]`` of ``states`` (one read when packed)."""
    packed = counters.packed(states, key)
    return packed.tolist() if packed is not None else [int(s[key]) for s in states]


def advance_counters(
    counters: Counters, states: list[State], key: str, skip: list[int] | None = None
) -> None:
    """Add one to the host counters ``state[key]`` of ``states`` but those at the positions
    ``skip`` (one ``add_`` when packed)."""
    packed = counters.packed(states, key)
    if packed is None:
        left = set(skip or ())
        torch._foreach_add_([s[key] for j, s in enumerate(states) if j not in left], 1)
    elif not skip:
        packed.add_(1)
    else:
        step = torch.ones(len(states), dtype=packed.dtype)
        step[skip] = 0
        packed.add_(step)


def _stacked(ts: list[Tensor]) -> Tensor:
    """``ts`` as one stack: the view of the stack they are the entries of (a rule's stacked
    result, unbound), else a new one."""
    view = packing.stacked_view(ts)
    return torch.stack(ts) if view is None else view


def factor_lists(
    kind: type[Projection], B: Tensor | list[Tensor], Ns: list[Tensor] | Tensor,
    dtype: torch.dtype,
) -> tuple[list[Tensor], list[Tensor]]:  # fmt: skip
    """The factors (A_i, B_i) of ``P·N`` (left) or ``N·Qᵀ`` (right) for each matrix of a shape
    batch, in ``dtype``: two lists. ``Ns``: the low-rank stack (or its entries: the inner
    chain's, never written), cast once; ``B``: the bases' stack, or the stored bases
    themselves (:meth:`ShapeBatch.project`'s, for the grouped kernels: kept as they are
    where their dtype is one the kernels round, else stacked in ``dtype``)."""
    N = Ns if isinstance(Ns, Tensor) else _stacked(Ns)
    N = N if N.dtype == dtype else N.to(dtype)
    if isinstance(B, list) and operand_dtypes(dtype, B[0].dtype, dtype) is None:
        B = torch.stack(B)
    if isinstance(B, Tensor) and B.dtype != dtype:
        B = B.to(dtype)
    As, Bs = kind.factors_stack(N, B)
    return entries(As), entries(Bs)


def factors(
    kind: type[Projection], B: Tensor | list[Tensor], Ns: list[Tensor] | Tensor,
    dtype: torch.dtype, factor: float, shapes: list[torch.Size],
) -> list[LowRankUpdate]:  # fmt: skip
    """The updates ``factor·P·N`` (left) or ``factor·N·Qᵀ`` (right) of a shape batch as
    factors in ``dtype`` (:func:`factor_lists`), one
    :class:`~galore2.core.transform.LowRankUpdate` per matrix (``shapes``: their weights'),
    as :meth:`.Projection.back` returns per matrix: the optimizer writes each into its
    weight by one ``addmm_`` with the step's decay as its β, so no m×n update exists and
    each weight is read and written once."""
    As, Bs = factor_lists(kind, B, Ns, dtype)
    return [LowRankUpdate(a, b, shape, factor) for a, b, shape in zip(As, Bs, shapes, strict=True)]


def back(
    kind: type[Projection], B: Tensor, Ns: list[Tensor] | Tensor, dtype: torch.dtype,
    factor: float, out: Tensor | None = None, mask: Tensor | None = None,
) -> Tensor:  # fmt: skip
    """Dense updates ``P·(factor·N)`` (left) or ``(factor·N)·Qᵀ`` (right) in ``dtype``, one
    ``bmm`` (the factor scales the r-row stack, not the m×n result), stacked — into ``out``
    when given (a spent stack of the same shape and dtype: no new gradient-size buffer).
    ``Ns``: the low-rank updates, or their stack (the inner chain's: never written).

    ``mask`` (a masked step's ``(k, 1, 1)`` flags, 1.0 / 0.0, of a float32 stack): the
    factor is the flags times ``factor``, so a masked matrix's update is 0 (its finite N
    times 0) and the others keep their bits; the result is then marked
    :func:`~galore2.core.masked.premasked` (the step does not mask it again: the r-row
    stack is masked instead of the m×n result)."""
    N = Ns if isinstance(Ns, Tensor) else packing.stacked_view(Ns)
    owned = N is None  # a stack made here (not the entries of one: never written)
    N = torch.stack(Ns) if N is None else N  # type: ignore[arg-type]
    if N.dtype != dtype:
        N, owned = N.to(dtype), True
    B = B if B.dtype == dtype else B.to(dtype)
    if mask is not None and N.dtype == mask.dtype:
        # factor·1.0 rounds as the scalar factor does: the same bits where usable
        scale = mask if factor == 1.0 else mask * factor
        N = N.mul_(scale) if owned else N.mul(scale)
        # the step's own buffer: a consumer may write it
        return masked.premasked(packing.scratch(kind.back_stack(N, B, out)))
    if factor != 1.0:
        N = N.mul_(factor) if owned else N.mul(factor)
    # the step's own buffer: a consumer may write it (the masked step zeroes masked entries)
    return packing.scratch(kind.back_stack(N, B, out))
