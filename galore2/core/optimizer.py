"""``ChainOptimizer``: the one ``torch.optim.Optimizer`` that every galore2 optimizer is.

A preset (``GaLoreAdamW``…) only chooses the chain of transforms and the
defaults; the step below is shared, never copied. Per parameter, a step is:

1. skip parameters without a gradient; refuse sparse gradients;
2. create state lazily (every key at its final shape, see :meth:`init_state`);
3. gradient modules act on the full gradient, in place (AGC, centralization...);
4. check: the non-finite policy (:mod:`galore2.core.nonfinite`) decides which
   parameters are updated;
5. chain: ``u = chain(grad)``; apply: ``p ← decay·p − lr·u``, ``decay = 1 − lr·λ`` the
   factor of the optimizer's :class:`~galore2.core.modules.DecoupledWeightDecay` (the
   decay-then-update order of ``torch.optim.AdamW``; 1 without one), which the chain
   receives too (GaLore folds it into a projected matrix's update);
6. weight modules act on the updated weights (norm loss, lookahead...).

Options: every group key is declared once, by the module that reads it
(:mod:`galore2.core.options`); the optimizer's defaults, its validation (unknown keys
are errors) and every integration derive from those declarations.

State holds tensors only, so ``state_dict()`` round-trips through
``torch.load(weights_only=True)``; :meth:`load_state_dict` checks a checkpoint against
this optimizer before changing anything (:mod:`galore2.core.resume`) and keeps each
state tensor's saved dtype (torch's default would cast int counters, seeds and fp32
moments of bf16 parameters to the parameter's dtype). ``copy.deepcopy`` and pickle
carry the modules along (torch's ``__getstate__`` keeps only defaults, state, groups).

Complex parameters are updated through ``torch.view_as_real`` (as ``torch.optim.AdamW``
does): their state lives at the real view's shape ``(*shape, 2)``. A group holding one
is refused unless every module is defined for it (``complex_problem``).
"""

from __future__ import annotations

import operator
import warnings
from collections.abc import Callable, Iterable, Mapping, Sequence
from contextlib import ExitStack
from dataclasses import dataclass, field, replace
from functools import partial
from itertools import chain as iter_chain
from typing import Any, ClassVar

import torch
from torch import Tensor

from .. import _numerics
from ..fsdp.detect import is_dtensor  # cheap: imports nothing distributed
from ..kernels.dispatch import run_kernel
from ..placement import LOCAL, Placement
from .masked import (
    CounterSnapshot,
    FlagBuffer,
    MaskedStep,
    Snapshot,
    derive,
    masked_grads,
    masked_updates,
    usable_or_one,
)
from .modules import (
    WEIGHT_DECAY,
    DecoupledWeightDecay,
    GradientTransform,
    LRSchedule,
    ParamTransform,
    run_grad_transforms,
    run_param_transforms,
)
from .nonfinite import SKIPS, NonFinitePolicy, read_flags
from .options import Bool, LearningRate, Option, Optional, closest, collect, hints, resolve
from .resume import (
    SCHEDULED,
    Settings,
    compare_groups,
    compare_state,
    known_prefixes,
    optional_keys,
    refusal,
)
from .state import counter, counter_on
from .stored import Writes, parts, refuse, store_of
from .transform import Context, LowRankUpdate, Transform, init_chain, run_chain, state_kind, walk

LR = Option("lr", 1e-3, LearningRate(), "learning rate (LR schedulers write it every step)")
MAXIMIZE = Option("maximize", False, Bool(), "maximize the objective instead of minimizing it")
FOREACH = Option(
    "foreach",
    None,
    Optional(Bool(), "batched on accelerators, per tensor on the CPU"),
    "True: batch a group's tensors through the chain (foreach kernels) on any device; "
    "False: one tensor at a time",
)
#: Group keys that are not options but are accepted (and left alone): torch's LR
#: schedulers' ``initial_lr``, torch's ``param_names`` (named parameters) and a free-form
#: ``name`` label.
PASSTHROUGH_KEYS = frozenset({"params", "initial_lr", "param_names", "name"})

ParamsT = Iterable[Tensor] | Iterable[dict[str, Any]]
#: ``decay="auto"`` (the default of :class:`ChainOptimizer`): decoupled weight decay,
#: unless a weight module reads ``weight_decay`` itself (stable weight decay replaces it)
AUTO = "auto"


