"""Peer optimizers from other packages, built on the recipe's parameter split (for benchmarks).

The benchmarks give :data:`PEERS` to the recipe (``recipes.pretrain.main(argv, PEERS)``,
``recipes.optimizers.build_optimizer(..., peers=PEERS)``), which names none itself. Each
peer gets the same split as galore2's optimizers (see :func:`recipes.optimizers.
param_groups`): the attention / MLP matrices in one projected group when the peer
projects (with that package's own group keys, filled from ``optim.*``), everything
else in plain groups. Settings follow each package's README for LLM pre-training:

=========================  =================================================================
``gt_galore_adamw``        galore-torch 1.0 ``GaLoreAdamW`` (rank, update_proj_gap, scale,
                           proj_type)
``gt_galore_adamw8bit``    galore-torch 1.0 ``GaLoreAdamW8bit`` (CUDA only: it calls
                           ``torch.cuda.synchronize`` unconditionally)
``gt_galore_adafactor``    galore-torch 1.0 ``GaLoreAdafactor`` with an explicit lr
                           (``relative_step=False, scale_parameter=False``), no first moment
``qgalore_adamw8bit``      q-galore-torch 1.0 ``QGaLoreAdamW8bit`` (INT4 basis, group 256,
                           adaptive refresh; CUDA only, like galore-torch's 8-bit class)
``at_apollo``              apollo-torch ``APOLLOAdamW``: random projection at ``optim.rank``,
                           channel-wise scaling, apollo scale 1 (galore2's: ``apollo``)
``at_apollo_mini``         the same class as APOLLO-Mini: rank 1, tensor-wise scaling,
                           apollo scale 128 (galore2's: ``apollo_mini``)
``fira_adamw``             fira 1.0.2 ``FiraAdamW`` (rank, update_proj_gap, alpha = ``optim.
                           scale``, proj_type; galore2's: ``fira``)
``pto_galore``             pytorch-optimizer's ``GaLore`` (rank, update_proj_gap, scale,
                           projection_type)
``pto_ranger21``           pytorch-optimizer's ``Ranger21`` (full rank, its own schedule)
=========================  =================================================================

None of these keep tensor-only state (their projectors are Python objects), so
the recipe does not checkpoint them (``train.checkpoint_every`` is treated as -1).
"""

from __future__ import annotations

import importlib
import logging
import warnings
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

from recipes.config import OptimConfig
from recipes.optimizers import setting

Keys = Callable[[OptimConfig], dict[str, Any]]


@contextmanager
def quiet_peers() -> Iterator[None]:
    """Peers' imports and first steps with warnings off and bitsandbytes (which they import)
    at ERROR: its CPU-kernel notices are noise here."""
    log = logging.getLogger("bitsandbytes")
    level = log.level
    log.setLevel(logging.ERROR)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            yield
    finally:
        log.setLevel(level)


def _no_keys(cfg: OptimConfig) -> dict[str, Any]:
    return {}


def _galore_keys_as(scale: str = "scale", proj_type: str = "proj_type") -> Keys:
    """GaLore's four shared settings under a package's own names for α and the side rule."""

    def keys(cfg: OptimConfig) -> dict[str, Any]:
        return {
            "rank": setting(cfg, "rank"),
            "update_proj_gap": setting(cfg, "update_proj_gap"),
            scale: setting(cfg, "scale"),
            proj_type: setting(cfg, "proj_type"),
        }

    return keys


_galore_keys = _galore_keys_as()
_pto_galore_keys = _galore_keys_as(proj_type="projection_type")  # pytorch-optimizer
_fira_keys = _galore_keys_as(scale="alpha")  # fira's α


def _qgalore_keys(cfg: OptimConfig) -> dict[str, Any]:
    # q-galore-torch's README settings: INT4 projection, group 256, cos threshold 0.4,
    # gap doubling (gamma 2) after a queue of 5 similar refreshes.
    return {
        **_galore_keys(cfg),
        "quant": True,
        "quant_n_bit": 4,
        "quant_group_size": 256,
        "cos_threshold": 0.4,
        "gamma_proj": 2,
        "queue_size": 5,
    }


def _apollo_keys(rank: int | None, scale_type: str, scale: float) -> Keys:
    def keys(cfg: OptimConfig) -> dict[str, Any]:
        return {
            "rank": setting(cfg, "rank") if rank is None else rank,
            "proj": "random",
            "scale_type": scale_type,
            "update_proj_gap": setting(cfg, "update_proj_gap"),
            "scale": scale,
            "proj_type": "std",
        }

    return keys


def _adam_kwargs(cfg: OptimConfig) -> dict[str, Any]:
    return {"betas": setting(cfg, "betas"), "eps": setting(cfg, "eps")}


def _quiet_adam_kwargs(cfg: OptimConfig) -> dict[str, Any]:
    # galore-torch's and fira's AdamW (transformers' old AdamW) warn without it
    return {**_adam_kwargs(cfg), "no_deprecation_warning": True}


def _adafactor_kwargs(cfg: OptimConfig) -> dict[str, Any]:
    return {"relative_step": False, "scale_parameter": False, "warmup_init": False}


def _ranger_kwargs(cfg: OptimConfig) -> dict[str, Any]:
    return _adam_kwargs(cfg)  # num_iterations is added by build_optimizer (own schedule)


@dataclass(frozen=True)
class Peer:
    """How to build one peer: ``module.attr(groups, lr=, weight_decay=, **kwargs(cfg))``."""

    package: str  # the PyPI name (a benchmark extra)
    module: str
    attr: str
    projected: bool
    group_keys: Keys = field(default=_no_keys)  # keys of the projected group
    kwargs: Keys = field(default=_adam_kwargs)
    own_schedule: bool = False

    def load(self) -> Callable[..., Any]:
        """The peer's class; a clear RuntimeError when its package is missing."""
        try:
            with quiet_peers():
                module = importlib.import_module(self.module)
        except ImportError as e:
            raise RuntimeError(
                f"{self.module}.{self.attr} needs {self.package}: pip install -e '.[bench]' ({e})"
            ) from e
        return getattr(module, self.attr)


PEERS: dict[str, Peer] = {
    "gt_galore_adamw": Peer(
        "galore-torch", "galore_torch", "GaLoreAdamW", True, _galore_keys, _quiet_adam_kwargs
    ),
    "gt_galore_adamw8bit": Peer(
        "galore-torch", "galore_torch", "GaLoreAdamW8bit", True, _galore_keys
    ),
    "gt_galore_adafactor": Peer(
        "galore-torch", "galore_torch", "GaLoreAdafactor", True, _galore_keys, _adafactor_kwargs
    ),
    "qgalore_adamw8bit": Peer(
        "q-galore-torch", "q_galore_torch", "QGaLoreAdamW8bit", True, _qgalore_keys
    ),
    "at_apollo": Peer(
        "apollo-torch", "apollo_torch", "APOLLOAdamW", True, _apollo_keys(None, "channel", 1.0)
    ),
    "at_apollo_mini": Peer(
        "apollo-torch", "apollo_torch", "APOLLOAdamW", True, _apollo_keys(1, "tensor", 128.0)
    ),
    "fira_adamw": Peer("fira", "fira", "FiraAdamW", True, _fira_keys, _quiet_adam_kwargs),
    "pto_galore": Peer("pytorch-optimizer", "pytorch_optimizer", "GaLore", True, _pto_galore_keys),
    "pto_ranger21": Peer(
        "pytorch-optimizer",
        "pytorch_optimizer",
        "Ranger21",
        False,
        kwargs=_ranger_kwargs,
        own_schedule=True,
    ),
}
