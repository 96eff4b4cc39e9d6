"""torchtitan integration: galore2's optimizers in torchtitan's trainer, by configuration.

``GaLoreOptimizersContainer`` is torchtitan's ``OptimizersContainer`` with every galore2
preset as an ``optimizer_name``; put its ``Config`` (e.g. from :func:`galore_config`) in a
trainer config's ``optimizer`` field. The ready-made trainer configs in
:mod:`galore2.integrations.torchtitan.config_registry` are what
``--module galore2.integrations.torchtitan --config llama3_8b_galore`` loads.

Importing this package imports ``torchtitan`` (``pip install galore2[torchtitan]``);
``import galore2`` does not.
"""

from .container import FOREACH, PROJECTED, GaLoreOptimizersContainer, check_config, galore_config

__all__ = ["FOREACH", "PROJECTED", "GaLoreOptimizersContainer", "check_config", "galore_config"]
