"""galore2's optimizers in torchtitan 0.2.x's trainer (its ``[optimizer]`` config section).

torchtitan 0.2.x (torch >= 2.8; 0.2.2 runs on torch 2.11, where 0.3.x does not import)
builds optimizers with its train spec's ``build_optimizers_fn(model_parts,
job_config.optimizer, parallel_dims)`` from the fields ``name``, ``lr``, ``beta1``,
``beta2``, ``eps``, ``weight_decay``, ``implementation``. :func:`build_optimizers` is such
a builder: an ``--optimizer.name`` that is a galore2 preset (``galore_adamw``, ``fira``…:
``galore2.presets.PRESETS``) gets a :class:`GaLoreOptimizersContainer`, any other name
torchtitan's own ``build_optimizers``. The fields :mod:`.job_config` adds to the section:

* ``galore_options``: any option of the preset as ``key=value`` entries separated by commas
  (``"rank=1024,update_proj_gap=500,scale=0.25"``), parsed and checked by each option;
  they win over torchtitan's fields;
* ``projected``: the regex searched in parameter names (default :data:`~.common.PROJECTED`:
  attention and MLP weights), the projected group; every other parameter is in the plain
  group, which gets the options that are not GaLore's (``rank``… on the projected group only);
* ``plain_options``: entries overriding options on the plain group (``weight_decay=0.0``).

torchtitan's ``lr`` and ``weight_decay`` go to every preset, ``beta1`` / ``beta2`` as
``betas`` and ``eps`` where the preset has those options in that form (GaLoreAdafactor: its
``beta1`` and pair ``eps`` are not torchtitan's). ``implementation`` becomes galore2's
``foreach`` as in the 0.3.x container. Every check runs when :func:`settings` reads the
section (at the build, before the first step; ``ValueError`` naming the field).
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torchtitan.components.optimizer import OptimizersContainer
from torchtitan.components.optimizer import build_optimizers as torchtitan_build_optimizers

from ...core.optimizer import ChainOptimizer
from ...presets import PRESETS
from .common import FOREACH, PROJECTED, InitsGaLoreState, _check_keys, _projects, _split
from .common import plain_options as _plain_options


@dataclass(frozen=True)
class Settings:
    """A galore2 optimizer as the ``[optimizer]`` section describes it."""

    cls: type[ChainOptimizer]
    pattern: str  # the projected group's regex (None-equivalent: "" when nothing projects)
    projected: dict[str, Any]  # group options of the projected group (or the only group)
    plain: dict[str, Any] | None  # group options of the plain group; None: one group
    switches: dict[str, Any]  # constructor switches


def parse_entries(text: str, cls: type[ChainOptimizer], where: str) -> dict[str, Any]:
    """``"key=value,key=value"`` as options of ``cls``, each value parsed by its option.

    Raises:
        ValueError: a malformed entry, a key set twice, a pair (write betas as torchtitan's
            ``beta1`` / ``beta2``), unknown keys (all named at once), a bad value.
    """
    entries: dict[str, str] = {}
    for item in (text or "").split(","):
        if not item.strip():
            continue
        key, sep, value = (part.strip() for part in item.partition("="))
        if not sep or not key or not value or any(c.isspace() for c in key + value):
            raise ValueError(f"{where}={text!r}: entries look like key=value, got {item.strip()!r}")
        if value.startswith("("):
            raise ValueError(f"{where}={text!r}: pairs are not read here ({key}); torchtitan's "
                             "betas are --optimizer.beta1 / --optimizer.beta2")  # fmt: skip
        if key in entries:
            raise ValueError(f"{where}={text!r}: {key!r} is set twice")
        entries[key] = value
    _check_keys(cls, entries, f"{where}={text!r}")
    options = cls.all_options()
    out = {}
    for key, value in entries.items():
        try:
            out[key] = options[key].parse(value)
        except ValueError as e:
            raise ValueError(f"{where}={text!r}: {e}") from None
    return out


def _torchtitan_fields(config: Any, cls: type[ChainOptimizer]) -> dict[str, Any]:
    """torchtitan's fields as options of ``cls`` (those it has, in the form it takes)."""
    options = cls.all_options()
    values = {"lr": config.lr, "betas": (config.beta1, config.beta2), "eps": config.eps,
              "weight_decay": config.weight_decay}  # fmt: skip
    out = {}
    for key, value in values.items():
        if key not in options:
            continue
        try:
            out[key] = options[key].validate(value)
        except ValueError:
            if key in ("lr", "weight_decay"):
                raise ValueError(f"--optimizer.{key}: {cls.__name__}'s {key} must be "
                                 f"{options[key].check.describe}, got {value!r}") from None  # fmt: skip
            # another form (GaLoreAdafactor's eps is a pair): the preset's default
    return out


