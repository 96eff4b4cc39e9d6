"""torchtitan integration: galore2's optimizers in torchtitan's trainer, by configuration.

Two torchtitan APIs, chosen by what the installed torchtitan provides (:func:`api_of`):

* **0.3.x** (torch >= 2.12: it imports ``DataParallelMeshDims`` from
  ``torch.distributed.fsdp``): ``GaLoreOptimizersContainer`` is torchtitan's
  ``OptimizersContainer`` with every galore2 preset as an ``optimizer_name``; put its
  ``Config`` (e.g. from :func:`galore_config`) in a trainer config's ``optimizer`` field.
  The ready-made trainer configs in :mod:`galore2.integrations.torchtitan.config_registry`
  are what ``--module galore2.integrations.torchtitan --config llama3_8b_galore`` loads.
* **0.2.x** (0.2.2 imports on torch 2.11): torchtitan's ``[optimizer]`` section names the
  preset (``--optimizer.name galore_adamw``) and ``--job.custom_config_module
  galore2.integrations.torchtitan.job_config`` adds its options and the train spec
  ``llama3_galore`` (:mod:`.legacy`: ``GaLoreOptimizersContainer``, ``build_optimizers``).

Importing this package imports ``torchtitan`` (``pip install galore2[torchtitan]``);
``import galore2`` does not.
"""

from __future__ import annotations

from importlib import import_module
from importlib.metadata import PackageNotFoundError, version
from types import ModuleType
from typing import Any


def api_of(optimizer_module: ModuleType) -> str:
    """``"0.3"`` or ``"0.2"``: the container API of ``torchtitan.components.optimizer``
    (0.3.x configures containers with ``ParamGroupConfig``; 0.2.x builds them with
    ``build_optimizers(model_parts, optimizer_config, parallel_dims)``).

    Raises:
        ImportError: neither (another torchtitan), naming its version.
    """
    if hasattr(optimizer_module, "ParamGroupConfig"):
        return "0.3"
    if hasattr(optimizer_module, "build_optimizers") and hasattr(
        optimizer_module, "OptimizersContainer"
    ):
        return "0.2"
    raise ImportError(
        f"torchtitan {_version('torchtitan')}: neither the 0.3.x container API "
        "(ParamGroupConfig) nor the 0.2.x one (build_optimizers); galore2 supports "
        "torchtitan 0.2.x and 0.3.x"
    )


def _version(package: str) -> str:
    try:
        return version(package)
    except PackageNotFoundError:
        return "(not installed)"


def _import_optimizer_module() -> ModuleType:
    try:
        return import_module("torchtitan.components.optimizer")
    except ImportError as e:
        if "DataParallelMeshDims" in str(e):  # torchtitan 0.3.x on torch < 2.12
            raise ImportError(
                f"torchtitan {_version('torchtitan')} needs torch >= 2.12 (found torch "
                f"{_version('torch')}: {e}); with torch 2.11 install torchtitan 0.2.2 "
                "(docs/guides/torchtitan.md)"
            ) from e
        raise


API = api_of(_import_optimizer_module())

if API == "0.3":
    from .common import FOREACH, PROJECTED
    from .container import GaLoreOptimizersContainer, check_config, galore_config

    __all__ = ["API", "FOREACH", "PROJECTED", "GaLoreOptimizersContainer", "api_of",
               "check_config", "galore_config"]  # fmt: skip
else:
    from .common import FOREACH, PROJECTED
    from .legacy import GaLoreOptimizersContainer, build_optimizers, settings

    def galore_config(*args: Any, **kwargs: Any) -> Any:
        """Not in torchtitan 0.2.x (no container configs).

        Raises:
            ImportError: always, saying what to use instead.
        """
        raise ImportError(
            f"galore_config needs torchtitan 0.3.x (installed: {_version('torchtitan')}); "
            "with torchtitan 0.2.x set --optimizer.name and --job.custom_config_module "
            "galore2.integrations.torchtitan.job_config (docs/guides/torchtitan.md)"
        )

    check_config = galore_config

    __all__ = ["API", "FOREACH", "PROJECTED", "GaLoreOptimizersContainer", "api_of",
               "build_optimizers", "check_config", "galore_config", "settings"]  # fmt: skip