class ChainOptimizer(torch.optim.Optimizer):
    """Runs a chain of :class:`~galore2.core.transform.Transform` per parameter.

    ``defaults`` overrides the declared defaults of the modules' options; a key that no
    module declares raises ``TypeError``. A preset lists in :attr:`modules` every module
    class its constructor may put in the chain, so that :meth:`declared_options` knows its
    options before it is built (recipes and integrations enumerate them from there).

    ``decay`` is the decoupled weight decay module (it declares ``weight_decay``; the step
    applies its factor ``1 − lr·λ`` with the update and hands it to the chain). ``"auto"``:
    a :class:`~galore2.core.modules.DecoupledWeightDecay`, unless a weight module in
    ``param_transforms`` reads ``weight_decay`` itself (``StableWeightDecay``, which
    replaces it); ``None``: no decoupled decay (the chain receives 1.0).
    """

    #: options of the optimizer loop itself
    options: ClassVar[tuple[Option, ...]] = (
        LR,
        MAXIMIZE,
        FOREACH,
        *NonFinitePolicy.options,
    )
    #: module classes (or instances) a preset may chain; their options are its options
    modules: ClassVar[tuple[Any, ...]] = (DecoupledWeightDecay,)
    #: constructor switches of a preset (not group keys), declared like options
    construct_options: ClassVar[tuple[Option, ...]] = ()
    #: what to say about a key this optimizer does not have (e.g. Adam's ``betas`` given
    #: to Adafactor), appended to the unknown-key error
    option_hints: ClassVar[dict[str, str]] = {}
    #: a preset's own defaults for options its modules declare (Fira: ``residual="fira"``);
    #: :meth:`declared_options` reports them, so docs, recipes and integrations see them
    preset_defaults: ClassVar[dict[str, Any]] = {}

    def __init__(
        self,
        params: ParamsT,
        chain: list[Transform],
        defaults: dict[str, Any],
        *,
        grad_transforms: Sequence[GradientTransform] = (),
        param_transforms: Sequence[ParamTransform] = (),
        schedule: LRSchedule | None = None,
        decay: DecoupledWeightDecay | str | None = AUTO,
    ) -> None:
        self._chain = list(chain)
        self._schedule = schedule
        self._grad_transforms = list(grad_transforms)
        self._param_transforms = list(param_transforms)
        self._decay = _decay_module(decay, self._param_transforms)
        self._derive()
        unknown = sorted(set(defaults) - set(self.declared))
        if unknown:
            raise TypeError(
                f"{type(self).__name__}: unexpected keyword arguments {unknown}"
                f"{closest(unknown, self.declared)}; its options are {sorted(self.declared)}"
                f"{self._hints(unknown)}"
            )
        self._warned: set[str] = set()
        full = {name: opt.default for name, opt in self.declared.items()}
        full.update(defaults)
        super().__init__(params, full)

    def _derive(self) -> None:
        """What follows from the modules: the declared options, and empty caches keyed by
        parameter ``id()`` (rebuilt on use)."""
        self._all_modules = [
            *self._grad_transforms,
            *self._chain,
            *([self._decay] if self._decay is not None else []),
            *self._param_transforms,
            *([self._schedule] if self._schedule is not None else []),
        ]
        self.declared = self.declared_options(self._all_modules)
        # counters a masked step keeps on the parameters' device (Adam's step): put back for
        # a masked parameter after its step (:class:`~galore2.core.masked.MaskedStep`)
        self._device_counters = frozenset(
            k for m in walk(self._all_modules) for k in getattr(m, "device_counters", ())
        )
        # host step counters a masked step advances for every parameter (GaLore's
        # ``galore.step``): set back by a masked parameter's skips when they are read
        # (:meth:`_flush_skips`), before any decision that reads them (:meth:`_due_flush`)
        self._host_counters = frozenset(
            k for m in walk(self._all_modules) for k in getattr(m, "host_step_counters", ())
        )
        self._refresh_askers = [
            m.refresh_due for m in walk(self._all_modules) if hasattr(m, "refresh_due")
        ]
        self._placements: dict[int, Placement] = {}
        self._contexts: dict[int, Context] = {}  # plain parameters' contexts, by id()
        # per group (its id()): (state mapping, items, lists) of the last _gather
        self._gather_cache: dict[int, tuple[Any, list, tuple[list, ...]]] = {}
        self._snapshots: dict[int, Snapshot] = {}  # capturable: per group, see _masked_step
        self._counter_snapshots: dict[int, CounterSnapshot] = {}  # likewise: device counters
        self._flag_buffers: dict[int, FlagBuffer] = {}  # likewise
        # capturable: skips counted on the device, per batch of parameters (their ids)
        self._pending_skips: dict[tuple[int, ...], tuple[list[Tensor], Tensor]] = {}
        self._skip_keys: dict[int, tuple[int, ...]] = {}  # per group: its last batch's key
        self._where: tuple[int, dict[int, tuple[dict[str, Any], int]]] | None = None
        self._writes = Writes()  # int8 weights: this step's working copies (core/stored.py)
        self._settings = Settings(self.declared, walk(self._all_modules))

    # ---- copy.deepcopy, pickle ---------------------------------------------------
    #: instance attributes that travel with a copy besides torch's (defaults, state,
    #: param_groups); everything else is derived again (:meth:`_derive`)
    _PICKLED = ("_chain", "_schedule", "_decay", "_grad_transforms", "_param_transforms", "_warned")

    def __getstate__(self) -> dict[str, Any]:
        """torch keeps only defaults, state and groups; the modules travel too, and
        ``switches`` (a preset's constructor switches) when there are some. Step hooks are
        dropped, as torch drops them."""
        self._flush_skips()
        out = super().__getstate__()
        for key in (*self._PICKLED, "switches"):
            if key in self.__dict__:
                out[key] = self.__dict__[key]
        return out

    def __setstate__(self, state: dict[str, Any]) -> None:
        super().__setstate__(state)
        if "_chain" in state:  # not when torch's load_state_dict calls it with two keys
            if "_decay" not in state:  # pickled by a release whose loop applied the decay
                self._decay = _decay_module(AUTO, self._param_transforms)
            self._derive()

    def _hints(self, keys: Sequence[str]) -> str:
        return hints(self.option_hints, keys)

    @classmethod
    def declared_options(cls, chain: Sequence[Any] = ()) -> dict[str, Option]:
        """Every group option of this optimizer: the loop's, then its modules' (in chain
        order, looking inside wrappers), each declared once."""
        declared = collect(
            [
                cls.options,
                *(m.options for m in walk(cls.modules)),
                *(m.options for m in walk(chain)),
            ]
        )
        for name, value in cls.preset_defaults.items():
            declared[name] = replace(declared[name], default=declared[name].validate(value))
        return declared

    @classmethod
    def all_options(cls) -> dict[str, Option]:
        """Group options and constructor switches: what a recipe or an integration may set."""
        return collect([cls.declared_options().values(), cls.construct_options])

    # ---- groups ------------------------------------------------------------------
    def add_param_group(self, param_group: dict[str, Any]) -> None:
        """Fill defaults, validate every key, then add (nothing is added if validation fails)."""
        if not isinstance(param_group, dict):
            raise TypeError(f"param_group must be a dict, got {type(param_group).__name__}")
        hint = self._hints([k for k in param_group if k not in self.declared])
        group = resolve(
            self.declared,
            param_group,
            self.defaults,
            passthrough=PASSTHROUGH_KEYS,
            owner=f"{type(self).__name__}{hint}",
        )
        NonFinitePolicy.validate(group)
        for module in walk(self._all_modules):
            module.validate(group)
        if group.get("weight_decay") and not any(
            WEIGHT_DECAY in m.options for m in walk(self._all_modules)
        ):  # accepted (a preset's switched-off module declares it) but read by no module
            raise ValueError(
                f"{type(self).__name__}: weight_decay={group['weight_decay']!r} would be ignored: "
                "no module applies it (decay=None); use weight_decay=0.0, or decay='auto'"
            )
        self._check_complex(group)
        super().add_param_group(group)

    def _check_complex(self, group: dict[str, Any]) -> None:
        """Complex parameters are updated through their ``torch.view_as_real`` view (as
        ``torch.optim.AdamW`` does), where every module of the chain is defined for them."""
        params = group["params"]
        if isinstance(params, set):
            return  # torch's add_param_group refuses sets (unordered)
        # torch turns an iterable into a list too: read a generator once
        params = group["params"] = [params] if isinstance(params, Tensor) else list(params)
        tensors = [p[1] if isinstance(p, tuple) else p for p in params]  # (name, p): named
        bad = [p for p in tensors if isinstance(p, Tensor) and p.is_complex()]
        problems = [m.complex_problem(group) for m in walk(self._all_modules)]
        problems = [why for why in problems if why is not None]
        if bad and problems:
            shapes = [f"{tuple(p.shape)} {str(p.dtype)[6:]}" for p in bad]
            raise ValueError(
                f"{type(self).__name__}: complex parameters ({', '.join(shapes)}) in a group "
                f"where {'; '.join(problems)}. GaLoreAdamW updates complex parameters in "
                "groups with rank=None (AdamW on the real and imaginary parts, as "
                "torch.optim.AdamW); otherwise optimize real tensors (e.g. keep "
                "torch.view_as_real(p) as the parameter)"
            )

    # ---- state -------------------------------------------------------------------
    def _warn_once(self, message: str) -> None:
        if message not in self._warned:
            self._warned.add(message)
            warnings.warn(message, stacklevel=4)

    def _placement(self, p: Tensor) -> Placement:
        """LOCAL for a plain tensor; a galore2.fsdp placement for a DTensor (imported lazily).

        Built for every parameter at once (and again after ``add_param_group``), so an
        unsupported DTensor anywhere raises before any parameter is touched.
        """
        placement = self._placements.get(id(p))
        if placement is None:
            params = [q for _, _, q in self._indexed_params()]
            built: dict[int, Placement] = {}
            if any(is_dtensor(q) for q in params):
                from ..fsdp import assign_owners, placement_for

                for q in params:
                    built[id(q)] = placement_for(q) if is_dtensor(q) else LOCAL
                assign_owners([(q.shape, built[id(q)]) for q in params])
            else:
                built = {id(q): LOCAL for q in params}
            self._placements = built
            placement = built.get(id(p), LOCAL)
        return placement

    def _context(self, p: Tensor, index: int) -> Context:
        """The parameter's :class:`Context`. A plain (local, real) parameter's is built once
        and reused by every step (it holds nothing that changes between steps); the cache
        is emptied by :meth:`_derive`, and an entry is rebuilt when the parameter's index
        changed (``add_param_group``) or a group-level ``prepare`` marked it refreshed."""
        store = store_of(p)
        if store is not None:  # int8 weights: a dense fp32 working copy (core/stored.py)
            refuse({}, p, is_dtensor(p))
            return Context(param=store.dequantize(), index=index, warn_once=self._warn_once,
                           shape=p.shape)  # fmt: skip
        cached = self._contexts.get(id(p))
        fresh = cached is not None and not cached.refreshed
        if fresh and cached.param is p and cached.index == index:
            return cached
        placement = self._placement(p)
        if placement is LOCAL and not p.is_complex():
            ctx = Context(param=p, index=index, warn_once=self._warn_once, shape=p.shape)
            self._contexts[id(p)] = ctx
            return ctx
        return Context(
            param=_real(placement.local(p)),
            index=index,
            warn_once=self._warn_once,
            placement=placement,
            shape=torch.Size((*p.shape, 2)) if p.is_complex() else p.shape,
        )

    def _init_param_state(self, p: Tensor, group: dict[str, Any], index: int) -> None:
        ctx = self._context(p, index)  # validates a DTensor's placement before any state exists
        self._fill_state(self.state[p], group, ctx)

    def _expected_state(self, p: Tensor, group: dict[str, Any], index: int) -> dict[str, Tensor]:
        """The state the first step would create for ``p``, built on the meta device (keys,
        shapes, dtypes; CPU counters are real): what :meth:`load_state_dict` compares with."""
        ctx = self._context(p, index)
        state: dict[str, Tensor] = {}
        self._fill_state(state, group, replace(ctx, param=ctx.param.to("meta")))
        return state

    def _fill_state(self, state: dict[str, Tensor], group: dict[str, Any], ctx: Context) -> None:
        state[SKIPS] = counter()
        if self._schedule is not None:
            self._schedule.init(ctx.global_shape, ctx.param, group, state, ctx)
        for hook in (*self._grad_transforms, *self._param_transforms):
            hook.init(ctx.global_shape, ctx.param, group, state, ctx)
        init_chain(self._chain, ctx.global_shape, ctx.param, group, state, ctx)

    def _indexed_params(self) -> Iterable[tuple[int, dict[str, Any], Tensor]]:
        index = 0
        for group in self.param_groups:
            for p in group["params"]:
                yield index, group, p
                index += 1

    @torch.no_grad()
    def init_state(self) -> None:
        """Create the state of every parameter now (as the first ``step()`` would).

        Useful to size state without training (works on the meta device) and
        before loading a checkpoint.
        """
        self._check_settings(self.param_groups)
        for index, group, p in self._indexed_params():
            if not self.state[p]:
                self._init_param_state(p, group, index)

    def due_for_refresh(self) -> list[Tensor]:
        """The parameters whose next ``step()`` refreshes a basis (a module's
        ``refresh_due(state, group)``: GaLore's schedule, the predicate its step uses) or
        creates their state. The schedule is first brought up to date with edited options
        (``update_proj_gap``…) exactly as ``step()`` does, so an edit between steps is
        seen here too (:class:`~galore2.core.capture.CapturedStep` runs those steps
        eagerly). Where one is due by host counters that may still count masked steps
        (skips pending on the device), the skips are read first, as ``step()`` reads them
        (:meth:`_due_flush`): the answer is the skip path's."""
        self._check_settings(self.param_groups)  # as step() does first: edits re-planned
        askers = self._refresh_askers

        def due() -> list[Tensor]:
            return [
                p
                for g in self.param_groups
                for p in g["params"]
                if not self.state.get(p) or any(ask(self.state[p], g) for ask in askers)
            ]

        found = due()
        if self._pending_skips and any(self.state.get(p) for p in found):
            self._flush_skips()
            found = due()
        return found

    def _check_settings(self, groups: Sequence[dict[str, Any]]) -> None:
        """Options changed in ``groups`` since the state was made: a state-shaping one is
        refused, a cached one re-planned (:class:`~galore2.core.resume.Settings`)."""
        self._settings.check(type(self).__name__, groups, self._states_of)

    def _states_of(self, group: Mapping[str, Any]) -> list[tuple[int, dict[str, Tensor]]]:
        return [
            (i, self.state[p])
            for i, g, p in self._indexed_params()
            if g is group and self.state.get(p)
        ]

    def state_bytes(self) -> dict[str, int]:
        """Bytes of optimizer state by kind: ``moments``, ``basis``, ``other`` and ``total``;
        with int8 weights (``galore2.quantize_weights``) also ``weights``, the codes and
        scales of the parameters it updates — the model's bytes, not part of ``total``."""
        out = {"moments": 0, "basis": 0, "other": 0}
        for state in self.state.values():
            for key, value in state.items():
                if not isinstance(value, Tensor):
                    continue
                kind = state_kind([NonFinitePolicy, *self._all_modules], key)
                local = value.to_local() if is_dtensor(value) else value  # this rank's
                out[kind] = out.get(kind, 0) + local.numel() * local.element_size()
        out["total"] = sum(out.values())
        stored = [s.nbytes() for _, _, p in self._indexed_params() if (s := store_of(p))]
        if stored:
            out["weights"] = sum(stored)
        return out

    def refresh_stats(self) -> dict[int, dict[str, float]]:
        """Per projected parameter (by its index over all groups, as in ``state_dict``): the
        number of subspace refreshes so far, the current gap between refreshes (it varies
        with ``adaptive_refresh``) and the last measured subspace overlap (NaN if none).
        The modules that refresh a subspace say it (their ``refresh_stats(state, group)``,
        GaLore's); the loop knows none of their keys."""
        askers = [m.refresh_stats for m in walk(self._all_modules) if hasattr(m, "refresh_stats")]
        out: dict[int, dict[str, float]] = {}
        for index, group, p in self._indexed_params():
            state = self.state.get(p, {})
            for ask in askers:
                stats = ask(state, group)
                if stats is not None:
                    out[index] = stats
                    break
        return out

    @property
    def nonfinite_skips(self) -> int:
        """How many per-parameter updates were skipped (or masked, ``capturable=True``) for
        unusable gradients."""
        self._flush_skips()
        return sum(int(s[SKIPS]) for s in self.state.values() if SKIPS in s)

    def _flush_skips(self) -> None:
        """Add the skips counted on the device (the masked step) to the state's counters and
        set the host step counters a masked step advanced (:attr:`_host_counters`) back by
        them, as if those steps had been skipped: one host read, here rather than in the step."""
        pending = getattr(self, "_pending_skips", None)
        if not pending:
            return
        params = [p for owners, _ in pending.values() for p in owners]
        counts = _numerics.host_list(torch.cat([c.to(torch.int64) for _, c in pending.values()]))
        host = getattr(self, "_host_counters", frozenset())
        for p, n in zip(params, counts, strict=True):
            if n:
                state = self.state[p]
                state[SKIPS] += n
                for key in host:
                    if key in state:
                        state[key] -= n  # in place: a packed counter stays in its pack
        for _, c in pending.values():  # zeroed in place: a captured step keeps adding into it
            c.zero_()

    def _due_flush(self, batches: list[_Batch]) -> None:
        """Before a step whose masked batches may refresh a basis: the pending skips read
        (:meth:`_flush_skips`), so the refresh schedule sees the counts the skip path has.
        A host counter is never behind the skip path's (it counts the masked steps too),
        and a refresh is due once it reaches the parameter's next refresh: where none is
        due by the host counters, none is by the skip path's, and nothing is read."""
        if not self._pending_skips or not self._refresh_askers:
            return
        for b in batches:
            if not _masks(b.group):
                continue
            for p in b.owners:
                state = self.state.get(p)
                if state and any(ask(state, b.group) for ask in self._refresh_askers):
                    self._flush_skips()
                    return

    def state_dict(self) -> dict[str, Any]:
        """torch's ``state_dict``, with the skips counted on the device added to the state first."""
        self._flush_skips()
        self._check_settings(self.param_groups)  # an edited gap re-planned before it is saved
        return super().state_dict()

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """torch's ``load_state_dict``, checked first (:mod:`galore2.core.resume`): options
        that shape the state must match, this optimizer's other options win (reported),
        each parameter's saved state must be what this optimizer keeps for it; a
        ``ValueError`` before anything changes otherwise. Saved dtypes are kept."""
        owner = type(self).__name__
        # skips still counted on the device belong to the state being replaced: into it first
        self._flush_skips()
        saved_groups = state_dict["param_groups"]
        if len(saved_groups) != len(self.param_groups):
            raise ValueError("loaded state dict has a different number of parameter groups")
        refused, changed = compare_groups(self.declared, self.param_groups, saved_groups)
        if refused:
            raise refusal(owner, refused)
        renamed: dict[str, str] = {}  # state keys of older releases -> today's
        for module in walk(self._all_modules):
            renamed.update(getattr(module, "renamed_keys", {}))
        saved_ids = [pid for g in saved_groups for pid in g["params"]]
        saved_state = state_dict["state"]
        if len(saved_ids) == sum(len(g["params"]) for g in self.param_groups):  # else torch's
            items = (
                (
                    partial(_describe, index, group, p),
                    {renamed.get(k, k): v for k, v in saved_state.get(pid, {}).items()},
                    partial(self._expected_state, p, group, index),
                )
                for pid, (index, group, p) in zip(saved_ids, self._indexed_params(), strict=True)
            )
            modules = [NonFinitePolicy, *walk(self._all_modules)]
            problems = compare_state(owner, known_prefixes(modules), optional_keys(modules), items)
            if problems:
                raise refusal(owner, problems)
        current = [dict(g) for g in self.param_groups]
        super().load_state_dict(state_dict)
        for group, mine, saved in zip(self.param_groups, current, saved_groups, strict=True):
            for name in self.declared:  # this optimizer's options; lr: the checkpoint's
                if name not in SCHEDULED or name not in saved:
                    group[name] = mine[name]
        if changed:
            warnings.warn(
                f"{owner}.load_state_dict: settings differ from the checkpoint's; this "
                f"optimizer's are used: {'; '.join(changed)}",
                stacklevel=2,
            )
        params = iter_chain.from_iterable(g["params"] for g in self.param_groups)
        for pid, p in zip(saved_ids, params, strict=True):
            for key, value in saved_state.get(pid, {}).items():
                if key in renamed:
                    self.state[p].pop(key, None)
                    key = renamed[key]
                if isinstance(value, Tensor):
                    # int64 scalars (counters, seeds) live on the CPU; everything else,
                    # 0-d float moments of a 0-d parameter included, with the parameter
                    on_cpu = value.dim() == 0 and not value.is_floating_point()
                    device = torch.device("cpu") if on_cpu else p.device
                    self.state[p][key] = value.detach().to(device=device, copy=True)
            if self.state.get(p):
                self.state[p].setdefault(SKIPS, counter())  # older checkpoints lack it
        self._settings.reset()  # the state was made with the checkpoint's values: re-plan
        for group, saved in zip(self.param_groups, saved_groups, strict=True):
            self._settings.loaded(group, saved)
        self._check_settings(self.param_groups)

    # ---- step --------------------------------------------------------------------
    def _check_sparse(self) -> None:
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is not None and p.grad.is_sparse:
                    raise RuntimeError(
                        "galore2 optimizers do not support sparse gradients (got one for a "
                        f"parameter of shape {tuple(p.shape)}); use torch.optim.SparseAdam for "
                        "sparse embeddings"
                    )

    @torch.no_grad()
    def step(self, closure: Callable[[], Any] | None = None) -> Any:
        """Perform one optimization step over every parameter with a gradient.

        Args:
            closure: re-evaluates the model and returns the loss (run with gradients enabled).

        Returns:
            The closure's loss, or ``None`` without a closure.

        Raises:
            RuntimeError: a parameter has a sparse gradient.
            FloatingPointError: a gradient is not finite in a group with ``nonfinite="raise"``
                (raised before any parameter changes).
        """
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        self._check_settings(self.param_groups)
        items = self._items()  # refuses a sparse gradient
        NonFinitePolicy.raise_if_any(self.param_groups, self._to_check)
        for part in parts(self.param_groups, items, self._param_transforms, is_dtensor):
            gathered = [
                self._gather(group, found)
                for group, found in zip(self.param_groups, part, strict=True)
            ]
            self._run_and_apply(self._prepare([b for b in gathered if b is not None]))
        return loss

    @torch.no_grad()
    def step_param(self, p: Tensor) -> None:
        """Update one parameter now from its ``.grad`` (per-layer updates inside backward).

        Same arithmetic as :meth:`step` restricted to ``p``; ``nonfinite="raise"`` checks
        only ``p``'s gradient. Step hooks registered on the optimizer are not run.
        """
        if p.grad is None:
            return
        needs_all = [t.name for t in self._param_transforms if t.needs_stats]
        if needs_all:
            raise ValueError(
                f"{', '.join(needs_all)} needs statistics over every parameter each step, "
                "which per-layer updates (step_param) cannot provide; use optimizer.step()"
            )
        count = sum(len(g["params"]) for g in self.param_groups)
        if self._where is None or self._where[0] != count:  # (re)build after add_param_group
            where = {id(q): (g, i) for i, g, q in self._indexed_params()}
            self._where = (count, where)
        found = self._where[1].get(id(p))
        if found is None:
            raise ValueError(f"parameter of shape {tuple(p.shape)} is not in this optimizer")
        group, index = found
        self._check_settings([group])
        grad = p.grad
        if grad.is_sparse:
            self._check_sparse()
        NonFinitePolicy.raise_if_any([group], lambda g: [(p, _real(grad), self._placement(p))])
        batch = self._gather(group, [(index, grad, p)])
        self._run_and_apply(self._prepare([batch] if batch is not None else []))

    def _run_and_apply(self, batches: list[_Batch]) -> None:
        """:meth:`_run`, then the weight modules on the parameters stepped, with a masked
        step's flags still set (each module leaves a masked parameter's weights as they are:
        :func:`~galore2.core.masked.masked_factor`), cleared after."""
        self._due_flush(batches)
        try:
            with ExitStack() as masks:
                stepped = self._run(batches, masks)
                run_param_transforms(self._param_transforms, self._chain, stepped, _chunks)
            self._writes.commit(ctx.param for _, _, ctx in stepped)  # int8 weights
        finally:
            self._writes.drop()

    def _gather(
        self, group: dict[str, Any], items: list[tuple[int, Tensor, Tensor]]
    ) -> _Batch | None:
        """Everything of ``items`` (of ``group``) before the chain: lazy state, the scheduled
        lr, local views (then :meth:`_prepare`: the gradient modules, the non-finite flags)."""
        if not items:
            return None
        key = id(group)
        if self._schedule is not None:  # built-in schedule: lr = schedule(group, step count)
            for index, _, p in items:
                if not self.state[p]:
                    self._init_param_state(p, group, index)
            group = {
                **group,
                "lr": self._schedule.step_lr(group, [self.state[p] for *_, p in items]),
            }
        batch = _Batch(group, key)
        cached = self._gathered(key, items)
        if cached is not None:  # the same parameters as last step: no per-parameter Python
            batch.owners, batch.params, batch.states, batch.ctxs = cached
            batch.reused = True
            grads = [g for _, g, _ in items]
            if group["maximize"]:
                grads = list(torch._foreach_neg(grads)) if len(grads) > 1 else [-grads[0]]
            batch.grads = grads
        else:
            for _, _, p in items:  # int8 weights (never cached): refusals before any state
                if store_of(p) is not None:
                    refuse(group, p, is_dtensor(p))
            plain = True  # local real tensors only: the lists can be reused next step
            for index, grad, p in items:
                state = self.state[p]
                if not state:
                    self._init_param_state(p, group, index)
                ctx = self._context(p, index)
                store = store_of(p)
                if store is not None:  # stepped on its working copy, written back after
                    self._writes.track(ctx.param, store)
                plain = plain and ctx.placement is LOCAL and not p.is_complex() and store is None
                grad = _real(ctx.placement.local(grad))
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
                self._gather_cache[key] = (self.state, [(i, p) for i, _, p in items], lists)
        return batch

    def _prepare(self, batches: list[_Batch]) -> list[_Batch]:
        """The gradient modules on every batch's full gradients, in place (batched as the
        chain batches them, and across groups where a module reads the same options), then
        the non-finite flags of every batch (on the device; :meth:`NonFinitePolicy.check_many`)."""
        if self._grad_transforms:
            run_grad_transforms(
                self._grad_transforms,
                [
                    (b.group, *([xs[i] for i in c] for xs in (b.grads, b.states, b.ctxs)))
                    for b in batches
                    for c in _chunks(b.params, b.group.get("foreach"))
                ],
            )
        # one check for every group sharing a state dtype, device and reduction
        flags = NonFinitePolicy.check_many(
            [(b.group, b.grads, [c.placement for c in b.ctxs]) for b in batches]
        )
        for b, ok in zip(batches, flags, strict=True):
            b.flags = ok
        return batches

    def _gathered(
        self, key: int, items: list[tuple[int, Tensor, Tensor]]
    ) -> tuple[list[Tensor], list[Tensor], list[dict[str, Tensor]], list[Context]] | None:
        """The lists :meth:`_gather` built last step for this group, if they still hold: the
        same parameters at the same indices, the same ``state`` mapping (not replaced by
        ``load_state_dict``) and the same state dicts; None otherwise (they are rebuilt).
        Only groups of local real tensors are cached (see ``_gather``)."""
        found = self._gather_cache.get(key)
        if found is None:
            return None
        state, old, lists = found
        if state is not self.state or len(old) != len(items):
            return None
        for (i, _, p), (j, q) in zip(items, old, strict=True):
            if p is not q or i != j:
                return None
        owners, params, states, ctxs = lists
        for p, s, ctx in zip(owners, states, ctxs, strict=True):
            if ctx.refreshed or self.state.get(p) is not s or not s:
                return None
        return [*owners], [*params], [*states], [*ctxs]

    def _run(
        self, batches: list[_Batch], masks: ExitStack
    ) -> list[tuple[dict[str, Any], dict[str, Tensor], Context]]:
        """Read every batch's flags at once (the step's one host read), then per batch the one
        pipeline (:meth:`_step_batch`): on the host-indexed path the usable tensors, picked
        by index; on the masked path (``capturable=True``) every tensor, the unusable ones
        masked (:class:`~galore2.core.masked.MaskedStep`, its flags cleared by ``masks``).
        Returns (group, local state, ctx) of those stepped."""
        host = [b for b in batches if not b.group["capturable"]]
        read = dict(zip(map(id, host), read_flags([b.flags for b in host]), strict=True))
        stepped = []
        for batch in batches:
            if batch.group["capturable"] and batch.flags is not None:
                masked = self._masked_step(batch)
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

    def _masked_step(self, batch: _Batch) -> MaskedStep:
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
        if ok is None:  # _run takes the masked path only for checked flags
            raise RuntimeError("a masked step needs the batch's non-finite flags")
        bad = ~ok
        self._count_skips(batch, bad)
        decay = self._decay_factor(group)
        flags = self._flag_buffers.get(batch.key)
        if flags is None or not flags.fits(ok):
            flags = self._flag_buffers[batch.key] = FlagBuffer(ok.numel(), ok.device)
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
        skipped = frozenset(k for m in self._chain for k in m.masked_keys(group))
        snapshot = self._snapshots.get(batch.key)
        if snapshot is None or not snapshot.fits(batch.states) or snapshot.skipped != skipped:
            device = batch.params[0].device if batch.params else None
            kept = [
                (i, key)
                for i, state in enumerate(batch.states)
                for key, t in state.items()
                if t.device == device
                and not _counter(t)
                and key not in self._device_counters
                and key not in skipped
            ]
            local = not any(c.placement.distributed for c in batch.ctxs)
            snapshot = self._snapshots[batch.key] = Snapshot(
                batch.states, kept, pack=local, previous=snapshot, skipped=skipped
            )
        # and what the rules know they leave unchanged this step (GaLore's bases between refreshes)
        now = skipped.union(*(m.step_masked_keys(batch.states, group, batch.ctxs)
                              for m in self._chain))  # fmt: skip
        return MaskedStep(flags, snapshot, now, grads, decays, batch.ctxs,
                          self._counter_snapshot(batch))  # fmt: skip

    def _counter_snapshot(self, batch: _Batch) -> CounterSnapshot | None:
        """The device step counters of a masked batch (:attr:`_device_counters`: Adam's
        ``adam.step``…), saved before its chain and put back after it for the masked
        parameters, so that their counts stay the skip path's (a few kernels on 0-d
        tensors, not packed: the rules pack their counters themselves). Counters still on
        the host (a checkpoint loads 0-d integers there) are moved to the parameters'
        device first, as the rules would move them (then every one is in the snapshot)."""
        if not self._device_counters or not batch.params:
            return None
        device = batch.params[0].device
        kept = []
        for i, state in enumerate(batch.states):
            for key in self._device_counters:
                t = state.get(key)
                if t is None:
                    continue
                if t.device != device:  # in the state itself (a sharded one's is a copy)
                    t = state[key] = self.state[batch.owners[i]][key] = counter_on(t, device)
                kept.append((i, key))
        if not kept:
            return None
        found = self._counter_snapshots.get(batch.key)
        if found is None or not found.fits(batch.states, kept):
            found = self._counter_snapshots[batch.key] = CounterSnapshot(
                batch.states, kept, len(batch.states)
            )
        return found

    def _step_batch(
        self, batch: _Batch, grads: list[Tensor], masked: MaskedStep | None
    ) -> list[tuple[dict[str, Any], dict[str, Tensor], Context]]:
        """The pipeline every batch runs: the chain's ``prepare``, then per ``foreach`` chunk
        the chain on its directions and the updates applied — ``p ← decay·p − lr·u``, or
        with ``masked`` the masked step's flags and per-parameter decay factors
        (:func:`apply_masked`)."""
        group, params, states, ctxs = batch.group, batch.params, batch.states, batch.ctxs
        lr = float(group["lr"])
        decay = self._decay_factor(group)
        self._chain[0].prepare(grads, states, group, ctxs)
        rule = self._adamw_rule(group) if masked is None else None
        if rule is not None and rule.torch_adamw(params, grads, states, group):
            return [(group, state, ctx) for state, ctx in zip(states, ctxs, strict=True)]
        for chunk in _chunks(params, group.get("foreach")):
            outs = run_chain(
                self._chain,
                [grads[i] for i in chunk],
                [states[i] for i in chunk],
                group,
                [ctxs[i] for i in chunk],
                decay,
            )
            ps = [params[i] for i in chunk]
            if masked is None:
                apply_updates(ps, outs, lr, decay)
            else:
                apply_masked(ps, outs, lr, masked.flags, chunk, masked.decays_of(chunk))
        return [(group, state, ctx) for state, ctx in zip(states, ctxs, strict=True)]

    def _adamw_rule(self, group: dict[str, Any]) -> Any:
        """The rule that may run ``group``'s whole step by torch's AdamW kernels (its
        ``torch_adamw``, which checks the tensors and picks torch's fused or foreach path):
        when the step is exactly ``torch.optim.AdamW``'s — one chain module whose update in
        this group is Adam's on the full gradient (:meth:`Transform.adamw_rule`), decoupled
        weight decay (``1 − lr·λ``, torch's), no gradient or weight modules, the host-indexed
        non-finite path (unusable gradients already left out; not ``capturable``). None
        otherwise: the chain runs."""
        if (
            len(self._chain) != 1
            or self._grad_transforms
            or self._param_transforms
            or type(self._decay) is not DecoupledWeightDecay
            or group["capturable"]
        ):
            return None
        return self._chain[0].adamw_rule(group)

    def _decay_factor(self, group: dict[str, Any]) -> float:
        """This step's decoupled decay factor of ``group`` (1.0 without a decay module)."""
        return 1.0 if self._decay is None else self._decay.factor(group)

    def _count_skips(self, batch: _Batch, bad: Tensor) -> None:
        """Add a batch's masked parameters to the skips counted on the device: one add into
        a counter per batch of parameters (flushed by :meth:`_flush_skips`)."""
        key = self._skip_keys.get(batch.key) if batch.reused else None
        if key is None:
            key = self._skip_keys[batch.key] = tuple(map(id, batch.owners))
        found = self._pending_skips.get(key)
        if found is None:
            self._pending_skips[key] = (list(batch.owners), bad.to(torch.int32))
        else:
            found[1].add_(bad)

    def _indexed_params_of(self, group: dict[str, Any]) -> Iterable[tuple[int, Tensor, Tensor]]:
        offset = 0
        for g in self.param_groups:
            if g is group:
                break
            offset += len(g["params"])
        for i, p in enumerate(group["params"]):
            if p.grad is None:
                continue
            yield offset + i, p.grad, p

    def _items(self) -> list[list[tuple[int, Tensor, Tensor]]]:
        """(index, gradient, parameter) of every parameter with a gradient, per group, in
        one pass; a sparse gradient is refused first (:meth:`_check_sparse`)."""
        out, offset = [], 0
        for group in self.param_groups:
            params = group["params"]
            found = [(offset + i, g, p) for i, p in enumerate(params) if (g := p.grad) is not None]
            if any(map(_IS_SPARSE, map(_GRAD, found))):
                self._check_sparse()
            out.append(found)
            offset += len(params)
        return out

    def _to_check(self, group: dict[str, Any]) -> list[tuple[Tensor, Tensor, Placement]]:
        return [(p, _real(g), self._placement(p)) for _, g, p in self._indexed_params_of(group)]


