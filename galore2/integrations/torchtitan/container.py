"""``GaLoreOptimizersContainer``: torchtitan's optimizer container, with galore2's presets.

torchtitan builds its optimizers from ``OptimizersContainer.Config``: a list of
``ParamGroupConfig(pattern, optimizer_name, optimizer_kwargs)``, each parameter going to the
first pattern that matches its name, and one optimizer per ``optimizer_name``. This
subclass adds every galore2 preset as an ``optimizer_name`` (``galore2.presets.PRESETS``:
``"galore_adamw"``, ``"fira"``, ``"apollo"``…); torchtitan's own names (``"AdamW"``…) keep
working beside them. What torchtitan does to every group, and what happens here:

* ``implementation`` (``fused`` / ``foreach`` / ``for-loop``): torchtitan puts
  ``fused=…, foreach=…`` into every group. A galore2 group gets galore2's ``foreach`` option
  instead (``fused`` → ``None``, its default: batched on accelerators; ``foreach`` → ``True``;
  ``for-loop`` → ``False``) and no ``fused`` key; a ``foreach`` in ``optimizer_kwargs`` wins.
  ``fused_opt_states_bf16`` (torch Adam's bf16 states) is refused for galore2 groups: set
  ``state_dtype="bfloat16"`` in their ``optimizer_kwargs``. ``fused=False`` written in
  ``optimizer_kwargs`` is accepted and dropped (galore2 is not fused); ``fused=True`` is an
  error.
* ``param_names`` (the canonical names torchtitan adds to each group, for its flat,
  name-keyed checkpoints) stays a group key, a list of strings; optimizer state stays
  tensors only.
* ``optimizer_kwargs`` may hold any option of the preset (``all_options()``): group options
  stay on their group, a preset's constructor switches (``moments_8bit``…) go to its
  constructor and must agree across its groups. ``optimizer_factory_kwargs_by_name[name]``
  are constructor keyword arguments (defaults for every group). Unknown keys and bad values
  raise ``ValueError`` naming the pattern, when the config is made (:func:`check_config`),
  before any model is built.
* ``state_dict()`` / ``load_state_dict()``: torchtitan creates missing optimizer state with
  a zero-gradient, ``lr=0`` step before it reads or loads state. A galore2 optimizer creates
  it with :meth:`~galore2.ChainOptimizer.init_state` instead (the state its first step
  would create, no step taken), so saving before the first step does not change training.
  (Were the zero-gradient step run anyway, it would leave the weights unchanged and set no
  basis: an all-zero gradient never sets one; the first real gradient does.)
"""

from __future__ import annotations

import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torchtitan.components.optimizer import OptimizersContainer, ParamGroupConfig

from ...core.optimizer import ChainOptimizer
from ...presets import PRESETS
from .common import (
    FOREACH,
    FUSED,
    PROJECTED,
    InitsGaLoreState,
    _check_keys,
    _projects,
    _split,
    _switches,
    plain_options,
)


def _check_fused(kwargs: Mapping[str, Any], where: str) -> None:
    if kwargs.get(FUSED, False) is not False:
        raise ValueError(
            f"{where}: fused={kwargs[FUSED]!r}: galore2 optimizers have no fused implementation "
            "(their Triton kernels switch themselves on); leave fused out or set it to False"
        )


def check_config(config: OptimizersContainer.Config) -> None:
    """Check the galore2 groups of ``config`` without building anything: option names
    (against the preset's ``all_options()``), values and combinations (a galore2 optimizer
    is built over one parameter on the meta device, so galore2's own checks run), constructor
    switches equal across an optimizer's groups, and ``implementation``. ``ValueError``
    naming the group's pattern; torchtitan's own optimizers are left to torchtitan."""
    names = {pg.optimizer_name for pg in config.param_groups}
    for name in names:
        if name not in PRESETS:
            try:
                OptimizersContainer._resolve_optimizer_factory(name)
            except NotImplementedError:
                raise ValueError(
                    f"optimizer_name {name!r} is neither a galore2 preset ({sorted(PRESETS)}) "
                    "nor one of torchtitan's optimizers"
                ) from None
    for name in sorted(names & set(PRESETS)):
        cls = PRESETS[name]
        if config.implementation not in FOREACH:
            raise ValueError(
                f"implementation={config.implementation!r} does not apply to galore2 "
                f"optimizers ({name!r}); use one of {sorted(FOREACH)} (for bf16 optimizer "
                "states set state_dtype='bfloat16' in their optimizer_kwargs)"
            )
        shared = dict(config.optimizer_factory_kwargs_by_name.get(name, {}))
        _check_keys(cls, shared, f"optimizer_factory_kwargs_by_name[{name!r}]")
        first: tuple[str, dict] | None = None
        for pg in config.param_groups:
            if pg.optimizer_name != name:
                continue
            where = f"param group {pg.pattern!r} ({name})"
            try:
                re.compile(pg.pattern)
            except re.error as e:
                raise ValueError(f"{where}: pattern is not a valid regex ({e})") from None
            _check_fused(pg.optimizer_kwargs, where)
            _check_keys(cls, set(pg.optimizer_kwargs) - {FUSED}, where)
            group, switches = _split(cls, pg.optimizer_kwargs)
            if first is None:
                first = (pg.pattern, switches)
            elif switches != first[1]:
                raise ValueError(
                    f"{where}: constructor switches {switches} differ from those of group "
                    f"{first[0]!r} ({first[1]}); groups sharing one optimizer need the same "
                    f"{sorted(_switches(cls))}"
                )
            probe = torch.empty(2, 2, device="meta")
            try:
                cls([{"params": [probe], **group}], **{**shared, **switches})
            except (TypeError, ValueError) as e:
                raise ValueError(f"{where}: {e}") from None


