"""Modules that act outside the moment chain: on the full gradient before it, on weights after it.

A :class:`ChainOptimizer` step runs, per parameter group:

1. every :class:`GradientTransform` on each parameter's **full** (local) gradient, in
   place and in the order given (AGC, centralization, normalization...). They run
   before GaLore projects the gradient, so inside GaLore they still see the full
   gradient;
2. the moment chain (Adam, PNM..., wrapped in GaLore for projected matrices) and the
   update ``p ← decay·p − lr·u``, ``decay = 1 − lr·λ`` the factor of the optimizer's
   :class:`DecoupledWeightDecay` (1 without one; GaLore folds it into a projected
   matrix's update too, see :mod:`galore2.optim.galore`);

and after every group has been updated:

3. every :class:`ParamTransform` on the parameters, in the order given (norm loss,
   stable weight decay, lookahead). Those that need statistics over *all*
   parameters (stable weight decay's σ) set ``needs_stats``; the optimizer then
   computes :class:`Stats` once per step (all-reduced across ranks for sharded
   parameters).

On the batched path (``foreach``: accelerators, or ``foreach=True``) each module gets a
whole batch at once (``apply_many``; the default loops over ``apply_``), and the batches of
groups that give a module the same option values (its ``batch_key``) are merged, so the
decay and no-decay groups of a model are one batch for AGC or norm loss.

Both kinds keep their state (if any) as tensors in the parameter's state dict, under
keys prefixed with their name, created once in ``init`` — like :class:`Transform`.
Gradient transforms modify ``.grad`` in place (as ``clip_grad_norm_`` does): a skipped
(non-finite) parameter's gradient may have been rescaled, its weights and state not.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from itertools import groupby
from typing import Any, ClassVar

import torch
from torch import Tensor

from .module import Context, Group, Module, State
from .options import CrossCheck, Option, Real
from .state import counter
from .transform import Transform, walk


@dataclass
class Stats:
    """Statistics over every parameter stepped this step (global under FSDP)."""

    second_moment_mean: Tensor  # Σ bias-corrected second moments / Σ parameter elements
    cache: dict[Any, Tensor] = field(default_factory=dict)  # modules' values derived from it


class GradientTransform(Module):
    """Acts on a parameter's full local gradient, in place, before the moment chain."""

    name: ClassVar[str] = "gradient"

    def apply_(self, grad: Tensor, group: Group, state: State, ctx: Context) -> None:
        """Transform ``grad`` (the local gradient; ``ctx.param`` is the local weight) in place."""
        raise NotImplementedError

    def batch_key(self, group: Group) -> tuple:
        """What this module reads from ``group``: batches of groups with equal keys are
        merged into one :meth:`apply_many` call (default: its options' values)."""
        return tuple(group.get(o.name) for o in self.options)

    def apply_many(
        self, grads: list[Tensor], group: Group, states: list[State], ctxs: list[Context]
    ) -> None:
        """Batched :meth:`apply_` over a batch of a group's tensors (``foreach``): the
        default loops; modules override it with ``torch._foreach_*`` kernels and stacked
        reductions that give the loop's result (within float rounding)."""
        for grad, state, ctx in zip(grads, states, ctxs, strict=True):
            self.apply_(grad, group, state, ctx)


class ParamTransform(Module):
    """Acts on a parameter after the step's update has been applied."""

    name: ClassVar[str] = "param"
    #: True when :meth:`apply_` needs :class:`Stats` over all parameters (not available to
    #: per-layer updates, which step one parameter at a time).
    needs_stats: ClassVar[bool] = False

    def apply_(self, group: Group, state: State, ctx: Context, stats: Stats | None) -> None:
        """Update the local weight ``ctx.param`` in place."""
        raise NotImplementedError

    def uses_stats(self, group: Group) -> bool:
        """Whether :meth:`apply_` will read the step's :class:`Stats` for ``group`` (they are
        computed only when some group's module will: default ``needs_stats``)."""
        return self.needs_stats

    def batch_key(self, group: Group) -> tuple:
        """What this module reads from ``group``: batches of groups with equal keys are
        merged into one :meth:`apply_many` call (default: its options' values and ``lr``)."""
        return (*(group.get(o.name) for o in self.options), group.get("lr"))

    def apply_many(
        self, group: Group, states: list[State], ctxs: list[Context], stats: Stats | None
    ) -> None:
        """Batched :meth:`apply_` over a batch of a group's parameters (``foreach``): the
        default loops; modules override it with ``torch._foreach_*`` kernels."""
        for state, ctx in zip(states, ctxs, strict=True):
            self.apply_(group, state, ctx, stats)


WEIGHT_DECAY = Option(
    "weight_decay", 0.0, Real(low=0.0), "decoupled weight decay λ: p ← p·(1 − lr·λ)"
)


