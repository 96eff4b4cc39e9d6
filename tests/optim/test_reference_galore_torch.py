"""galore2 with projector="svd", moments_on_refresh="keep" reproduces galore-torch 1.0.

Deliberate differences (documented in README):
* eps: galore-torch adds eps to √v before bias correction (step size
  lr·√(1−β₂ᵗ)/(1−β₁ᵗ)); galore2 adds it after, as torch.optim.AdamW does. With
  eps = 1e-8 the two differ by far less than the tolerance.
* weight decay order: for projected matrices galore2 decays after the update like
  galore-torch; for plain parameters it decays before, like torch.optim.AdamW
  (galore-torch's plain parameters decay after, and use its eps convention: the
  biases and norms here differ from it by ≈ lr²·λ per step, so they are compared
  at a looser tolerance).
* rank ≥ min(m, n): galore-torch still projects (a full-size basis), galore2 falls
  back to plain AdamW — tested in test_adamw_equivalence.py.

``proj_type="full"`` is not compared: right after a refresh PᵀGQ = Σ is diagonal
and its off-diagonal entries are rounding noise (~1e-8), which Adam's
elementwise normalization turns into O(1) entries of either sign, so any two
correct implementations disagree at O(lr) from the first step.
"""

from __future__ import annotations

import copy
import warnings

import galore_torch  # the `test` extra: missing, it fails the run instead of skipping
import pytest
import torch

import galore2

from ..helpers import TinyNet, galore_groups, max_diff, train

STEPS, GAP = 22, 5  # refreshes at 0, 5, 10, 15, 20


def _reference(model, proj_type, rank, lr, wd):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return galore_torch.GaLoreAdamW(
            galore_groups(model, rank=rank, update_proj_gap=GAP, scale=0.5, proj_type=proj_type),
            lr=lr,
            eps=1e-8,
            weight_decay=wd,
            no_deprecation_warning=True,
        )


@pytest.mark.parametrize("proj_type", ["std", "reverse_std", "left", "right"])
@pytest.mark.parametrize("wd", [0.0, 0.1])
def test_matches_galore_torch(proj_type, wd):
    torch.manual_seed(0)
    ours_model = TinyNet()
    ref_model = copy.deepcopy(ours_model)
    ours = galore2.GaLoreAdamW(
        galore_groups(
            ours_model,
            rank=6,
            update_proj_gap=GAP,
            scale=0.5,
            proj_type=proj_type,
            projector="svd",
            moments_on_refresh="keep",
        ),
        lr=3e-3,
        eps=1e-8,
        weight_decay=wd,
    )
    ref = _reference(ref_model, proj_type, 6, 3e-3, wd)
    for step in range(STEPS):
        train(ours_model, ours, range(step, step + 1))
        train(ref_model, ref, range(step, step + 1))
    for (name, p), q in zip(ours_model.named_parameters(), ref_model.parameters(), strict=False):
        tol = 1e-5 if p.dim() == 2 else 1e-5 + STEPS * 3e-3**2 * wd
        assert (p - q).abs().max().item() <= tol, name
    # The run really moved and really refreshed.
    assert max_diff(ours_model, TinyNet().requires_grad_(False)) > 1e-3
    refreshes = [int(s["galore.refreshes"]) for s in ours.state.values() if "galore.refreshes" in s]
    assert refreshes and all(r == 5 for r in refreshes)


def test_moment_modes_really_differ_from_keep():
    """reset / project are real alternatives: they leave galore-torch's trajectory."""
    results = {}
    for mode in ("keep", "reset", "project"):
        torch.manual_seed(0)
        model = TinyNet()
        opt = galore2.GaLoreAdamW(
            galore_groups(
                model, rank=6, update_proj_gap=GAP, projector="svd", moments_on_refresh=mode
            ),
            lr=3e-3,
        )
        train(model, opt, range(STEPS))
        results[mode] = model
    assert max_diff(results["keep"], results["reset"]) > 1e-5
    assert max_diff(results["keep"], results["project"]) > 1e-5


@pytest.mark.parametrize("proj_type", ["std", "reverse_std"])  # both sides of every matrix
def test_projected_matrices_decay_after_the_update_like_galore_torch(proj_type):
    """At λ = 1 the decay order is visible: decaying the projected matrices before the
    update instead of after puts them 2e-5 to 4e-5 away from galore-torch in 22 steps,
    while the real (decay-after) run stays within 7e-6 of it (measured). Matrices only:
    plain parameters decay before the update by design (module docstring)."""
    wd, lr = 1.0, 3e-3
    torch.manual_seed(0)
    ours_model = TinyNet()
    ref_model = copy.deepcopy(ours_model)
    settings = {"rank": 6, "update_proj_gap": GAP, "scale": 0.5, "proj_type": proj_type}
    ours = galore2.GaLoreAdamW(
        galore_groups(ours_model, projector="svd", moments_on_refresh="keep", **settings),
        lr=lr,
        eps=1e-8,
        weight_decay=wd,
    )
    ref = _reference(ref_model, proj_type, 6, lr, wd)
    for step in range(STEPS):
        train(ours_model, ours, range(step, step + 1))
        train(ref_model, ref, range(step, step + 1))
    errors = {
        name: (p - q).abs().max().item()
        for (name, p), q in zip(ours_model.named_parameters(), ref_model.parameters(), strict=True)
        if p.dim() == 2
    }
    assert len(errors) == 3
    assert max(errors.values()) <= 1.3e-5, errors
