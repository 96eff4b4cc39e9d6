"""torchtitan 0.2.x: ``--job.custom_config_module galore2.integrations.torchtitan.job_config``.

Importing it (torchtitan's config manager does, while it parses the command line) adds
three fields to torchtitan's ``[optimizer]`` section (:class:`GaLoreFields`, read by
:func:`~.legacy.settings`) and registers the train spec ``llama3_galore``: torchtitan's
``llama3`` whose optimizers are built by :func:`~.legacy.build_optimizers` (so
``--model.name llama3_galore --optimizer.name galore_adamw`` trains Llama-3 with
GaLoreAdamW). :func:`galore_train_spec` does the same for any other train spec.

Imports torchtitan's Llama-3 train spec, which needs torchtitan's trainer dependencies
(``torchdata``, ``datasets``…). torchtitan 0.3.x configures the trainer otherwise: see
:mod:`.config_registry`.
"""

import dataclasses  # no ``from __future__ import annotations``: tyro and torchtitan's
# config merge read these fields' types as classes, not strings
from dataclasses import dataclass, field

from torchtitan.models.llama3 import get_train_spec
from torchtitan.protocols import train_spec as _specs

from .common import PROJECTED
from .legacy import build_optimizers

#: the train spec this module registers
TRAIN_SPEC = "llama3_galore"


@dataclass
class GaLoreFields:
    """What torchtitan's ``[optimizer]`` section gains (merged into its ``Optimizer``)."""

    galore_options: str = ""
    """A galore2 preset's options as key=value entries separated by commas, e.g.
    'rank=1024,update_proj_gap=500,scale=0.25' (with --optimizer.name galore_adamw...)"""

    projected: str = PROJECTED
    """Regex searched in parameter names: the projected group (the rest: the plain group)"""

    plain_options: str = ""
    """key=value entries overriding options on the plain group, e.g. 'weight_decay=0.0'"""


@dataclass
class JobConfig:
    """torchtitan's custom config: its ``optimizer`` section merged with :class:`GaLoreFields`."""

    optimizer: GaLoreFields = field(default_factory=GaLoreFields)


def galore_train_spec(spec: _specs.TrainSpec) -> _specs.TrainSpec:
    """``spec`` with its optimizers built by :func:`~.legacy.build_optimizers`."""
    return dataclasses.replace(spec, build_optimizers_fn=build_optimizers)


if TRAIN_SPEC not in _specs._extra_train_specs:
    _specs.register_train_spec(TRAIN_SPEC, galore_train_spec(get_train_spec()))
