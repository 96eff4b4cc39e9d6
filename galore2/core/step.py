"""The step engine behind :class:`~galore2.core.optimizer.ChainOptimizer`.

One pipeline serves ``step()`` (every parameter with a gradient) and ``step_param()`` (one
parameter, per-layer updates), :meth:`StepEngine.run`. Per parameter, a step is:

1. skip parameters without a gradient; refuse sparse gradients; ``nonfinite="raise"``:
   look at every gradient before any change;
2. gather per group (:meth:`StepEngine._gather`): state created lazily (every key at its
   final shape), the scheduled lr, local views; the lists are reused next step when the
   same parameters step again;
3. gradient modules act on the full gradient, in place (AGC, centralization...); the
   non-finite policy (:mod:`galore2.core.nonfinite`) decides which parameters are updated;
4. chain: ``u = chain(grad)``; apply (:mod:`galore2.core.apply`): ``p ← decay·p − lr·u``,
   ``decay = 1 − lr·λ`` the factor of the optimizer's
   :class:`~galore2.core.modules.DecoupledWeightDecay` (the decay-then-update order of
   ``torch.optim.AdamW``; 1 without one), which the chain receives too (GaLore folds it
   into a projected matrix's update) — on the host-indexed path (unusable gradients left
   out, by index, after one host read) or the masked one (``capturable=True``,
   :mod:`galore2.core.step_masked`);
5. weight modules act on the updated weights (norm loss, lookahead...); int8 weights are
   written back.

Every cache of the step (placements, contexts, gathered lists, masked snapshots, flag
buffers, skips counted on the device) lives here, keyed by parameter or group ``id()``,
and :meth:`StepEngine.reset` empties them all; a pickled optimizer carries none of them.
"""

from __future__ import annotations

import operator
from collections.abc import Callable, Iterable, Sequence
from contextlib import ExitStack
from typing import Any

import torch
from torch import Tensor

from ..fsdp.detect import is_dtensor  # cheap: imports nothing distributed
from ..placement import LOCAL, Placement
from .apply import apply_masked, apply_updates, chunks
from .batch import Batch, Group, Item, State, Stepped
from .deferred import DeferredSkips, active, flagged, flags_on
from .masked import MaskedStep
from .modules import (
    DecoupledWeightDecay,
    GradientTransform,
    LRSchedule,
    ParamTransform,
    run_grad_transforms,
    run_param_transforms,
)
from .nonfinite import SKIPS, NonFinitePolicy, read_flags
from .options import Bool, LearningRate, Option, Optional
from .state import counter
from .step_masked import MaskedPath
from .stored import Writes, parts, refuse, store_of
from .transform import Context, Transform, init_chain, run_chain

LR = Option("lr", 1e-3, LearningRate(), "learning rate (LR schedulers write it every step)")
MAXIMIZE = Option("maximize", False, Bool(), "maximize the objective instead of minimizing it")
FOREACH = Option(
    "foreach",
    None,
    Optional(Bool(), "batched on accelerators, per tensor on the CPU"),
    "True: batch a group's tensors through the chain (foreach kernels) on any device; "
    "False: one tensor at a time",
)