class DecoupledWeightDecay:
    """Decoupled weight decay (Loshchilov & Hutter, AdamW): ``p ← p·(1 − lr·λ)``.

    Acts on: every parameter of the step, fused with the update — the optimizer applies
    ``p ← decay·p − lr·u`` with this module's :meth:`factor` (the decay-then-update order
    of ``torch.optim.AdamW``; one ``addmm_`` ``beta`` for a low-rank update). The chain
    receives the same factor (``decay=`` of a transform with ``takes_decay``): GaLore
    folds it into a projected matrix's update, galore-torch's decay-after order. State per
    element: 0. Group key: ``weight_decay`` (λ, default 0); ``lr`` is the group's
    (scheduled) learning rate.

    A :class:`ChainOptimizer` has one unless built with ``decay=None``; a weight module
    that reads ``weight_decay`` itself (stable weight decay) replaces it.
    """

    name: ClassVar[str] = "weight_decay"
    options: ClassVar[tuple[Option, ...]] = (WEIGHT_DECAY,)
    checks: ClassVar[tuple[CrossCheck, ...]] = ()  # nothing beyond weight_decay's own check
    kinds: ClassVar[dict[str, str]] = {}

    def complex_problem(self, group: Group) -> str | None:
        """None: a real factor scales the real and imaginary parts alike."""
        return None

    def capture_problem(self, group: Group) -> str | None:
        """None: a Python float per group, frozen into a captured graph like ``lr``
        (:mod:`galore2.core.capture`)."""
        return None

    @staticmethod
    def factor(group: Group) -> float:
        """``1 − lr·λ`` of ``group`` (its scheduled ``lr``): what the step multiplies the
        weights by before the update."""
        return 1.0 - float(group["lr"]) * group["weight_decay"]


def second_moment_sum(chain: list, state: State, group: Group) -> Tensor | None:
    """Σ of the bias-corrected second moment held in ``state`` by the first transform of
    ``chain`` (searching inside wrappers such as GaLore) that keeps one; None if none does."""
    sums = (t.second_moment_sum(state, group) for t in walk(chain))
    return next((total for total in sums if total is not None), None)


def _batched_keeper(chain: list) -> Any:
    """The module :func:`second_moment_sum` would find for every parameter, when it has a
    batched ``second_moment_sum_many`` (the modules before it in the chain keep no second
    moment: they do not override ``second_moment_sum``); None otherwise."""
    for module in walk(chain):
        if hasattr(module, "second_moment_sum_many"):
            return module
        if type(module).second_moment_sum is not Transform.second_moment_sum:
            return None
    return None


Batch = tuple[Group, list[State], list[Context]]
Chunks = Callable[[list[Tensor], Any], list[list[int]]]


def compute_stats(
    chain: list, items: list[tuple[Group, State, Context]], batches: list[Batch] | None = None
) -> Stats:
    """σ² for stable weight decay: Σ v̂ over the stepped parameters ÷ their element count.

    Low-rank moments are summed as stored (r·n values) but divided by the full m·n
    elements. Sharded parameters contribute their local sums, all-reduced once. ``batches``
    (the same parameters as ``items``, batched as the chain batches them): each batch of
    local parameters is summed at once when the module keeping the second moment has a
    ``second_moment_sum_many``; otherwise (and without ``batches``) one parameter at a time.
    """
    local: Tensor | None = None  # on the parameters' device: no host read
    numel: int | Tensor = 0
    sharded = None
    keeper = _batched_keeper(chain)
    rest = items
    if batches is not None and keeper is not None:
        rest = []
        for group, states, ctxs in batches:
            total = None
            # a masked step's parameters one by one: a masked one counts as not stepped
            if (
                len(states) > 1
                and not any(c.placement.distributed for c in ctxs)
                and ctxs[0].mask is None
            ):
                total = keeper.second_moment_sum_many(states, group)
            if total is None:
                rest += [(group, s, c) for s, c in zip(states, ctxs, strict=True)]
                continue
            total = total.double()
            local = total if local is None else local + total.to(local.device)
            numel += sum(ctx.global_shape.numel() for ctx in ctxs)
    for group, state, ctx in rest:
        total = second_moment_sum(chain, state, group)
        if ctx.mask is not None:  # a masked step: a masked parameter is left out, as skipped
            mask = ctx.mask.double()
            total = None if total is None else total.double() * mask
            numel = numel + mask * ctx.global_shape.numel()
        else:
            numel += ctx.global_shape.numel()
        if total is not None:
            total = total.double()
            local = total if local is None else local + total.to(local.device)
        if ctx.placement.distributed:
            sharded = ctx.placement
    if local is None:
        local = torch.zeros((), dtype=torch.float64, device=items[0][2].param.device)
    if sharded is not None:
        device = next(ctx.param.device for _, _, ctx in items if ctx.placement.distributed)
        local = sharded.reduce(local.to(device))
    if isinstance(numel, Tensor):  # a masked step's count, on the device
        return Stats(second_moment_mean=local / numel.to(local.device).clamp(min=1))
    return Stats(second_moment_mean=local / max(numel, 1))


