"""Launches of one non-refresh batched step (``foreach=True``) per preset, counted on the CPU
(``benchmarks/step_counts.py``) on the tiny recipe model (28 matrices projected): within
issue 27's budget — 3 × torch AdamW (foreach, same groups)'s + 3 per projected matrix
(projection, back-projection or Fira's two products, apply), Muon's Newton–Schulz products
on top, one set per short × long shape — and, doubling the layers, more matmuls but no more
of the other launches: every rule runs once per batch or per shape, not per tensor."""

from __future__ import annotations

import functools
import warnings

import pytest
import torch

from benchmarks.step_counts import Counts, contender_maker, count_step, same_groups_adamw
from recipes.model import build_model
from recipes.resolve import parse_args

PROJECTED = 28  # the tiny model's attention and MLP matrices
NS_MATMULS = 2 * 3 * 5  # Muon: 2 short × long shapes (16×128, 16×352) × 3 products × 5 steps
# the 8-bit CPU quantizer (galore2.storage.dynamic8's packed torch path) runs once per
# group's pack of 8-bit directions, within the budget: no allowance
# Ranger21 (full rank, two groups: 3 × AdamW's is 54): AGC, centralization, normalization
# and norm loss act per row (galore2.optim.units): each is a gather, one reduction and one
# scale per distinct row width (two on the tiny model), a few ops on the per-row values and
# a write-back, on top of PNM's arithmetic (its softplus denominator over one buffer)
RANGER21_MODULES = 15
EXTRA = {"galore2_muon": NS_MATMULS, "ranger21": RANGER21_MODULES}
UNPROJECTED = ("ranger21",)  # no projected matrix: no per-matrix allowance, no matmul
# no launch per projected matrix outside the matmuls: APOLLO's apply — G ⊙ φ into each
# weight, the m×n update never made (galore2.core.ScaledUpdate, issue 38 item 6) — is one
# galore2::scaled_add_each_ per shape batch (galore2.core.apply._scaled_lists); its random
# projector keeps its small bases stacked between refreshes (galore2.optim.lowrank_batch)
KEYS = ("galore_adamw", "galore_adamw8bit", "galore2_fira", "galore2_apollo",
        "galore2_apollo_mini", "galore2_muon", "galore_adafactor", "ranger21",
        "galore_ranger21")  # fmt: skip


@pytest.fixture(autouse=True)
def _quiet():
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        yield


def _model(layers: int) -> torch.nn.Module:
    """The tiny recipe model (4 layers) or a shallower one."""
    cfg = parse_args(["--config", "tiny", "--model.n_layers", str(layers)]).model
    torch.manual_seed(0)
    return build_model(cfg)


@functools.cache
def _counts(key: str, layers: int = 4, reference: bool = False) -> Counts:
    """The batched step's counts, or (``reference``) torch AdamW's over the same groups."""
    if reference:
        return count_step(lambda m: same_groups_adamw(contender_maker(key)(m)), _model(layers))
    return count_step(contender_maker(key, foreach=True), _model(layers))


@pytest.mark.parametrize("key", KEYS)
def test_batched_step_within_the_launch_budget(key):
    ref, ours = _counts(key, reference=True), _counts(key)
    projected = 0 if key in UNPROJECTED else PROJECTED
    budget = 3 * ref.launches + 3 * projected + EXTRA.get(key, 0)
    assert ours.launches <= budget, (ours.launches, budget, ours.ops)
    assert ours.syncs <= 1


@pytest.mark.parametrize("key", KEYS)
def test_batched_launches_do_not_grow_with_the_parameter_count(key):
    small, large = _counts(key, layers=2), _counts(key)
    added = PROJECTED // 2  # matrices the two extra layers add
    grown = (large.launches - large.matmuls) - (small.launches - small.matmuls)
    assert grown == 0, (key, grown, added)
    if key in UNPROJECTED:
        assert large.matmuls == small.matmuls == 0
        return
    # the counter saw the projections; same-shape ones share one bmm per shape
    # (galore2.optim.lowrank_batch), so their matmuls need not grow
    assert large.matmuls >= small.matmuls > 0