@dataclass
class _Batch:
    """A group's parameters of one step, gathered before the chain runs (see ``_gather``)."""

    group: dict[str, Any]  # the parameters' group (with the scheduled lr, if any)
    key: int = 0  # the group's id(): what caches of its lists are keyed by
    owners: list[Tensor] = field(default_factory=list)  # the parameters themselves
    params: list[Tensor] = field(default_factory=list)  # their local tensors
    states: list[dict[str, Tensor]] = field(default_factory=list)
    ctxs: list[Context] = field(default_factory=list)
    grads: list[Tensor] = field(default_factory=list)
    flags: Tensor | None = None  # usable gradients, on the device (None: not checked)
    reused: bool = False  # the same parameters (at the same indices) as last step's batch


_IS_SPARSE = operator.attrgetter("is_sparse")
_GRAD = operator.itemgetter(1)


def _masks(group: dict[str, Any]) -> bool:
    """Does ``group`` step masked on the device (:meth:`ChainOptimizer._masked_step`)?"""
    return bool(group["capturable"])


def _counter(t: Tensor) -> bool:
    """A host-resident step counter (0-d integer on the CPU), whatever the parameters' device."""
    return t.dim() == 0 and not t.is_floating_point() and t.device.type == "cpu"


def _decay_module(
    decay: DecoupledWeightDecay | str | None, param_transforms: Sequence[ParamTransform]
) -> DecoupledWeightDecay | None:
    """The optimizer's decoupled decay module for its ``decay`` argument. Two modules
    reading ``weight_decay`` would both decay the weights: a weight module that reads it
    (stable weight decay) replaces the decoupled one."""
    own = [t.name for t in param_transforms if WEIGHT_DECAY in t.options]
    if decay == AUTO:
        return None if own else DecoupledWeightDecay()
    if decay is not None and not isinstance(decay, DecoupledWeightDecay):
        raise TypeError(f"decay must be a DecoupledWeightDecay, None or {AUTO!r}, got {decay!r}")
    if decay is not None and own:
        raise ValueError(
            f"{', '.join(own)} applies weight_decay itself (it replaces decoupled weight "
            "decay): build the optimizer with decay=None"
        )
    return decay


