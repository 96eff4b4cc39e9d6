"""``ChainOptimizer``: the one ``torch.optim.Optimizer`` that every galore2 optimizer is.

A preset (``GaLoreAdamW``…) only chooses the chain of transforms and the defaults; the
step is shared, never copied: :mod:`galore2.core.step` runs it, one pipeline for
``step()`` and per-layer ``step_param()``. This class is the ``torch.optim`` face: groups
and their options, state creation, ``state_dict`` / ``load_state_dict``, pickling.

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

import warnings
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import replace
from functools import partial
from itertools import chain as iter_chain
from typing import Any, ClassVar

import torch
from torch import Tensor

from ..fsdp.detect import is_dtensor  # cheap: imports nothing distributed
from .module import refuse_validate_overrides
from .modules import (
    WEIGHT_DECAY,
    DecoupledWeightDecay,
    GradientTransform,
    LRSchedule,
    ParamTransform,
)
from .nonfinite import SKIPS, NonFinitePolicy
from .options import Option, closest, collect, hints, resolve
from .resume import (
    SCHEDULED,
    Settings,
    compare_groups,
    compare_state,
    known_prefixes,
    optional_keys,
    refusal,
)
from .state import counter
from .step import StepEngine, indexed
from .stored import store_of
from .transform import Transform, state_kind, walk

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
    options: ClassVar[tuple[Option, ...]] = (*StepEngine.options, *NonFinitePolicy.options)
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
        """What follows from the modules: the declared options, and the step engine with
        empty caches (:meth:`StepEngine.reset`)."""
        self._all_modules = [
            *self._grad_transforms,
            *self._chain,
            *([self._decay] if self._decay is not None else []),
            *self._param_transforms,
            *([self._schedule] if self._schedule is not None else []),
        ]
        self.declared = self.declared_options(self._all_modules)
        modules = [NonFinitePolicy, *walk(self._all_modules)]
        refuse_validate_overrides(modules)
        self._checks = tuple(c for m in modules for c in m.checks)
        self._engine = StepEngine(
            self,
            self._chain,
            self._grad_transforms,
            self._param_transforms,
            self._decay,
            self._schedule,
            self._warn_once,
        )
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
            checks=self._checks,
        )
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
        if not bad:
            return
        problems = [m.complex_problem(group) for m in walk(self._all_modules)]
        problems = [why for why in problems if why is not None]
        if problems:
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

    def _expected_state(self, p: Tensor, group: dict[str, Any], index: int) -> dict[str, Tensor]:
        """The state the first step would create for ``p``, built on the meta device (keys,
        shapes, dtypes; CPU counters are real): what :meth:`load_state_dict` compares with."""
        ctx = self._engine.context(p, index)
        state: dict[str, Tensor] = {}
        self._engine.fill_state(state, group, replace(ctx, param=ctx.param.to("meta")))
        return state

    def _indexed_params(self) -> Iterable[tuple[int, dict[str, Any], Tensor]]:
        return indexed(self.param_groups)

    @torch.no_grad()
    def init_state(self) -> None:
        """Create the state of every parameter now (as the first ``step()`` would).

        Useful to size state without training (works on the meta device) and
        before loading a checkpoint.
        """
        self._check_settings(self.param_groups)
        for index, group, p in self._indexed_params():
            if not self.state[p]:
                self._engine.init_param_state(p, group, index)

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
        return self._engine.masked.due_for_refresh(self.param_groups)

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
        """The skips counted on the device (the masked step) into the state's counters
        (:meth:`~galore2.core.step_masked.MaskedPath.flush_skips`)."""
        engine = self.__dict__.get("_engine")
        if engine is not None:
            engine.flush_skips()

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
        changed, renamed = self._check_loaded(state_dict)
        saved_ids = [pid for g in saved_groups for pid in g["params"]]
        saved_state = state_dict["state"]
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

    def _check_loaded(self, state_dict: dict[str, Any]) -> tuple[list[str], dict[str, str]]:
        """Refuse a checkpoint whose groups or state this optimizer cannot take (before
        anything changes); the settings that differ (this optimizer's win) and the state
        keys of older releases renamed to today's."""
        owner = type(self).__name__
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
        return changed, renamed

    # ---- step --------------------------------------------------------------------
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
        self._engine.run(self.param_groups, self._engine.items())
        return loss

    @torch.no_grad()
    def step_param(self, p: Tensor) -> None:
        """Update one parameter now from its ``.grad`` (per-layer updates inside backward).

        Same arithmetic as :meth:`step` restricted to ``p`` (the same pipeline,
        :meth:`StepEngine.run`); ``nonfinite="raise"`` checks only ``p``'s gradient. Step
        hooks registered on the optimizer are not run.
        """
        if p.grad is None:
            return
        group, index = self._engine.locate(p)
        self._check_settings([group])
        self._engine.run([group], [[(index, p.grad, p)]])


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
