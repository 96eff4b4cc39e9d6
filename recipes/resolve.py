"""The one optimizer-aware step between the command line and a run's configuration.

    job = resolve(config.parse_args(argv))      # or parse_args(argv): the same

:mod:`recipes.config` reads a TOML file and the command line by the schema alone and keeps
[optim]'s settings as given. :func:`resolve` then, once, with the chosen optimizer
(``optim.name``) known:

1. routes each [optim] setting: an [optim] field (parsed by its type), or an option of the
   galore2 optimizer (Adafactor's ``eps`` pair and ``beta1`` are its own options, not
   Adam's fields: :func:`recipes.optimizers.is_own_option`);
2. parses and validates the options by their declarations (:func:`parse_options`:
   galore2's, the only ones; an unknown key is an error naming the allowed ones);
   everything downstream takes ``optim.options`` as parsed and passes them on unchanged;
3. sets the options the preset fixes (APOLLO's α, APOLLO-Mini's rank 1:
   :func:`recipes.optimizers.preset_fields`, asked once per run and kept in
   ``optim.fixed``), refusing them on the command line, where a value the user chose
   would not be used;
4. checks ``optim.adamw_kernel`` and ``optim.capture`` (which sets ``capturable=True``:
   :func:`recipes.optimizers.check_kernel_and_capture`).
"""

from __future__ import annotations

from collections.abc import Collection, Mapping
from typing import Any

from galore2.core.options import Option
from galore2.optim import GaLore
from galore2.optim.schedules import NUM_ITERATIONS
from galore2.presets import PRESETS

from . import config
from .config import JobConfig, OptimConfig
from .optimizers import (
    FROM_FIELDS,
    RECIPE_DEFAULTS,
    SHARED,
    check_kernel_and_capture,
    is_own_option,
    preset_fields,
)

__all__ = ["declarations", "optim_config", "parse_args", "parse_options", "resolve"]

#: the options any recipe optimizer may be given, by their galore2 declarations: GaLore's
#: :data:`recipes.optimizers.SHARED` settings and the schedule length of those that warm
#: up and down themselves (Ranger21's ``num_iterations``; a peer's too; default:
#: ``train.steps``)
_ANY_OPTIMIZER: dict[str, Option] = {
    **{o.name: o for o in GaLore.options if o.name in SHARED},
    NUM_ITERATIONS.name: NUM_ITERATIONS,
}


def declarations(name: str) -> dict[str, Option]:
    """The options ``--optim.KEY`` may set for recipe optimizer ``name``: GaLore's
    :data:`~recipes.optimizers.SHARED` settings and ``num_iterations`` for every optimizer (a config file sets
    them for all contenders; those that do not read them ignore them), and every option of
    a galore2 optimizer but those set from [optim]'s fields."""
    cls = PRESETS.get(name)
    own = {} if cls is None else cls.all_options()
    shared = {k: own.get(k, o) for k, o in _ANY_OPTIMIZER.items()}
    return shared | {k: o for k, o in own.items() if k not in FROM_FIELDS}


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
                f"and {', '.join(_ANY_OPTIMIZER)}"
            )
        if option is None:
            why = "set with its [optim] field" if key in FROM_FIELDS else "unknown setting"
            raise ValueError(
                f"{why} 'optim.{key}' for optimizer {name}; its options: "
                f"{', '.join(sorted(options))}"
            )
        out[key] = option.parse(value) if isinstance(value, str) else option.validate(value)
    return out


def option_lines() -> list[str]:
    """One usage line per option of every galore2 optimizer (for ``--help``)."""
    ours = ", ".join(f"{k}={v!r}" for k, v in RECIPE_DEFAULTS.items())
    lines = [f"  the recipe's own defaults (where an optimizer projects): {ours}"]
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
        if key in fields and not is_own_option(cfg.name, key):
            config.set_field(cfg, key, value, f"optim.{key}")
        else:  # an option of the chosen optimizer
            options[key] = value
    cfg.options = parse_options(cfg.name, options)
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
