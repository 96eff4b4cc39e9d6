"""The one optimizer-aware step between the command line and a run's configuration.

    job = resolve(config.parse_args(argv))      # or parse_args(argv): the same

:mod:`recipes.config` reads a TOML file and the command line by the schema alone and keeps
[optim]'s settings as given. :func:`resolve` then, once, with the chosen optimizer
(``optim.name``) known:

1. routes each [optim] setting: an [optim] field of the recipe's own (parsed by its type),
   or an option (``lr``, ``weight_decay``, ``betas``, ``eps``, ``rank``... every option of
   the optimizer: :func:`recipes.optimizers.declarations`; ``beta1`` / ``beta2``, the
   halves of ``betas`` an earlier release took, are still read: :func:`join_betas`);
2. parses and validates the options by their declarations (:func:`parse_options`:
   galore2's, the only ones; an unknown key is an error naming the allowed ones);
   everything downstream takes ``optim.options`` as parsed and passes them on unchanged;
3. sets the options the preset fixes (APOLLO's α, APOLLO-Mini's rank 1:
   :func:`recipes.optimizers.preset_fields`, asked once per run and kept in
   ``optim.fixed``), refusing them on the command line, where a value the user chose
   would not be used;
4. checks ``optim.adamw_kernel`` and ``optim.capture`` (which sets ``capturable=True``:
   :func:`recipes.optimizers.check_kernel_and_capture`).

:func:`recorded` reads a recorded [optim] section (a run's config.json) of any release in
today's layout, for a resume to compare.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Collection, Mapping
from typing import Any

from galore2.optim.adam import EPS
from galore2.presets import PRESETS

from . import config
from .config import JobConfig, OptimConfig
from .optimizers import (
    EVERY,
    RECIPE_DEFAULTS,
    check_kernel_and_capture,
    declarations,
    preset_fields,
)

__all__ = [
    "declarations",
    "join_betas",
    "optim_config",
    "parse_args",
    "parse_options",
    "recorded",
    "resolve",
]

#: how [optim] spelled the halves of Adam's ``betas`` before it was an option
#: (``--optim.beta1 0.9 --optim.beta2 0.95``, fields until 2026-11-28): still read, for an
#: optimizer without an option of that name (GaLoreAdafactor's ``beta1`` is its own)
BETA_HALVES = ("beta1", "beta2")
#: the [optim] fields: every other key of a section is an option
FIELDS = frozenset(f.name for f in dataclasses.fields(OptimConfig))


def parse_options(name: str, raw: dict[str, Any]) -> dict[str, Any]:
    """``optim.options`` parsed (strings from the command line) and validated by the
    declarations of optimizer ``name`` (:func:`declarations`); errors name the key and what
    is allowed."""
    options = declarations(name)
    out = {}
    for key, value in raw.items():
        option = options.get(key)
        if option is None and name not in PRESETS:
            raise ValueError(
                f"unknown setting 'optim.{key}' for optimizer {name!r}: only galore2 "
                f"optimizers ({', '.join(PRESETS)}) take options beyond [optim]'s fields "
                f"and {', '.join(EVERY)}"
            )
        if option is None:
            raise ValueError(
                f"unknown setting 'optim.{key}' for optimizer {name}; its options: "
                f"{', '.join(sorted(options))}"
            )
        out[key] = option.parse(value) if isinstance(value, str) else option.validate(value)
    return out


def option_lines() -> list[str]:
    """One usage line per option of every galore2 optimizer (for ``--help``)."""
    ours = ", ".join(f"{k}={v!r}" for k, v in RECIPE_DEFAULTS.items())
    where = "over those below; rank where an optimizer projects"
    lines = [f"  the recipe's own defaults ({where}): {ours}"]
    for name in PRESETS:
        options = declarations(name).values()
        lines.append(f"  {name}: " + ", ".join(f"{o.name}={o.default!r}" for o in options))
    return lines


def optim_config(settings: Mapping[str, Any], cli: Collection[str] = ()) -> OptimConfig:
    """The [optim] section from its settings as given (``name`` and any other key: a field
    or an option); ``cli``: the keys given on the command line (a preset-fixed one is
    refused)."""
    cfg = OptimConfig()
    raw = dict(settings)
    if "name" in raw:
        config.set_field(cfg, "name", raw.pop("name"), "optim.name")
    fields = config.field_names(cfg)
    options = {}
    for key, value in raw.items():
        if key in fields:
            config.set_field(cfg, key, value, f"optim.{key}")
        else:  # an option of the chosen optimizer
            options[key] = value
    cfg.options = parse_options(cfg.name, join_betas(cfg.name, options))
    cfg.fixed = preset_fields(cfg.name)
    refused = {k: v for k, v in cfg.fixed.items() if k in cli}
    if refused:  # a value the user chose would not be used: refuse instead of ignoring it
        key, value = next(iter(refused.items()))
        raise ValueError(
            f"--optim.{key}: optimizer {cfg.name!r} fixes optim.{key}={value:g} (its "
            f"definition); for another value use galore_adamw with the same options, e.g. "
            "--optimizer galore_adamw --optim.projector random --optim.scale_type channel"
        )
    cfg.options.update(cfg.fixed)  # the run's recorded configuration is the one in force
    check_kernel_and_capture(cfg)
    return cfg


def join_betas(name: str, raw: Mapping[str, Any]) -> dict[str, Any]:
    """``raw`` (options as given) with ``beta1`` / ``beta2`` (:data:`BETA_HALVES`) as the
    halves of ``betas``, the other half at its default, for optimizer ``name`` where it has
    no option of that name; ``ValueError`` naming the key for a value that is no beta, or
    when ``betas`` is given too."""
    options = declarations(name)
    pair = options["betas"]
    halves = {k: raw[k] for k in BETA_HALVES if k in raw and k not in options}
    if not halves:
        return dict(raw)
    if "betas" in raw:
        raise ValueError(
            f"optim.betas and optim.{'/'.join(halves)} set the same option: give "
            "optim.betas only (e.g. --optim.betas 0.9,0.95)"
        )
    values = list(pair.default)
    for i, (key, check) in enumerate(zip(BETA_HALVES, (pair.check.first, pair.check.second), strict=True)):
        if key in halves:
            text = halves[key]
            try:
                values[i] = check(check.parse(text) if isinstance(text, str) else text)
            except (TypeError, ValueError):
                raise ValueError(f"optim.{key} must be {check.describe}, got {text!r}") from None
    return {**{k: v for k, v in raw.items() if k not in halves}, "betas": tuple(values)}


def recorded(section: Mapping[str, Any]) -> dict[str, Any]:
    """A recorded [optim] section (a run's config.json, a checkpoint's record) in today's
    layout: the options an earlier release kept as fields (GaLore's ``rank``,
    ``update_proj_gap``, ``scale``, ``proj_type``; ``lr``, ``weight_decay``; Adam's ``eps``,
    and its ``beta1`` / ``beta2`` as ``betas``) moved into ``options``. A key no option of
    the optimizer declares stays where it is (a field of another release)."""
    out = dict(section)
    options = declarations(out.get("name", OptimConfig.name))
    if options["eps"] is not EPS:  # the field was Adam's eps, which this optimizer does not
        out.pop("eps", None)  # read (GaLoreAdafactor: its own eps is in ``options``)
    halves = {i: out.pop(k) for i, k in enumerate(BETA_HALVES) if k in out}  # Adam's too
    moved = {k: out.pop(k) for k in list(out) if k not in FIELDS and k in options}
    if halves:
        moved["betas"] = [halves.get(i, v) for i, v in enumerate(options["betas"].default)]
    out["options"] = {**moved, **(section.get("options") or {})}
    return out


def resolve(args: config.Args) -> JobConfig:
    """The run's configuration: ``args.job`` with its [optim] section resolved as the
    module's docstring says."""
    args.job.optim = optim_config(args.optim, args.cli_optim)
    return args.job


def parse_args(argv: list[str] | None = None) -> JobConfig:
    """:func:`recipes.config.parse_args` (``--help`` also lists every galore2 optimizer's
    options), then :func:`resolve`."""
    head = "options of galore2 optimizers (--optim.KEY VALUE; see docs/guides/galore-options.md):"
    return resolve(config.parse_args(argv, ("", head, *option_lines())))