def settings(config: Any) -> Settings:
    """The galore2 optimizer described by torchtitan's ``[optimizer]`` section ``config``
    (its ``name`` a galore2 preset), checked: option names and values, the combination
    (the optimizer is built over one meta-device parameter), ``implementation``,
    ``early_step_in_backward``.

    Raises:
        ValueError: naming the field (``--optimizer.galore_options``…) and the problem.
    """
    name = config.name
    cls = PRESETS.get(name)
    if cls is None:
        raise ValueError(f"--optimizer.name {name!r} is not a galore2 preset ({sorted(PRESETS)})")
    if config.implementation not in FOREACH:
        raise ValueError(f"--optimizer.implementation {config.implementation!r} does not apply "
                         f"to galore2 optimizers; use one of {sorted(FOREACH)}")  # fmt: skip
    if getattr(config, "early_step_in_backward", False):
        raise ValueError("--optimizer.early_step_in_backward is not supported for galore2 "
                         "optimizers (use galore2.per_layer outside torchtitan's trainer)")  # fmt: skip
    options = {**_torchtitan_fields(config, cls),
               **parse_entries(getattr(config, "galore_options", ""), cls,
                               "--optimizer.galore_options")}  # fmt: skip
    options.setdefault("foreach", FOREACH[config.implementation])
    plain_extra = parse_entries(getattr(config, "plain_options", ""), cls,
                                "--optimizer.plain_options")  # fmt: skip
    pattern = getattr(config, "projected", PROJECTED)
    try:
        re.compile(pattern)
    except re.error as e:
        raise ValueError(f"--optimizer.projected {pattern!r} is not a valid regex ({e})") from None
    group, switches = _split(cls, options)
    plain: dict[str, Any] | None = None
    if _projects(cls):
        if group.get("rank", getattr(cls, "projected_rank", None)) is None:
            raise ValueError(f"--optimizer.galore_options: {name} needs rank=<int >= 1>")
        plain, more = _split(cls, {**_plain_options(options), **plain_extra})
        if more != switches:
            raise ValueError(f"--optimizer.plain_options: constructor switches {sorted(more)} "
                             "are the optimizer's, set them in --optimizer.galore_options")  # fmt: skip
    elif plain_extra:
        raise ValueError(f"--optimizer.plain_options: {name} has one group (nothing projected)")
    for where, g in (("galore_options", group), ("plain_options", plain)):
        if g is None:
            continue
        probe = torch.empty(2, 2, device="meta")
        try:
            cls([{"params": [probe], **g}], **switches)
        except (TypeError, ValueError) as e:
            raise ValueError(f"--optimizer.{where} ({name}): {e}") from None
    return Settings(cls, pattern, group, plain, switches)


class GaLoreOptimizersContainer(InitsGaLoreState, OptimizersContainer):
    """torchtitan 0.2.x's ``OptimizersContainer`` holding one galore2 optimizer per model part
    (two groups: the parameters whose name matches ``settings.pattern``, projected, and the
    rest, plain). Its state is created by ``init_state()`` before torchtitan reads or loads
    it (no zero-gradient step).

    Args:
        model_parts: the model parts to optimize (one unless pipeline-parallel).
        settings: what :func:`settings` read from the ``[optimizer]`` section.
    """

    def __init__(self, model_parts: list[nn.Module], settings: Settings) -> None:
        self.model_parts = model_parts
        self.optimizers = []
        all_params: list[nn.Parameter] = []
        for model in model_parts:
            projected, plain = [], []
            for name, p in model.named_parameters():
                if p.requires_grad:
                    matched = settings.plain is None or re.search(settings.pattern, name)
                    (projected if matched else plain).append(p)
            groups = [{"params": projected, **settings.projected}]
            if settings.plain is not None and plain:
                groups.append({"params": plain, **settings.plain})
            self.optimizers.append(settings.cls(groups, **settings.switches))
            all_params += projected + plain
        self._validate_length(len(model_parts))
        self._post_init(all_params, {"lr": settings.projected.get("lr", 1e-3)})


def build_optimizers(
    model_parts: list[nn.Module], optimizer_config: Any, parallel_dims: Any, ft_manager: Any = None
) -> OptimizersContainer:
    """torchtitan 0.2.x's ``build_optimizers_fn``: a galore2 preset's container when
    ``optimizer_config.name`` is one, torchtitan's own ``build_optimizers`` otherwise.

    Raises:
        ValueError: a bad ``[optimizer]`` section (see :func:`settings`), or torchft enabled
            with a galore2 optimizer (not supported).
    """
    if optimizer_config.name not in PRESETS:
        return torchtitan_build_optimizers(model_parts, optimizer_config, parallel_dims,
                                           ft_manager)  # fmt: skip
    if ft_manager is not None and getattr(ft_manager, "enabled", False):
        raise ValueError("torchft (--fault_tolerance.enable) is not supported with galore2 "
                         "optimizers")  # fmt: skip
    return GaLoreOptimizersContainer(model_parts, settings(optimizer_config))
