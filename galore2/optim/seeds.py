"""The group's base seed: one declaration for every module that draws from it.

GaLore seeds its random sketches and projections from it (``galore.seed``, mixed with the
parameter's index), Lookahead its stochastic rounding (``lookahead.seed``, with its own
tag): both read this option, neither reads the other.
"""

from __future__ import annotations

from ..core.options import Int, Option

SEED = Option(
    "seed",
    0,
    Int(low=0, high=2**62),
    "base seed of the random sketches and projections",
    resumable=False,
)
