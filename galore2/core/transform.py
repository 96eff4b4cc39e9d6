"""The per-tensor transform protocol every update rule and module implements.

A :class:`Transform` turns an incoming direction (a gradient, or a projected
gradient inside GaLore) into an outgoing one, keeping its own state as tensors
in the parameter's state dict under keys prefixed with its name
(``"adam.exp_avg"``...). Transforms are stateless objects: all state lives in
the optimizer's ``state`` (so ``state_dict``/DCP see it) and all
hyperparameters are read from the parameter group at every step (so LR
schedulers and per-group settings just work).

Contract (like optax's ``(init, update)`` pairs):

* ``init(shape, ref, group, state)`` creates every key this transform will ever
  use, at its final shape, for a direction of ``shape``. It runs once, lazily,
  on the first ``step()``.
* ``update(u, state, group, ctx)`` returns the new direction. It may not keep
  references to ``u``.
* ``kinds`` maps each state key to its accounting kind (``"moments"``,
  ``"basis"``, ``"other"``) for :meth:`state_bytes`.
* ``linear_keys`` / ``quadratic_keys`` list moment tensors that live in the
  direction's coordinates (first-order: rotate like the direction; second-order:
  rotate with squared coefficients). A subspace change (GaLore refresh) uses
  them; ``reset`` re-initialises them through :meth:`reset`.
* ``takes_decay``: a transform that sets it receives the step's decoupled weight decay
  factor ``1 − lr·λ`` as ``update(..., decay=)`` / ``update_many(..., decay=)`` (one
  float per call; 1.0 when the optimizer has no
  :class:`~galore2.core.modules.DecoupledWeightDecay`): GaLore folds it into a projected
  matrix's update. Others never see it.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from typing import Any, ClassVar

import torch
from torch import Tensor

from .module import Context, Group, Module, State
from .module import complex_problem as complex_problem  # importable here, as before


@dataclass
class LowRankUpdate:
    """A full-space direction ``scale · A @ B`` (for a weight of ``shape``) kept as factors.

    The optimizer applies it with one fused ``addmm_`` (decay, update and the
    matmul in a single pass over the weight); :meth:`dense` materializes it for
    transforms that need the full matrix. One factor may be float32 where the other is
    16-bit (a stored fp32 basis against a bf16 N, read as it is by the grouped kernels of
    :mod:`galore2.kernels.ops_lowrank`): it is rounded to the other's dtype first.
    """

    A: Tensor
    B: Tensor
    shape: torch.Size
    scale: float = 1.0
    #: a deferred step's flags (the weight's :attr:`Context.keep`, its flag at ``keep_at``):
    #: the grouped ``addmm_`` that applies it writes nothing where it is False; None on
    #: other steps
    keep: Tensor | None = None
    keep_at: tuple[int, ...] = ()

    def operands(self, dtype: torch.dtype) -> tuple[Tensor, Tensor]:
        """(A, B) in ``dtype`` (each cast only where it is not)."""
        a, b = self.A, self.B
        return (a if a.dtype == dtype else a.to(dtype), b if b.dtype == dtype else b.to(dtype))

    def dense(self) -> Tensor:
        a, b = self.A, self.B
        if a.dtype != b.dtype:  # a float32 factor rounds to the 16-bit one's dtype
            a, b = self.operands(b.dtype if a.dtype == torch.float32 else a.dtype)
        out = (a @ b).view(self.shape)
        return out if self.scale == 1.0 else out.mul_(self.scale)


@dataclass
class ScaledUpdate:
    """A full-space direction ``G ⊙ factor`` kept as its two operands: the gradient ``G``
    (a matrix, in its own dtype, never written) and a float32 ``factor`` broadcast over it
    (per column ``(1, n)``, per row ``(m, 1)`` or per matrix ``(1, 1)``) — APOLLO's scaled
    gradient. The optimizer applies it with one ``addcmul_`` into the weight (no m×n
    float32 update is made); :meth:`dense` materializes it (``shape``: the weight's)."""

    G: Tensor
    factor: Tensor
    shape: torch.Size
    #: a deferred step's flags, as :class:`LowRankUpdate`'s (the grouped ``addcmul_`` that
    #: applies it writes nothing where it is False); None on other steps
    keep: Tensor | None = None
    keep_at: tuple[int, ...] = ()

    def dense(self) -> Tensor:
        return torch.mul(self.G, self.factor).view(self.shape)


@dataclass
class ResidualUpdate:
    """A low-rank direction plus a scaled gradient, ``low + scaled`` (Fira along the data:
    ``P·X + G ⊙ f``, its residual folded into X and f), kept as their operands. The
    optimizer applies a shape batch's in one pass over each weight
    (``galore2::addmm_scaled_each_``: the matmul, the scaled gradient and the decay in one
    epilogue); :meth:`dense` materializes it."""

    low: LowRankUpdate
    scaled: ScaledUpdate

    @property
    def keep(self) -> Tensor | None:
        """A deferred step's flags: its low-rank part's (the two parts carry the same)."""
        return self.low.keep

    @property
    def keep_at(self) -> tuple[int, ...]:
        return self.low.keep_at

    def dense(self) -> Tensor:
        return self.low.dense().float().add_(self.scaled.dense())


#: the directions kept as operands, applied by the optimizer in one fused pass each
FACTORED = (LowRankUpdate, ScaledUpdate, ResidualUpdate)


class StackedState(dict):
    """The state of a *stacked entry* of a batch: ``k`` same-shape directions as one
    ``(k, *shape)`` tensor (GaLore's projected gradients of one shape batch), whose state
    tensors are ``(k, *shape)`` stacks of the ``k`` states' own (see
    :mod:`~galore2.core.packing`): writing them writes each state. ``members``: those
    states, in order; whatever is not stacked (step counters) is read and written there.
    Only a transform whose :meth:`Transform.stacks` says yes is given one."""

    __slots__ = ("members",)

    def __init__(self, stacks: dict[str, Tensor], members: list[State]) -> None:
        super().__init__(stacks)
        self.members = members


def members(states: list[State]) -> tuple[list[State], list[int]]:
    """The states of a batch with every :class:`StackedState` replaced by its members, and
    where each entry's run of them starts (an entry ``i`` covers ``starts[i]`` to
    ``starts[i + 1]``; one more start at the end)."""
    flat: list[State] = []
    starts = [0]
    for s in states:
        if type(s) is StackedState:
            flat += s.members
        else:
            flat.append(s)
        starts.append(len(flat))
    return flat, starts


class Transform(Module):
    """Base class of a per-tensor update rule; see the module docstring for the contract."""

    name: ClassVar[str] = "transform"
    #: state keys this transform wrote under other names in earlier releases (old → new);
    #: ``load_state_dict`` renames them, so older checkpoints keep loading
    renamed_keys: ClassVar[dict[str, str]] = {}
    linear_keys: ClassVar[tuple[str, ...]] = ()
    quadratic_keys: ClassVar[tuple[str, ...]] = ()
    #: True when :meth:`update` and :meth:`update_many` take the step's decoupled decay
    #: factor as a keyword ``decay`` (see :func:`run_chain`)
    takes_decay: ClassVar[bool] = False

    def masked_keys(self, group: Group) -> tuple[str, ...]:
        """State keys this rule leaves bitwise unchanged for a direction whose
        :attr:`Context.mask` is 0.0 (a masked step, ``capturable=True``): the step then does
        not copy and put them back (see :mod:`galore2.core.masked`). Default: none."""
        return ()

    def step_masked_keys(
        self, states: list[State], group: Group, ctxs: list[Context]
    ) -> frozenset[str]:
        """:meth:`masked_keys` for this step of ``states`` (known on the host before the
        chain runs): a rule may add keys it writes for none of them this step (GaLore: its
        bases on a step where no matrix is due for a refresh). The masked step saves and
        puts back none of them this step. Default: :meth:`masked_keys`."""
        return frozenset(self.masked_keys(group))

    def adamw_rule(self, group: Group) -> Transform | None:
        """The rule whose update, in ``group``, makes this module's whole update exactly
        ``torch.optim.AdamW``'s Adam step on the full gradient (moments in its own state
        keys), or None (the default). When the optimizer's chain is that alone, with only
        decoupled weight decay beside it, the rule's ``torch_adamw`` may run the whole step
        of the group with torch's kernels (see
        :meth:`~galore2.core.step.StepEngine._adamw_rule`)."""
        return None

    def defers(
        self, us: list[Tensor], states: list[State], group: Group, ctxs: list[Context]
    ) -> bool:
        """Does the chain's step of these tensors (the chain's first rule answers) take a
        deferred step's flags (:attr:`Context.keep`) in every kernel that writes their state
        or weights, so that the step need not read them (:mod:`galore2.core.deferred`)?
        Asked before the step, with this step's host counters. Default: no (the batch's
        flags are read, as always)."""
        return False

    def stacks(self, group: Group, device: torch.device) -> bool:
        """Can :meth:`update_many` take stacked entries (a :class:`StackedState` with a
        ``(k, *shape)`` direction: each of its ``k`` slices updated as its member's tensor
        would be, by the same elementwise ops) for ``group``'s tensors on ``device``? The
        keys stacked are :attr:`linear_keys` and :attr:`quadratic_keys`; default: no."""
        return False

    def update(self, u: Tensor, state: State, group: Group, ctx: Context) -> Tensor:
        """The outgoing direction for incoming direction ``u`` (must not keep references to ``u``).

        Args:
            u: the incoming direction: a gradient, or a projected gradient inside GaLore.
            state: the parameter's optimizer state (this transform's keys were created by
                :meth:`init`).
            group: the parameter group; hyperparameters are read from it at every step.
            ctx: the parameter and bookkeeping.

        Returns:
            The new direction, at ``u``'s shape.
        """
        raise NotImplementedError

    def update_many(
        self, us: list[Tensor], states: list[State], group: Group, ctxs: list[Context]
    ) -> list[Tensor | LowRankUpdate]:
        """Batched :meth:`update` over a parameter group's tensors.

        The default loops over :meth:`update`; transforms override it with
        ``torch._foreach_*`` kernels, which must give the same result as the loop. Inputs
        are finite unless the group's ``nonfinite`` is ``"ignore"`` (the optimizer's
        non-finite policy runs before the chain).
        """
        return [self.update(u, s, group, c) for u, s, c in zip(us, states, ctxs, strict=True)]

    def prepare(
        self, us: list[Tensor], states: list[State], group: Group, ctxs: list[Context]
    ) -> None:
        """Group-level work before the per-tensor updates (default: nothing). Runs once per
        group and step with every tensor of the group, so work that needs all of them at
        once — e.g. spreading exact SVDs over ranks — can be batched."""

    def screened(
        self, us: list[Tensor], states: list[State], group: Group, ctxs: list[Context]
    ) -> list[Tensor | None]:
        """Per direction, a tensor this rule computes from it anyway, smaller, whose non-finite
        test stands for the direction's (GaLore: the projected gradient R of a matrix not due
        for a refresh), or None (the direction itself is tested). Called by the step engine
        as the first rule of the chain, on the lists :meth:`update` / :meth:`update_many`
        will see; the rule keeps what it computed and uses it when those same directions
        come (see :mod:`galore2.core.nonfinite`), until :meth:`drop_screened`. Default:
        None for every direction."""
        return [None] * len(us)

    def drop_screened(self) -> None:
        """Forget what :meth:`screened` kept (the step is over). Default: nothing kept."""

    def bias_correction(self, state: State, group: Group) -> float:
        """The scalar by which this step's bias correction multiplied the direction just
        returned (Adam: √(1−β₂ᵗ)/(1−β₁ᵗ); 1 for rules without one). Fira's and APOLLO's
        norm-growth limiter compares norms without it (:mod:`galore2.optim.residual`)."""
        return 1.0

    def second_moment_sum(self, state: State, group: Group) -> Tensor | None:
        """Σ of this transform's bias-corrected second moment (for stable weight decay's σ);
        None if it keeps no second moment."""
        return None

    def update_rest(
        self, out: list[Tensor | None], us: list[Tensor], states: list[State], group: Group,
        ctxs: list[Context],
    ) -> list[Tensor]:  # fmt: skip
        """``out`` (a batched :meth:`update_many`'s results) with every entry it left None
        computed by :meth:`update`, one tensor at a time (8-bit moments, for instance)."""
        for i, (u, state, ctx) in enumerate(zip(us, states, ctxs, strict=True)):
            if out[i] is None:
                out[i] = self.update(u, state, group, ctx)  # type: ignore[assignment]
        return out  # type: ignore[return-value]

    def reset(self, state: State, group: Group) -> None:
        """Forget accumulated statistics (moments and their step counts)."""
        for key in (*self.linear_keys, *self.quadratic_keys):
            state[key].zero_()

    def rotate(self, state: State, rotate_fn: Callable[[Tensor, bool], Tensor]) -> None:
        """Move moments into new coordinates: ``rotate_fn(t, squared)`` returns the rotated tensor."""
        for key in self.linear_keys:
            state[key].copy_(rotate_fn(state[key], False))
        for key in self.quadratic_keys:
            state[key].copy_(rotate_fn(state[key], True).clamp_(min=0))


def walk(modules: Iterable[Any]) -> Iterator[Any]:
    """Every module of a chain, depth first, wrappers before what they wrap (``inner``).

    The one place that looks inside wrapper transforms (GaLore): options, validation,
    state kinds and second-moment sums all go through it."""
    for m in modules:
        yield m
        yield from walk(getattr(m, "inner", ()))


def state_kind(transforms: Iterable[Any], key: str) -> str:
    """The accounting kind of a state key, asked of every module of a chain."""
    return next((t.kinds[key] for t in walk(transforms) if key in t.kinds), "other")


def run_chain(
    chain: list[Transform],
    us: list[Tensor],
    states: list[State],
    group: Group,
    ctxs: list[Context],
    decay: float = 1.0,
) -> list[Tensor | LowRankUpdate]:
    """Thread directions through ``chain``: one tensor alone (the CPU path, no list
    machinery) or a batch through each transform's :meth:`Transform.update_many`.
    ``decay``: the step's decoupled weight decay factor, handed to the transforms that
    take it (:attr:`Transform.takes_decay`)."""
    if len(us) == 1 and type(states[0]) is not StackedState:
        u: Tensor | LowRankUpdate = us[0]
        for t in chain:
            if t.takes_decay:
                u = t.update(dense(u), states[0], group, ctxs[0], decay=decay)
            else:
                u = t.update(dense(u), states[0], group, ctxs[0])
        return [u]
    out: list[Tensor | LowRankUpdate] = list(us)
    for t in chain:
        ins = [dense(u) for u in out]
        if t.takes_decay:
            out = t.update_many(ins, states, group, ctxs, decay=decay)
        else:
            out = t.update_many(ins, states, group, ctxs)
    return out


def dense(u: Tensor | LowRankUpdate | ScaledUpdate | ResidualUpdate) -> Tensor:
    """A direction as a dense tensor (a factored one is materialized)."""
    return u.dense() if isinstance(u, FACTORED) else u


def init_chain(
    chain: list[Transform], shape: torch.Size, ref: Tensor, group: Group, state: State, ctx: Context
) -> None:
    for t in chain:
        t.init(shape, ref, group, state, ctx)
