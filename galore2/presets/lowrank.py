"""Post-GaLore update rules as thin presets of :class:`~galore2.GaLoreAdamW`: Fira's residual
compensation, APOLLO's gradient scaling and GaLore with orthogonalized momentum (Muon).

Each only changes defaults or the inner rule; every option of GaLoreAdamW applies (8-bit
moments: ``GaLoreAdamW8bit(..., residual="fira")`` or ``scale_type="channel"``; quantized
bases: ``basis_dtype``). Groups without ``rank`` are plain AdamW, as in the reference
packages.
"""

from __future__ import annotations

import functools
import math
from typing import Any, ClassVar

from ..core.modules import DecoupledWeightDecay
from ..optim.adam import ScaleByAdam
from ..optim.galore import GaLore
from ..optim.muon import MuonOrAdam, ScaleByMuon
from .adamw import GaLoreAdamW

_APOLLO_HINTS = {
    "proj": "proj is apollo-torch's key; galore2's is projector (APOLLO's default: 'random')",
    "scale_front": "apollo-torch's scale_front is not needed: α multiplies the update once",
    "disable_nl": "apollo-torch's disable_nl is norm_growth_limit=None here",
}


class Fira(GaLoreAdamW):
    """:class:`~galore2.GaLoreAdamW` with Fira's residual compensation (arXiv 2410.01623).

    The update of a projected matrix is α·P·N + φ ⊙ (G − P·PᵀG): GaLore's back-projected
    Adam update plus the gradient's residual outside the subspace, scaled per channel by
    φ = ‖N‖/‖PᵀG‖ and held to at most ``norm_growth_limit`` (γ = 1.01) growth per step.
    Defaults as GaLoreAdamW (``residual="fira"``); see :mod:`galore2.optim.residual`
    for the definition and how it differs from the ``fira`` package at α ≠ 1
    (``residual="fira_reference"`` is the package's behaviour).
    """

    preset_defaults: ClassVar[dict[str, Any]] = {"residual": "fira"}


class APOLLO(GaLoreAdamW):
    """APOLLO (arXiv 2412.05270): AdamW's per-channel scaling estimated in a random subspace.

    Adam runs on R = G·Q (or PᵀG) for a seeded Gaussian basis regenerated from its seed
    (``projector="random"``: nothing stored but the seed); the update is the raw gradient
    scaled per channel by ‖N‖/‖R‖ (``scale_type="channel"``), with the norm-growth limiter,
    times α (``scale``, default 1). Set ``rank`` on the groups to project (apollo-torch's
    README uses 256 at 1B); groups without it are plain AdamW. apollo-torch's group keys
    map as: ``proj`` → ``projector``, ``scale_type`` → ``scale_type``, ``scale`` → α = √scale
    (apollo-torch multiplies by the square root of its ``scale``).
    """

    preset_defaults: ClassVar[dict[str, Any]] = {
        "projector": "random",
        "scale_type": "channel",
        "scale": 1.0,
    }
    option_hints: ClassVar[dict[str, str]] = _APOLLO_HINTS


class APOLLOMini(GaLoreAdamW):
    """APOLLO-Mini: :class:`APOLLO` with one scaling factor per matrix (``scale_type="tensor"``)
    and its published α = √128 (apollo-torch's ``scale=128``). Use ``rank=1`` on the projected
    groups (e.g. ``galore2.param_groups(model, rank=1)``): the state is then about one row
    or column per matrix — SGD's memory."""

    preset_defaults: ClassVar[dict[str, Any]] = {
        "projector": "random",
        "scale_type": "tensor",
        "scale": math.sqrt(128),
    }
    option_hints: ClassVar[dict[str, str]] = _APOLLO_HINTS
    #: the rank of its projected groups by definition (not a group default: a default
    #: ``rank`` would project every group); read by the recipe and the Trainer integration
    projected_rank: ClassVar[int | None] = 1


def galore_projects(group: dict[str, Any]) -> bool:
    """Whether GaLore projects ``group`` (its ``rank`` is set): the groups whose 2-D
    directions :class:`GaLoreMuon` hands to Muon."""
    return group["rank"] is not None


class GaLoreMuon(GaLoreAdamW):
    """GaLore with orthogonalized momentum in the subspace (Muon's Newton–Schulz iteration, or
    SUMO's exact polar factor with ``orthogonalize="polar"``).

    Projected matrices keep one low-rank momentum (r×n or m×r) instead of Adam's two
    moments; each step orthogonalizes it and projects it back (α·P·O). Matrices in a group
    with ``rank ≥ min(m, n)`` get full-rank Muon; groups without ``rank`` (embeddings, head,
    norms, biases) get AdamW. ``adjust_lr_fn="match_rms_adamw"`` scales the orthogonalized
    update to AdamW's RMS, so AdamW's learning rates apply. See :mod:`galore2.optim.muon`.
    """

    modules = (GaLore, MuonOrAdam, ScaleByMuon, ScaleByAdam, DecoupledWeightDecay)
    #: Muon in the groups GaLore projects, Adam in the others
    adam_transform = staticmethod(functools.partial(MuonOrAdam, galore_projects))