def _describe(index: int, group: dict[str, Any], p: Tensor) -> str:
    """``parameter 3 'up.weight' of shape (40, 24)`` (with its name when the group has names;
    only for the parameters of a refusal, so the search is cheap enough)."""
    names = group.get("param_names") or ()
    offset = next((i for i, q in enumerate(group["params"]) if q is p), len(names))
    name = f" {names[offset]!r}" if offset < len(names) else ""
    return f"parameter {index}{name} of shape {tuple(p.shape)}"


def _real(t: Tensor) -> Tensor:
    """A complex tensor's real view (…, 2), where optimizers update it; others as they are."""
    return torch.view_as_real(t) if t.is_complex() else t


def _chunks(params: list[Tensor], foreach: bool | None = None) -> list[list[int]]:
    """How a group's tensors are batched through the chain (the group's ``foreach``).

    ``None`` (automatic): on accelerators the whole group goes at once (foreach kernels,
    few launches); on the CPU each tensor goes alone — grad → update → apply while its
    data is in cache, with one tensor's temporaries alive at a time (batching a group
    measured ~1.6x slower). ``True`` batches every tensor of the group (one batch per
    device), ``False`` steps each tensor alone, wherever they are.
    """
    if foreach is False:
        return [[i] for i in range(len(params))]
    if foreach:
        by_device: dict[torch.device, list[int]] = {}
        for i, p in enumerate(params):
            by_device.setdefault(p.device, []).append(i)
        return list(by_device.values())
    cpu = [i for i, p in enumerate(params) if p.device.type == "cpu"]
    rest = [i for i, p in enumerate(params) if p.device.type != "cpu"]
    return [[i] for i in cpu] + ([rest] if rest else [])