class StepEngine:
    """Gathers, batches and steps an optimizer's parameters through its modules.

    ``optimizer`` is read for its ``state`` and ``param_groups`` (both may be replaced:
    ``load_state_dict``, ``add_param_group``); :meth:`fill_state` creates a parameter's
    state, ``warn_once`` is handed to every :class:`Context`.
    """

    #: the options the engine reads (the optimizer declares them with the non-finite policy's)
    options = (LR, MAXIMIZE, FOREACH)

    def __init__(
        self,
        optimizer: Any,
        chain: list[Transform],
        grad_transforms: list[GradientTransform],
        param_transforms: list[ParamTransform],
        decay: DecoupledWeightDecay | None,
        schedule: LRSchedule | None,
        warn_once: Callable[[str], None],
    ) -> None:
        self.opt = optimizer
        self.chain, self.decay, self.schedule = chain, decay, schedule
        self.grad_transforms, self.param_transforms = grad_transforms, param_transforms
        self.warn_once = warn_once
        modules = [*grad_transforms, *chain, *([decay] if decay else []), *param_transforms,
                   *([schedule] if schedule else [])]  # fmt: skip
        self.masked = MaskedPath(optimizer, chain, modules, self.decay_factor)
        # deferred batches' flags, read a step later; the counters a step advances for
        # every parameter it runs are set back for a skipped one then
        self.deferred = DeferredSkips(
            optimizer, sorted(self.masked.host_counters | self.masked.device_counters)
        )
        self.reset()

    def reset(self) -> None:
        """Empty every cache (rebuilt on use), the masked path's too (its skips counted on
        the device, and the deferred batches', are added to the state first: none is lost)."""
        self.deferred.settle()
        self.masked.reset()
        self.chain[0].drop_screened()
        self.placements: dict[int, Placement] = {}
        self.contexts: dict[int, Context] = {}  # plain parameters' contexts, by id()
        # per group (its id()): (state mapping, items, lists) of the last _gather
        self.gather_cache: dict[int, tuple[Any, list, tuple[list, ...]]] = {}
        self.where: tuple[int, dict[int, tuple[Group, int]]] | None = None  # step_param's
        self.writes = Writes()  # int8 weights: this step's working copies (core/stored.py)

    def flush_skips(self) -> None:
        """The skips counted on the device into the state (:meth:`MaskedPath.flush_skips`,
        :meth:`~galore2.core.deferred.DeferredSkips.settle`)."""
        self.deferred.settle()
        self.masked.flush_skips()

    # ---- parameters ----------------------------------------------------------------
    def placement(self, p: Tensor) -> Placement:
        """LOCAL for a plain tensor; a galore2.fsdp placement for a DTensor (imported lazily).

        Built for every parameter at once (and again after ``add_param_group``), so an
        unsupported DTensor anywhere raises before any parameter is touched.
        """
        placement = self.placements.get(id(p))
        if placement is None:
            params = [q for _, _, q in indexed(self.opt.param_groups)]
            built: dict[int, Placement] = {}
            if any(is_dtensor(q) for q in params):
                from ..fsdp import assign_owners, placement_for

                for q in params:
                    built[id(q)] = placement_for(q) if is_dtensor(q) else LOCAL
                assign_owners([(q.shape, built[id(q)]) for q in params])
            else:
                built = {id(q): LOCAL for q in params}
            self.placements = built
            placement = built.get(id(p), LOCAL)
        return placement

    def context(self, p: Tensor, index: int) -> Context:
        """The parameter's :class:`Context`. A plain (local, real) parameter's is built once
        and reused by every step (it holds nothing that changes between steps); the cache
        is emptied by :meth:`reset`, and an entry is rebuilt when the parameter's index
        changed (``add_param_group``) or a group-level ``prepare`` marked it refreshed."""
        store = store_of(p)
        if store is not None:  # int8 weights: a dense fp32 working copy (core/stored.py)
            refuse({}, p, is_dtensor(p))
            return Context(param=store.dequantize(), index=index, warn_once=self.warn_once,
                           shape=p.shape)  # fmt: skip
        cached = self.contexts.get(id(p))
        fresh = cached is not None and not cached.refreshed
        if fresh and cached.param is p and cached.index == index:
            return cached
        placement = self.placement(p)
        if placement is LOCAL and not p.is_complex():
            ctx = Context(param=p, index=index, warn_once=self.warn_once, shape=p.shape)
            self.contexts[id(p)] = ctx
            return ctx
        return Context(
            param=real(placement.local(p)),
            index=index,
            warn_once=self.warn_once,
            placement=placement,
            shape=torch.Size((*p.shape, 2)) if p.is_complex() else p.shape,
        )

    def fill_state(self, state: State, group: Group, ctx: Context) -> None:
        """Create a parameter's state (``ctx``'s): its skip counter, then every module's."""
        state[SKIPS] = counter()
        if self.schedule is not None:
            self.schedule.init(ctx.global_shape, ctx.param, group, state, ctx)
        for hook in (*self.grad_transforms, *self.param_transforms):
            hook.init(ctx.global_shape, ctx.param, group, state, ctx)
        init_chain(self.chain, ctx.global_shape, ctx.param, group, state, ctx)

    def init_param_state(self, p: Tensor, group: Group, index: int) -> None:
        ctx = self.context(p, index)  # validates a DTensor's placement before any state exists
        self.fill_state(self.opt.state[p], group, ctx)

    def items(self) -> list[list[Item]]:
        """(index, gradient, parameter) of every parameter with a gradient, per group."""
        out, offset = [], 0
        for group in self.opt.param_groups:
            params = group["params"]
            out.append(
                [(offset + i, g, p) for i, p in enumerate(params) if (g := p.grad) is not None]
            )
            offset += len(params)
        return out

    def locate(self, p: Tensor) -> tuple[Group, int]:
        """``p``'s group and index, for ``step_param``: refused when ``p`` is not in the
        optimizer or a weight module needs statistics over every parameter."""
        needs_all = [t.name for t in self.param_transforms if t.needs_stats]
        if needs_all:
            raise ValueError(
                f"{', '.join(needs_all)} needs statistics over every parameter each step, "
                "which per-layer updates (step_param) cannot provide; use optimizer.step()"
            )
        count = sum(len(g["params"]) for g in self.opt.param_groups)
        if self.where is None or self.where[0] != count:  # (re)build after add_param_group
            self.where = (count, {id(q): (g, i) for i, g, q in indexed(self.opt.param_groups)})
        found = self.where[1].get(id(p))
        if found is None:
            raise ValueError(f"parameter of shape {tuple(p.shape)} is not in this optimizer")
        return found

    # ---- the pipeline --------------------------------------------------------------
    def run(self, groups: Sequence[Group], items: Sequence[list[Item]]) -> None:
        """The step of ``items`` (per group of ``groups``), ``step()``'s and ``step_param()``'s:
        a sparse gradient refused, ``nonfinite="raise"`` checked before any change, then
        gathered, prepared, run and applied."""
        if any(any(map(_IS_SPARSE, map(_GRAD, found))) for found in items):
            self._check_sparse()
        self.deferred.settle()  # last step's deferred skips, before any counter is read
        by_group = {id(g): found for g, found in zip(groups, items, strict=True)}
        NonFinitePolicy.raise_if_any(
            groups, lambda g: [(p, real(grad), self.placement(p)) for _, grad, p in by_group[id(g)]]
        )
        # int8 weights: one part per weight, so one working copy is alive at a time
        try:
            for part in parts(groups, list(items), self.param_transforms, is_dtensor):
                gathered = [self._gather(g, found) for g, found in zip(groups, part, strict=True)]
                self._run_and_apply(self._prepare([b for b in gathered if b is not None]))
        finally:  # what the first rule projected for the non-finite test (see _screened)
            self.chain[0].drop_screened()

    def _check_sparse(self) -> None:
        for group in self.opt.param_groups:
            for p in group["params"]:
                if p.grad is not None and p.grad.is_sparse:
                    raise RuntimeError(
                        "galore2 optimizers do not support sparse gradients (got one for a "
                        f"parameter of shape {tuple(p.shape)}); use torch.optim.SparseAdam for "
                        "sparse embeddings"
                    )

    def _run_and_apply(self, batches: list[Batch]) -> None:
        """:meth:`_run`, then the weight modules on the parameters stepped, with a masked
        step's flags still set (each module leaves a masked parameter's weights as they are:
        :func:`~galore2.core.masked.masked_factor`), cleared after."""
        self.masked.due_flush(batches)
        try:
            with ExitStack() as masks:
                stepped = self._run(batches, masks)
                run_param_transforms(self.param_transforms, self.chain, stepped, chunks)
            self.writes.commit(ctx.param for _, _, ctx in stepped)  # int8 weights
        finally:
            self.writes.drop()

    def _gather(self, group: Group, items: list[Item]) -> Batch | None:
        """Everything of ``items`` (of ``group``) before the chain: lazy state, the scheduled
        lr, local views (then :meth:`_prepare`: the gradient modules, the non-finite flags)."""
        if not items:
            return None
        key, state_of = id(group), self.opt.state
        if self.schedule is not None:  # built-in schedule: lr = schedule(group, step count)
            for index, _, p in items:
                if not state_of[p]:
                    self.init_param_state(p, group, index)
            group = {**group, "lr": self.schedule.step_lr(group, [state_of[p] for *_, p in items])}
        batch = Batch(group, key)
        cached = self._gathered(key, items)
        if cached is not None:  # the same parameters as last step: no per-parameter Python
            batch.owners, batch.params, batch.states, batch.ctxs = cached
            batch.reused = True
            grads = [g for _, g, _ in items]
            if group["maximize"]:
                grads = list(torch._foreach_neg(grads)) if len(grads) > 1 else [-grads[0]]
            batch.grads = grads
            return batch
        for _, _, p in items:  # int8 weights (never cached): refusals before any state
            if store_of(p) is not None:
                refuse(group, p, is_dtensor(p))
        plain = True  # local real tensors only: the lists can be reused next step
        for index, grad, p in items:
            state = state_of[p]
            if not state:
                self.init_param_state(p, group, index)
            ctx = self.context(p, index)
            store = store_of(p)
            if store is not None:  # stepped on its working copy, written back after
                self.writes.track(ctx.param, store)
            plain = plain and ctx.placement is LOCAL and not p.is_complex() and store is None
            grad = real(ctx.placement.local(grad))
            if ctx.placement.distributed:  # transforms see local views of DTensor state
                state = {k: ctx.placement.local(v) for k, v in state.items()}
            batch.owners.append(p)
            batch.params.append(ctx.param)
            batch.states.append(state)
            batch.ctxs.append(ctx)
            batch.grads.append(-grad if group["maximize"] else grad)
        if plain:
            lists = (batch.owners, batch.params, batch.states, batch.ctxs)
            # indices and parameters only: last step's gradients are not kept alive
            self.gather_cache[key] = (state_of, [(i, p) for i, _, p in items], lists)
        return batch

    def _gathered(
        self, key: int, items: list[Item]
    ) -> tuple[list[Tensor], list[Tensor], list[State], list[Context]] | None:
        """The lists :meth:`_gather` built last step for this group, if they still hold: the
        same parameters at the same indices, the same ``state`` mapping (not replaced by
        ``load_state_dict``) and the same state dicts; None otherwise (they are rebuilt).
        Only groups of local real tensors are cached (see ``_gather``)."""
        found = self.gather_cache.get(key)
        if found is None:
            return None
        state, old, lists = found
        if state is not self.opt.state or len(old) != len(items):
            return None
        for (i, _, p), (j, q) in zip(items, old, strict=True):
            if p is not q or i != j:
                return None
        owners, params, states, ctxs = lists
        for p, s, ctx in zip(owners, states, ctxs, strict=True):
            if ctx.refreshed or state.get(p) is not s or not s:
                return None
        return [*owners], [*params], [*states], [*ctxs]

    def _prepare(self, batches: list[Batch]) -> list[Batch]:
        """The gradient modules on every batch's full gradients, in place (batched as the
        chain batches them, and across groups where a module reads the same options), then
        the non-finite flags of every batch (on the device; :meth:`NonFinitePolicy.check_many`)."""
        if self.grad_transforms:
            run_grad_transforms(
                self.grad_transforms,
                [
                    (b.group, *([xs[i] for i in c] for xs in (b.grads, b.states, b.ctxs)))
                    for b in batches
                    for c in chunks(b.params, b.group.get("foreach"))
                ],
            )
        # one check for every group sharing a state dtype, device and reduction
        flags = NonFinitePolicy.check_many(
            [(b.group, self._screened(b), [c.placement for c in b.ctxs]) for b in batches]
        )
        for b, ok in zip(batches, flags, strict=True):
            b.flags = ok
        return batches

    def _screened(self, batch: Batch) -> list[Tensor]:
        """The tensors whose non-finite test decides ``batch``'s skips: its gradients, but
        where the group folds the test (:meth:`NonFinitePolicy.folds`) the smaller tensor the
        chain's first rule computes from a gradient anyway and keeps for this step
        (:meth:`~galore2.core.transform.Transform.screened`: GaLore's R = PᵀG), asked per
        ``foreach`` chunk, as :meth:`_step_batch` runs the chain."""
        if not NonFinitePolicy.folds(batch.group):
            return batch.grads
        tested = list(batch.grads)
        first, group = self.chain[0], batch.group
        for chunk in chunks(batch.params, group.get("foreach")):
            got = first.screened([batch.grads[i] for i in chunk],
                                 [batch.states[i] for i in chunk], group,
                                 [batch.ctxs[i] for i in chunk])  # fmt: skip
            for i, small in zip(chunk, got, strict=True):
                if small is not None:
                    tested[i] = small
        return tested

    def _run(self, batches: list[Batch], masks: ExitStack) -> list[Stepped]:
        """Read every batch's flags at once (the step's one host read), then per batch the one
        pipeline (:meth:`_step_batch`): on the host-indexed path the usable tensors, picked
        by index; on the masked path (``capturable=True``) every tensor, the unusable ones
        masked (:class:`~galore2.core.masked.MaskedStep`, its flags cleared by ``masks``);
        on the deferred path (:meth:`_defers`, where every checked batch takes it) every
        tensor, its flags unread, taken by the kernels (:mod:`galore2.core.deferred`).
        Returns (group, local state, ctx) of those stepped."""
        host = [b for b in batches if not b.group["capturable"]]
        # deferred only where no batch reads its flags: one read left would wait anyway
        checked = [b for b in host if b.flags is not None]
        later = {id(b) for b in checked} if checked and all(map(self._defers, checked)) else ()
        host = [b for b in host if id(b) not in later]
        read = dict(zip(map(id, host), read_flags([b.flags for b in host]), strict=True))
        self.deferred.record([(b.owners, b.flags) for b in batches if id(b) in later])
        stepped = []
        for batch in batches:
            if id(batch) in later:
                with flags_on(batch.ctxs, batch.flags):
                    stepped += self._step_batch(batch, batch.grads, None, batch.flags)
                continue
            if batch.group["capturable"] and batch.flags is not None:
                masked = self.masked.step(batch)
                masks.callback(masked.unmask)
                with masked:  # the snapshot saved, each direction's flag set; put back after
                    stepped += self._step_batch(batch, masked.grads, masked)
                continue
            if batch.flags is not None and not batch.group["capturable"]:
                keep = NonFinitePolicy.keep(read[id(batch)], batch.states)
                if not all(keep):  # a selection of the usable ones, by index
                    live = [i for i, k in enumerate(keep) if k]
                    batch.params, batch.states, batch.ctxs, batch.grads = (
                        [xs[i] for i in live]
                        for xs in (batch.params, batch.states, batch.ctxs, batch.grads)
                    )
            stepped += self._step_batch(batch, batch.grads, None)
        return stepped

    def _defers(self, batch: Batch) -> bool:
        """Does ``batch`` take the deferred path (:mod:`galore2.core.deferred`): flags checked
        (``"skip"``, not ``capturable``, the test folded where it folds), on a device that
        defers, local tensors, no weight modules (they read the step's flags on the host),
        and every kernel of its step taking the flags — the plain AdamW group's fused op
        (:meth:`~galore2.optim.adam.ScaleByAdam.defers_adamw`), else the chain's first
        rule's own answer (:meth:`~galore2.core.transform.Transform.defers`)?"""
        group = batch.group
        if (
            batch.flags is None
            or not batch.params
            or not active(batch.params[0].device)
            or not NonFinitePolicy.folds(group)
            or self.param_transforms
            or any(c.placement is not LOCAL for c in batch.ctxs)
            or any(store_of(p) is not None for p in batch.owners)
        ):
            return False
        rule = self._adamw_rule(group)
        if rule is not None:
            return rule.defers_adamw(batch.params, batch.grads, batch.states, group)
        return self.chain[0].defers(batch.grads, batch.states, group, batch.ctxs)

    def _step_batch(
        self, batch: Batch, grads: list[Tensor], masked: MaskedStep | None,
        keep: Tensor | None = None,
    ) -> list[Stepped]:  # fmt: skip
        """The pipeline every batch runs: the chain's ``prepare``, then per ``foreach`` chunk
        the chain on its directions and the updates applied — ``p ← decay·p − lr·u``, or
        with ``masked`` the masked step's flags and per-parameter decay factors
        (:func:`~galore2.core.apply.apply_masked`). ``keep``: a deferred batch's flags (its
        contexts carry their entries: :meth:`_defers` took the batch where every kernel
        takes them)."""
        group, params, states, ctxs = batch.group, batch.params, batch.states, batch.ctxs
        lr = float(group["lr"])
        decay = self.decay_factor(group)
        self.chain[0].prepare(grads, states, group, ctxs)
        rule = self._adamw_rule(group) if masked is None else None
        if rule is not None and rule.torch_adamw(params, grads, states, group, keep):
            return [(group, state, ctx) for state, ctx in zip(states, ctxs, strict=True)]
        for chunk in chunks(params, group.get("foreach")):
            outs = run_chain(
                self.chain,
                [grads[i] for i in chunk],
                [states[i] for i in chunk],
                group,
                [ctxs[i] for i in chunk],
                decay,
            )
            ps = [params[i] for i in chunk]
            if keep is not None and not all(map(flagged, outs)):
                raise RuntimeError("a deferred step made an update its kernels cannot flag")
            if masked is None:
                apply_updates(ps, outs, lr, decay)
            else:
                apply_masked(ps, outs, lr, masked.flags, chunk, masked.decays_of(chunk))
        return [(group, state, ctx) for state, ctx in zip(states, ctxs, strict=True)]

    def _adamw_rule(self, group: Group) -> Any:
        """The rule that may run ``group``'s whole step by torch's AdamW kernels (its
        ``torch_adamw``, which checks the tensors and picks torch's fused or foreach path):
        when the step is exactly ``torch.optim.AdamW``'s — one chain module whose update in
        this group is Adam's on the full gradient (:meth:`Transform.adamw_rule`), decoupled
        weight decay (``1 − lr·λ``, torch's), no gradient or weight modules, the host-indexed
        non-finite path (unusable gradients already left out; not ``capturable``). None
        otherwise: the chain runs."""
        if (
            len(self.chain) != 1
            or self.grad_transforms
            or self.param_transforms
            or type(self.decay) is not DecoupledWeightDecay
            or group["capturable"]
        ):
            return None
        return self.chain[0].adamw_rule(group)

    def decay_factor(self, group: Group) -> float:
        """This step's decoupled decay factor of ``group`` (1.0 without a decay module)."""
        return 1.0 if self.decay is None else self.decay.factor(group)


def indexed(groups: Iterable[Group]) -> Iterable[tuple[int, Group, Tensor]]:
    """(index over all groups, group, parameter) of every parameter, in order."""
    index = 0
    for group in groups:
        for p in group["params"]:
            yield index, group, p
            index += 1


def real(t: Tensor) -> Tensor:
    """A complex tensor's real view (…, 2), where optimizers update it; others as they are."""
    return torch.view_as_real(t) if t.is_complex() else t


_IS_SPARSE = operator.attrgetter("is_sparse")
_GRAD = operator.itemgetter(1)