def _batches(items: list[tuple[Group, State, Context]], chunks: Chunks | None) -> list[Batch]:
    """``items`` as batches: consecutive items of one group, split by ``chunks(params,
    foreach)`` (one parameter per batch without it)."""
    out: list[Batch] = []
    for _, run in groupby(items, key=lambda item: id(item[0])):
        members = list(run)
        group = members[0][0]
        if chunks is None:
            parts = [[i] for i in range(len(members))]
        else:
            parts = chunks([ctx.param for _, _, ctx in members], group.get("foreach"))
        for part in parts:
            out.append((group, [members[i][1] for i in part], [members[i][2] for i in part]))
    return out


def merged(module: Any, batches: Sequence[tuple]) -> list[tuple[Group, list[int]]]:
    """``batches`` ((group, ...) with ``ctxs`` last) regrouped for ``module``: batches of
    several tensors whose groups give it the same :meth:`batch_key`, on one device, become
    one; each entry is (the first batch's group, the batches' indices). Batches of one
    tensor stay alone (the per-tensor path)."""
    out: list[tuple[Group, list[int]]] = []
    where: dict[tuple, int] = {}
    for b, batch in enumerate(batches):
        group, ctxs = batch[0], batch[-1]
        if len(ctxs) == 1:
            out.append((group, [b]))
            continue
        key = (module.batch_key(group), ctxs[0].param.device)
        if key in where:
            out[where[key]][1].append(b)
        else:
            where[key] = len(out)
            out.append((group, [b]))
    return out


def run_grad_transforms(
    transforms: Sequence[GradientTransform],
    batches: Sequence[tuple[Group, list[Tensor], list[State], list[Context]]],
) -> None:
    """Apply every gradient module, in order, to the gradients of ``batches`` ((group,
    grads, states, ctxs), each already chunked as the chain batches it), in place: batches
    of groups that give a module the same :meth:`GradientTransform.batch_key` go through
    one :meth:`GradientTransform.apply_many`; a batch of one tensor through ``apply_``."""
    for t in transforms:
        for group, members in merged(t, batches):
            if len(members) == 1 and len(batches[members[0]][1]) == 1:
                _, (grad,), (state,), (ctx,) = batches[members[0]]
                t.apply_(grad, group, state, ctx)
                continue
            t.apply_many(
                [g for b in members for g in batches[b][1]],
                group,
                [s for b in members for s in batches[b][2]],
                [c for b in members for c in batches[b][3]],
            )


def run_param_transforms(
    transforms: list[ParamTransform],
    chain: list,
    items: list[tuple[Group, State, Context]],
    chunks: Chunks | None = None,
) -> None:
    """Apply every parameter module, in order, to every stepped parameter.

    ``chunks(params, foreach)`` batches each group's parameters as the chain does (lists of
    indices, see ``galore2.core.apply.chunks``): batches of several parameters whose groups
    give a module the same :meth:`ParamTransform.batch_key` go through one
    :meth:`ParamTransform.apply_many`; a batch of one through ``apply_``. The step's
    :class:`Stats` are computed only if some module will read them.
    """
    if not transforms or not items:
        return
    batches = _batches(items, chunks)
    stats = None
    if any(t.needs_stats and t.uses_stats(group) for t in transforms for group, _, _ in batches):
        stats = compute_stats(chain, items, batches)
    for t in transforms:
        for group, members in merged(t, batches):
            if len(members) == 1 and len(batches[members[0]][1]) == 1:
                _, (state,), (ctx,) = batches[members[0]]
                t.apply_(group, state, ctx, stats)
                continue
            states = [s for b in members for s in batches[b][1]]
            t.apply_many(group, states, [c for b in members for c in batches[b][2]], stats)


class LRSchedule(Module):
    """A built-in learning-rate schedule: the group's ``lr`` is its peak, scaled per step.

    The step count lives in each parameter's state (``schedule.step``, so resuming is
    exact); :meth:`step_lr` reads it from the first parameter of a group's step and
    advances every parameter stepped. Subclasses implement :meth:`lr`.
    """

    name: ClassVar[str] = "schedule"
    kinds: ClassVar[dict[str, str]] = {"schedule.step": "other"}

    def complex_problem(self, group: Group) -> str | None:
        return None  # it only scales the learning rate

    def init(
        self, shape: torch.Size, ref: Tensor, group: Group, state: State, ctx: Context
    ) -> None:
        """The step counter of a parameter's schedule."""
        state["schedule.step"] = counter()

    def lr(self, group: Group, step: int) -> float:
        """The lr of ``group`` after ``step`` optimizer steps."""
        raise NotImplementedError

    def step_lr(self, group: Group, states: list[State]) -> float:
        """This step's lr for ``group`` (whose stepped parameters have ``states``)."""
        lr = self.lr(group, int(states[0]["schedule.step"]))
        for state in states:
            state["schedule.step"] += 1
        return lr