def apply_updates(
    params: list[Tensor], updates: list[Tensor | LowRankUpdate], lr: float, decay: float
) -> None:
    """:func:`apply_update` over a batch: dense updates of several tensors by two foreach
    kernels (decay, then ``p ← p − lr·u``), low-rank ones one by one (one fused matmul each)."""
    dense = [i for i, u in enumerate(updates) if not isinstance(u, LowRankUpdate)]
    if len(dense) > 1:
        ps = [params[i] for i in dense]
        if decay != 1.0:
            torch._foreach_mul_(ps, decay)
        torch._foreach_add_(ps, [updates[i] for i in dense], alpha=-lr)  # type: ignore[misc]
    for p, u in zip(params, updates, strict=True):
        if len(dense) <= 1 or isinstance(u, LowRankUpdate):
            apply_update(p, u, lr, decay)


def apply_masked(
    params: list[Tensor],
    updates: list[Tensor | LowRankUpdate],
    lr: float,
    flags: FlagBuffer,
    positions: list[int],
    decays: list[Tensor] | None,
) -> None:
    """``p ← decay·p − lr·mask·u`` with ``mask = flags.entries[position]`` (the batch's
    flags: each parameter's 0-d 1.0 / 0.0, on the device) and ``decay`` a 0-d device tensor per
    parameter (the masked step, ``capturable=True``): dense updates masked per stack they form (:func:`masked_updates`)
    and applied by foreach kernels, low-rank ones by their factor ``B`` times the mask and one
    fused matmul each. Updates are finite (a masked parameter stepped on a zero gradient), so
    ``u·0`` is 0."""
    dense = [i for i, u in enumerate(updates) if not isinstance(u, LowRankUpdate)]
    if dense:
        ps = [params[i] for i in dense]
        if decays is not None:
            torch._foreach_mul_(ps, [decays[i] for i in dense])
        # u·mask, then p − lr·(u·mask): the same bits as the host path's p − lr·u where usable
        # (one addcmul would round (−lr·u)·mask apart from add's fused p + α·u: not the bits)
        us = masked_updates([updates[i] for i in dense], flags, [positions[i] for i in dense])  # type: ignore[misc]
        torch._foreach_add_(ps, us, alpha=-lr)
    oks = flags.entries
    for p, u, i in zip(params, updates, range(len(params)), strict=True):
        if isinstance(u, LowRankUpdate):
            if decays is not None:
                p.mul_(decays[i])
            apply_update(p, LowRankUpdate(u.A, u.B * oks[positions[i]], u.shape, u.scale), lr, 1.0)


def apply_update(p: Tensor, u: Tensor | LowRankUpdate, lr: float, decay: float) -> None:
    """p ← decay·p − lr·u; a low-rank u is applied by one fused ``addmm_`` (no m×n temporary),
    or on CUDA by the Triton matmul with that epilogue (:mod:`galore2.kernels.lowrank`)."""
    if isinstance(u, LowRankUpdate):
        target = p.view(u.A.shape[0], u.B.shape[1]) if p.is_contiguous() else None
        if target is not None:
            if (
                run_kernel(
                    "lowrank",
                    target,
                    u.A,
                    u.B,
                    supported=lambda k: k.supported(target, u.A, u.B),
                    kernel=lambda k: partial(
                        k.lowrank_update, target, u.A, u.B, alpha=-lr * u.scale, beta=decay
                    ),
                )
                is not None
            ):
                return
            target.addmm_(u.A, u.B, beta=decay, alpha=-lr * u.scale)
            return
        u = u.dense()
    if decay != 1.0:
        p.mul_(decay)
    p.add_(u, alpha=-lr)
