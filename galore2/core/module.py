"""What every module kind shares: :class:`Module`, and the :class:`Context` each is handed.

The kinds — :class:`~galore2.core.transform.Transform` (the moment chain's rules),
:class:`~galore2.core.modules.GradientTransform`, :class:`~galore2.core.modules.ParamTransform`
and :class:`~galore2.core.modules.LRSchedule` — subclass :class:`Module`: a name that
prefixes its state keys, the options it reads from the parameter group, the accounting
kind of each state key, its checks and the creation of its state. Each kind adds how it
acts (``update``, ``apply_``, ``lr``).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass, field, replace
from typing import Any, ClassVar

import torch
from torch import Tensor

from ..placement import LOCAL, Placement
from .options import CrossCheck, Option, check_across

State = dict[str, Tensor]
Group = dict[str, Any]


@dataclass
class Context:
    """What a transform may need besides the direction: the parameter and bookkeeping."""

    param: Tensor  # the local parameter tensor (a shard under FSDP)
    index: int
    warn_once: Callable[[str], None] = field(default=lambda msg: None)
    placement: Placement = LOCAL
    layout: str = "param"  # how state allocated for this direction is laid out (see Placement)
    shape: torch.Size | None = None  # the parameter's global shape (None: param.shape)
    refreshed: bool = False  # a group-level prepare() already ran this step's refresh
    #: a masked (``capturable=True``) step's flag for this direction: 1.0 where its gradient
    #: is usable, 0.0 where it was masked, a float32 device tensor that broadcasts over the
    #: direction (0-d; ``(k, 1, …)`` for a stacked entry); None on other steps. A rule that
    #: lists keys in :meth:`Transform.masked_keys` leaves them unchanged where it is 0.0.
    mask: Tensor | None = None
    #: a deferred step's flags (:mod:`galore2.core.deferred`): its batch's, a 1-D bool device
    #: tensor, True where a gradient is usable; this direction's are at ``keep_at`` (one
    #: position; a stacked entry's members' positions). None on other steps. The kernels
    #: that write the direction's state and weight take them (:mod:`galore2.kernels.keep`):
    #: where its flag is False they write nothing.
    keep: Tensor | None = None
    keep_at: tuple[int, ...] = ()
    #: the dtype the consumer rounds this direction's update to before any other use (GaLore
    #: writing a low-rank update into bf16 weights, its inner chain one rule); None: used as
    #: returned. A rule may then return its direction in that dtype (the same values).
    rounds_to: torch.dtype | None = None
    #: the context a wrapper's inner chain sees for this direction (see :meth:`inner_view`)
    inner: Context | None = field(default=None, repr=False, compare=False)

    def inner_view(self, layout: str) -> Context:
        """This direction's context as a wrapper's inner chain sees it (GaLore's rules on the
        low-rank direction): the same, but laid out per ``layout`` — the layout their state
        was allocated with at init, at every ``update`` too. Made once and kept (``inner``);
        its per-step fields (``mask``, ``keep``, ``refreshed``) are this context's.
        ``global_shape`` stays the parameter's."""
        view = self.inner
        if view is None or view.layout != layout:
            view = self.inner = replace(self, layout=layout, inner=None)
        view.mask, view.refreshed = self.mask, self.refreshed
        view.keep, view.keep_at = self.keep, self.keep_at
        return view

    def rounded_to(self, dtype: torch.dtype | None) -> Context:
        """A copy with ``rounds_to`` set (as :meth:`with_mask`: one a step)."""
        out = self.with_mask(self.mask)
        out.rounds_to = dtype
        return out

    def with_mask(self, mask: Tensor | None) -> Context:
        """A copy with ``mask`` (``dataclasses.replace``'s result, without its per-field
        ``__init__``: a masked step makes one per stacked entry per step)."""
        out = object.__new__(Context)
        out.__dict__.update(self.__dict__)
        out.mask = mask
        return out

    def with_keep(self, keep: Tensor | None, at: tuple[int, ...]) -> Context:
        """A copy with ``keep`` and ``keep_at`` (as :meth:`with_mask`)."""
        out = self.with_mask(self.mask)
        out.keep, out.keep_at = keep, at
        return out

    @property
    def global_shape(self) -> torch.Size:
        """The parameter's global shape (``shape`` when set, else the local parameter's)."""
        return self.shape if self.shape is not None else self.param.shape

    def zeros(self, shape: tuple[int, ...] | torch.Size, dtype: torch.dtype) -> Tensor:
        """A state tensor for a direction of global ``shape``, laid out per ``self.layout``."""
        return self.placement.zeros(shape, dtype, self.param.device, self.layout)


class Module:
    """The base of every module kind: what a module declares and how its state is made.

    State lives in the parameter's state dict under keys prefixed with :attr:`name`,
    created once, at its final shape, by :meth:`init`; hyperparameters are read from the
    parameter group at every step (:attr:`options` declares them).
    """

    #: prefix of this module's state keys (``"adam"``: ``"adam.exp_avg"``...)
    name: ClassVar[str] = "module"
    #: the group keys this module reads (see :mod:`galore2.core.options`)
    options: ClassVar[tuple[Option, ...]] = ()
    #: the accounting kind of each state key (``"moments"``, ``"basis"``, ``"other"``)
    kinds: ClassVar[dict[str, str]] = {}

    #: checks that involve several keys (each key alone was checked against its
    #: :class:`~galore2.core.options.Option` already), each with every key it reads
    checks: tuple[CrossCheck, ...] = ()

    def validate(self, group: Group) -> None:
        """Run :attr:`checks` on ``group`` (a module applied by hand; the optimizer runs
        them when it resolves a group): ``ValueError`` naming the keys."""
        check_across(self.checks, group)

    def complex_problem(self, group: Group) -> str | None:
        """Why this module cannot act on complex parameters in ``group`` (None: it can; a
        transform is then handed the parameter's ``torch.view_as_real`` view)."""
        return complex_problem(self)

    def capture_problem(self, group: Group) -> str | None:
        """Why a step of this module cannot replay from a CUDA graph (None: it can; see
        :mod:`galore2.core.capture`). Default: it is not known to."""
        return not_known_to_replay(self)

    def init(
        self, shape: torch.Size, ref: Tensor, group: Group, state: State, ctx: Context
    ) -> None:
        """Create this module's state for a parameter (or direction) of global ``shape``
        (``ref`` gives the device; default: none)."""


def refuse_validate_overrides(modules: Iterable[Any]) -> None:
    """A module written for an earlier galore2 may override ``validate(group)``, which the
    optimizer does not call (it runs every module's ``checks``): refused, never skipped."""
    for m in modules:
        own = getattr(m if isinstance(m, type) else type(m), "validate", None)
        if own is not None and own is not Module.validate:
            raise TypeError(
                f"{getattr(m, '__name__', type(m).__name__)} overrides validate(group), which "
                "galore2 optimizers do not call: declare its checks across keys as checks = "
                "(CrossCheck(keys, fn),) (galore2.core.options), keys naming every key fn reads"
            )


def complex_problem(module: Any) -> str:
    """The default answer of ``complex_problem``: not defined for complex parameters."""
    return f"{type(module).__name__} is not defined for complex parameters"


def not_known_to_replay(module: Any) -> str:
    """The default answer of ``capture_problem``: not known to replay from a graph."""
    return f"{type(module).__name__} is not known to replay from a graph"
