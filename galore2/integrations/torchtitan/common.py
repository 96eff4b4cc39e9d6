"""What both torchtitan APIs share (0.3.x: :mod:`.container`; 0.2.x: :mod:`.job_config`):
the parameters projected by default, ``implementation`` → ``foreach``, option checks, the
split of projected / plain options, and state created by ``init_state()`` before torchtitan
reads or loads it. Imports no torchtitan module: the version dispatch
(:mod:`galore2.integrations.torchtitan`) imports it first.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

from ...core.optimizer import ChainOptimizer
from ...core.options import closest, hints
from ...core.transform import walk
from ...optim.galore import GaLore

#: The parameters projected by default: the weights of every attention and MLP linear of
#: torchtitan's decoder models (``layers.N.attention.qkv_linear.wqkv.weight`` — 0.2.x:
#: ``….attention.wq.weight`` —, ``….attention.wo.weight``, ``….feed_forward.w1.weight``…);
#: embeddings, the output head and norms fall through to the plain group. 1-D weights
#: matched here are not projected.
PROJECTED = r"\.(attention|feed_forward)\..*weight$"
#: torchtitan's ``implementation`` → galore2's ``foreach`` option
FOREACH: dict[str, bool | None] = {"fused": None, "foreach": True, "for-loop": False}
#: the group key torchtitan uses for torch's fused kernels (not a galore2 option)
FUSED = "fused"


def _switches(cls: type[ChainOptimizer]) -> set[str]:
    """A preset's constructor switches: options that are not group keys."""
    return {o.name for o in cls.construct_options}


def _check_keys(cls: type[ChainOptimizer], keys: Iterable[str], where: str) -> None:
    options = cls.all_options()
    unknown = sorted(set(keys) - set(options))
    if unknown:
        raise ValueError(
            f"{where}: unknown option(s) {unknown} for {cls.__name__}"
            f"{closest(unknown, options)}{hints(cls.option_hints, unknown)}; "
            f"its options are {sorted(options)}"
        )


def _split(cls: type[ChainOptimizer], kwargs: Mapping[str, Any]) -> tuple[dict, dict]:
    """``(group options, constructor switches)`` of one group's options."""
    switches = _switches(cls)
    group = {k: v for k, v in kwargs.items() if k not in switches and k != FUSED}
    return group, {k: v for k, v in kwargs.items() if k in switches}


def _projects(cls: type[ChainOptimizer]) -> bool:
    return GaLore in walk(cls.modules)


def plain_options(options: Mapping[str, Any]) -> dict[str, Any]:
    """``options`` without GaLore's own (``rank``, ``update_proj_gap``, ``scale``…): what
    the plain group (embeddings, head, norms) gets."""
    galore_keys = {o.name for o in GaLore.options}
    return {k: v for k, v in options.items() if k not in galore_keys}


class InitsGaLoreState:
    """Mixed into a torchtitan ``OptimizersContainer``: galore2 optimizers' missing state is
    created by ``init_state()`` (what their first step would create, no step taken) before
    torchtitan reads or loads it — not by torchtitan's zero-gradient step."""

    optimizers: list[Any]

    def _init_galore_state(self) -> None:
        for optim in self.optimizers:
            if isinstance(optim, ChainOptimizer):
                optim.init_state()

    def state_dict(self) -> dict[str, Any]:
        """torchtitan's flat, name-keyed state dict; galore2 optimizers' missing state is
        created first by ``init_state()`` (no zero-gradient step)."""
        self._init_galore_state()
        return super().state_dict()  # type: ignore[misc]

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Load torchtitan's flat state dict (galore2 checks it against each optimizer
        before anything changes); missing galore2 state is created by ``init_state()``."""
        self._init_galore_state()
        super().load_state_dict(state_dict)  # type: ignore[misc]
