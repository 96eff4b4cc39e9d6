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
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, ClassVar

import torch
from torch import Tensor

from ..placement import LOCAL, Placement

State = dict[str, Tensor]
Group = dict[str, Any]


class NonFiniteUpdate(Exception):
    """Raised by a transform that finds its input non-finite before touching any state."""


@dataclass
class LowRankUpdate:
    """A full-space direction ``scale · A @ B`` (for a weight of ``shape``) kept as factors.

    The optimizer applies it with one fused ``addmm_`` (decay, update and the
    matmul in a single pass over the weight); :meth:`dense` materializes it for
    transforms that need the full matrix.
    """

    A: Tensor
    B: Tensor
    shape: torch.Size
    scale: float = 1.0

    def dense(self) -> Tensor:
        out = (self.A @ self.B).view(self.shape)
        return out if self.scale == 1.0 else out.mul_(self.scale)


@dataclass
class Context:
    """What a transform may need besides the direction: the parameter and bookkeeping."""

    param: Tensor  # the local parameter tensor (a shard under FSDP)
    index: int
    warn_once: Callable[[str], None] = field(default=lambda msg: None)
    placement: Placement = LOCAL
    layout: str = "param"  # how state allocated for this direction is laid out (see Placement)
    shape: torch.Size | None = None  # the parameter's global shape (None: param.shape)
    finite_checked: bool = False  # NaN/Inf already decided by the optimizer (sharded params)
    skip: bool = False  # ... and the decision: skip this parameter's update
    refreshed: bool = False  # a group-level prepare() already ran this step's refresh

    @property
    def global_shape(self) -> torch.Size:
        return self.shape if self.shape is not None else self.param.shape

    def zeros(self, shape: tuple[int, ...] | torch.Size, dtype: torch.dtype) -> Tensor:
        """A state tensor for a direction of global ``shape``, laid out per ``self.layout``."""
        return self.placement.zeros(shape, dtype, self.param.device, self.layout)


class Transform:
    """Base class of a per-tensor update rule; see the module docstring for the contract."""

    name: ClassVar[str] = "transform"
    kinds: ClassVar[dict[str, str]] = {}
    linear_keys: ClassVar[tuple[str, ...]] = ()
    quadratic_keys: ClassVar[tuple[str, ...]] = ()

    def validate(self, group: Group) -> None:
        """Raise ``ValueError`` naming any of this transform's group keys that is invalid."""
        for t in getattr(self, "inner", ()):
            t.validate(group)

    def init(
        self, shape: torch.Size, ref: Tensor, group: Group, state: State, ctx: Context
    ) -> None:
        """Create this transform's state for directions of ``shape`` (``ref`` gives the device)."""

    def update(self, u: Tensor, state: State, group: Group, ctx: Context) -> Tensor:
        raise NotImplementedError

    def update_many(
        self, us: list[Tensor], states: list[State], group: Group, ctxs: list[Context]
    ) -> list[Tensor | LowRankUpdate | None]:
        """Batched :meth:`update` over a parameter group's tensors (``None`` = skipped).

        The default loops over :meth:`update`, turning :class:`NonFiniteUpdate` into
        ``None``; transforms override it with ``torch._foreach_*`` kernels, which must
        give the same result as the loop.
        """
        out: list[Tensor | LowRankUpdate | None] = []
        for u, state, ctx in zip(us, states, ctxs, strict=True):
            try:
                out.append(self.update(u, state, group, ctx))
            except NonFiniteUpdate:
                out.append(None)
        return out

    def prepare(
        self, us: list[Tensor], states: list[State], group: Group, ctxs: list[Context]
    ) -> None:
        """Group-level work before the per-tensor updates (default: nothing). Runs once per
        group and step with every tensor of the group, so work that needs all of them at
        once — e.g. spreading exact SVDs over ranks — can be batched."""

    def checks_nonfinite(self, state: State) -> bool:
        """True if this (first) transform checks its input for NaN/Inf itself, raising
        :class:`NonFiniteUpdate` before changing any state — cheaper than the optimizer's
        check when it can look at a smaller tensor (GaLore checks the projected gradient)."""
        return False

    def second_moment_sum(self, state: State, group: Group) -> Tensor | None:
        """Σ of this transform's bias-corrected second moment (for stable weight decay's σ);
        None if it keeps no second moment."""
        return None

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


def state_kind(transforms: list[Transform], key: str) -> str:
    """The accounting kind of a state key, asked of every transform in a chain."""
    for t in transforms:
        if key in t.kinds:
            return t.kinds[key]
        inner = getattr(t, "inner", None)
        if inner:
            kind = state_kind(list(inner), key)
            if kind != "other":
                return kind
    return "other"


def run_chain(
    chain: list[Transform],
    us: list[Tensor],
    states: list[State],
    group: Group,
    ctxs: list[Context],
) -> list[Tensor | LowRankUpdate | None]:
    """Thread a batch of directions through ``chain``; ``None`` marks a skipped tensor."""
    out: list[Tensor | LowRankUpdate | None] = list(us)
    alive = list(range(len(us)))
    for t in chain:
        if not alive:
            break
        inputs = [_dense(out[i]) for i in alive]
        results = t.update_many(inputs, [states[i] for i in alive], group, [ctxs[i] for i in alive])
        for i, r in zip(alive, results, strict=True):
            out[i] = r
        alive = [i for i in alive if out[i] is not None]
    return out


def run_chain_one(
    chain: list[Transform], u: Tensor, state: State, group: Group, ctx: Context
) -> Tensor | LowRankUpdate:
    """One tensor through ``chain`` (raises :class:`NonFiniteUpdate` to skip it)."""
    for t in chain:
        if isinstance(u, LowRankUpdate):
            u = u.dense()
        u = t.update(u, state, group, ctx)
    return u


def _dense(u: Tensor | LowRankUpdate | None) -> Tensor:
    assert u is not None
    return u.dense() if isinstance(u, LowRankUpdate) else u


def init_chain(
    chain: list[Transform], shape: torch.Size, ref: Tensor, group: Group, state: State, ctx: Context
) -> None:
    for t in chain:
        t.init(shape, ref, group, state, ctx)
