"""Results of the update rules that the batched (foreach) path covers, recorded before a
refactor of that path and compared after it.

    python -m tools.batch_reference --write [--out PATH]   # record (before the change)
    python -m tools.batch_reference [--out PATH]           # compare (after it)

Every config of :data:`CONFIGS` takes 12 steps (``update_proj_gap`` 5: refreshes at steps
0, 5 and 10) on :func:`params` — matrices of both orientations, same-shape repeats (what
the batched path stacks), low-rank directions of ≥ 4096 elements (8-bit moments), vectors —
with seeded gradients that depend on the weights, once per-tensor (``foreach=False``) and
once batched (``foreach=True``). This tool's comparison (a recording of the same machine,
same threads) allows 1e-6 (absolute) on every weight, against the per-tensor reference, for
both paths; the tests compare the two paths of one run with a bound derived from float32
(``tests.helpers.f32_bound``), which holds on any CPU. The reference file is machine-specific
(float rounding of the CPU's kernels; exact SVDs also depend on the thread count) and
about 6 MB, so it is not committed: record it on the machine that checks, from the commit
before the change, and compare with the same number of threads.
"""

from __future__ import annotations

import argparse
import math
import warnings
from collections.abc import Callable

import torch

import galore2

SHAPES = [(48, 320), (48, 320), (320, 48), (320, 48), (40, 40), (40, 40), (40, 40), (24, 56),
          (56, 24)]  # fmt: skip
PLAIN = [(64, 80), (40,), (48,)]  # a 8-bit sized unprojected matrix and vectors
STEPS, GAP, TOL = 12, 5, 1e-6
#: configs whose exact-SVD refreshes amplify the batched combine's last-bit differences
#: (1 ulp at step 0 becomes ~2e-6 after two SVD refreshes of slightly different gradients;
#: the same settings with GaLoreAdamW already drifted 4.3e-6 before issue 27's batching)
#: Ranger21's batched modules (row statistics per row width) end a few ulps apart on weights
#: of magnitude ~5 after 12 steps (1e-6 is 2 ulps there; relative difference ≤ 5e-7)
LOOSE = {"fira_scale": 5e-6, "ranger21": 5e-6, "galore_ranger21": 5e-6}


def tolerance(name: str) -> float:
    """The batched path's allowed max |Δ| from the per-tensor path for config ``name``."""
    return LOOSE.get(name, TOL)


COMMON = {"lr": 1e-2, "weight_decay": 0.1}


def params() -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return [torch.randn(s, generator=g).requires_grad_() for s in (*SHAPES, *PLAIN)]


def _groups(ps: list[torch.Tensor], rank: int | None, **group) -> list[dict]:
    if rank is None:
        return [{"params": ps}]
    n = len(SHAPES)
    return [{"params": ps[:n], "rank": rank, "update_proj_gap": GAP, **group},
            {"params": ps[n:]}]  # fmt: skip


Make = Callable[[list[torch.Tensor], bool], torch.optim.Optimizer]


def _preset(cls: type, rank: int | None = 16, **options) -> Make:
    group = {k: options.pop(k) for k in ("scale",) if k in options}
    options = {**COMMON, **options}
    return lambda ps, foreach: cls(_groups(ps, rank, **group), foreach=foreach, **options)


CONFIGS: dict[str, Make] = {
    "galore_adamw": _preset(galore2.GaLoreAdamW),
    "fira": _preset(galore2.Fira),
    "fira_scale": _preset(galore2.Fira, scale=0.5, projector="svd"),
    "fira_reference": _preset(galore2.Fira, residual="fira_reference", scale=0.25),
    "fira_nolimit": _preset(galore2.Fira, norm_growth_limit=None),
    "apollo": _preset(galore2.APOLLO),
    "apollo_tensor_limit": _preset(galore2.APOLLO, scale_type="tensor", norm_growth_limit=1.01),
    "apollo_mini": _preset(galore2.APOLLOMini, rank=1),
    "galore_muon": _preset(galore2.GaLoreMuon),
    "galore_muon_polar": _preset(galore2.GaLoreMuon, orthogonalize="polar"),
    "galore_muon_full": _preset(galore2.GaLoreMuon, rank=64),  # rank ≥ min: whole matrices
    "ranger21": _preset(galore2.Ranger21, rank=None, num_iterations=STEPS),
    "galore_ranger21": _preset(galore2.GaLoreRanger21, num_iterations=STEPS),
    "galore_adamw8bit": _preset(galore2.GaLoreAdamW8bit),
    "galore_adamw8bit_fira": _preset(galore2.GaLoreAdamW8bit, residual="fira"),
    "galore_adafactor": _preset(galore2.GaLoreAdafactor),
    "galore_adafactor_beta1": _preset(galore2.GaLoreAdafactor, beta1=0.9),
    # torch's rules: the step size capped at 1/√t (below lr from step 5) and scaled by RMS(θ)
    "galore_adafactor_relative": _preset(
        galore2.GaLoreAdafactor, lr=0.5, relative_step=True, scale_parameter=True
    ),
    "galore_adafactor_8bit": _preset(galore2.GaLoreAdafactor, beta1=0.9, moments_8bit=True),
}


def run(
    make: Make,
    foreach: bool,
    steps: int = STEPS,
    between: Callable[[int, torch.optim.Optimizer, list[torch.Tensor]], None] | None = None,
) -> list[torch.Tensor]:
    """The weights after ``steps`` steps on seeded weight-dependent gradients;
    ``between(step, opt, params)`` runs after each step (a test's intervention)."""
    ps = params()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        opt = make(ps, foreach)
        for step in range(steps):
            g = torch.Generator().manual_seed(100 + step)
            for p in ps:
                p.grad = torch.randn(p.shape, generator=g) + 0.5 * p.detach()
            opt.step()
            if between is not None:
                between(step, opt, ps)
    return [p.detach().clone() for p in ps]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--write", action="store_true", help="record the reference")
    ap.add_argument("--out", default="/tmp/galore2_batch_reference.pt")
    ap.add_argument("--only", nargs="*", default=list(CONFIGS))
    args = ap.parse_args()
    got = {(name, fe): run(CONFIGS[name], fe) for name in args.only for fe in (False, True)}
    if args.write:
        torch.save({f"{n}/{fe}": v for (n, fe), v in got.items()}, args.out)
        print(f"wrote {args.out}")
        return 0
    ref = torch.load(args.out, weights_only=True)
    bad = 0
    for (name, fe), ps in got.items():
        want = ref[f"{name}/False"]
        diff = max(float((a - b).abs().max()) for a, b in zip(ps, want, strict=True))
        same = all(torch.equal(a, b) for a, b in zip(ps, ref[f"{name}/{fe}"], strict=True))
        ok = diff <= tolerance(name) and not math.isnan(diff)
        bad += not ok
        print(f"{name:24s} foreach={fe!s:5s} max|Δ| vs per-tensor reference {diff:.2e} "
              f"{'ok' if ok else 'DIFFERS'}{' (bitwise as recorded)' if same else ''}")  # fmt: skip
    return 1 if bad else 0


if __name__ == "__main__":
    raise SystemExit(main())