class GaLoreOptimizersContainer(InitsGaLoreState, OptimizersContainer):
    """torchtitan's ``OptimizersContainer`` that also builds galore2's optimizers.

    ``optimizer_name`` of a ``ParamGroupConfig`` may name any galore2 preset
    (``galore2.presets.PRESETS``) besides torchtitan's own; see the module docstring for how
    torchtitan's group keys are handled. Built by torchtitan's trainer as any container
    (``config.optimizer.build(model_parts=...)``), from a :class:`Config`, e.g. made by
    :func:`galore_config`.

    Args:
        config: the container's configuration (``GaLoreOptimizersContainer.Config``).
        model_parts: the model parts to optimize (one unless pipeline-parallel).
    """

    @dataclass(kw_only=True, slots=True)
    class Config(OptimizersContainer.Config):
        """``OptimizersContainer.Config`` whose ``build()`` makes a
        :class:`GaLoreOptimizersContainer`; its galore2 groups are checked when it is made
        (:func:`check_config`)."""

        def __post_init__(self) -> None:
            check_config(self)

    def __init__(self, config: Config, *, model_parts: list[nn.Module]) -> None:
        check_config(config)
        self._config = config  # the factories below read implementation from it
        super().__init__(config, model_parts=model_parts)

    @staticmethod
    def _build_impl_kwargs(config: OptimizersContainer.Config) -> dict[str, Any]:
        """Nothing for every group: each optimizer's factory adds its own (torch's
        ``fused`` / ``foreach``, or galore2's ``foreach``)."""
        return {}

    def _resolve_optimizer_factory(self, name: str) -> Callable[..., torch.optim.Optimizer]:
        if name in PRESETS:
            return lambda groups, **kw: self._build_preset(PRESETS[name], groups, **kw)
        torch_factory = OptimizersContainer._resolve_optimizer_factory(name)
        impl = OptimizersContainer._build_impl_kwargs(self._config)
        return lambda groups, **kw: torch_factory([{**impl, **g} for g in groups], **kw)

    def _build_preset(
        self, cls: type[ChainOptimizer], groups: list[dict[str, Any]], **shared: Any
    ) -> ChainOptimizer:
        """A galore2 optimizer over torchtitan's groups (``params``, ``param_names`` and the
        config's ``optimizer_kwargs``), already checked by :func:`check_config`."""
        foreach = FOREACH[self._config.implementation]
        built, switches = [], {}
        for g in groups:
            group, own = _split(cls, g)
            group.setdefault("foreach", foreach)
            built.append(group)
            switches.update(own)  # equal across groups (check_config)
        return cls(built, **{**shared, **switches})


def galore_config(
    optimizer: str = "galore_adamw",
    *,
    projected: str = PROJECTED,
    plain: Mapping[str, Any] | None = None,
    implementation: str = "fused",
    **options: Any,
) -> GaLoreOptimizersContainer.Config:
    """A container config with one galore2 optimizer for the whole model.

    Two parameter groups of preset ``optimizer``: parameters whose name matches
    ``projected`` (default :data:`PROJECTED`: attention and MLP weights), with every option
    in ``options``; then every other parameter (``".*"``: embeddings, output head, norms),
    trained without projection, with the options that are not GaLore's (``rank``,
    ``update_proj_gap``, ``scale``… go on the projected group only), updated by ``plain``
    (e.g. ``{"weight_decay": 0.0}``). ``rank`` is required unless the preset fixes it
    (APOLLO-Mini: 1). A preset without GaLore (``ranger21``) gets one group, ``".*"``.
    The config is checked when made (:func:`check_config`).

    Args:
        optimizer: a name in ``galore2.presets.PRESETS``.
        projected: regex searched in parameter names, as torchtitan's ``pattern``.
        plain: options overriding ``options`` on the plain group.
        implementation: torchtitan's ``implementation`` (``fused`` / ``foreach`` /
            ``for-loop``), mapped to galore2's ``foreach``.
        **options: options of the preset (``lr``, ``betas``, ``weight_decay``, ``rank``,
            ``update_proj_gap``, ``scale``…; the list: ``PRESETS[optimizer].all_options()``).
    """
    cls = PRESETS.get(optimizer)
    if cls is None:
        raise ValueError(f"optimizer must be one of {sorted(PRESETS)}, got {optimizer!r}")
    plain = dict(plain or {})
    _check_keys(cls, [*options, *plain], f"galore_config({optimizer!r})")
    if not _projects(cls):
        groups = [ParamGroupConfig(pattern=".*", optimizer_name=optimizer,
                                   optimizer_kwargs={**options, **plain})]  # fmt: skip
        return GaLoreOptimizersContainer.Config(param_groups=groups, implementation=implementation)
    rank = options.get("rank", getattr(cls, "projected_rank", None))
    if rank is None:
        raise ValueError(f"galore_config({optimizer!r}) needs rank=<int >= 1>")
    for_plain = plain_options(options)
    groups = [
        ParamGroupConfig(pattern=projected, optimizer_name=optimizer,
                         optimizer_kwargs={**options, "rank": rank}),
        ParamGroupConfig(pattern=".*", optimizer_name=optimizer,
                         optimizer_kwargs={**for_plain, **plain}),
    ]  # fmt: skip
    return GaLoreOptimizersContainer.Config(param_groups=groups, implementation=implementation)
