"""Optimizer-state bytes of a model without training it, peers included: the benchmarks' calculator.

The benchmarks' Llama-7B tables (``python -m benchmarks.run --tasks
state_7b,memory_7b,low_memory``) count through here, on a model built on the meta device
(nothing allocated); ``python -m recipes.memory`` (per-GPU estimate of the recipe's own
optimizers) uses the same rules of :mod:`galore2.plan.state` for torch AdamW and
bitsandbytes AdamW8bit and the same ``init_state()`` measurement for galore2.

* galore2 optimizers are measured: built, ``init_state()`` (every state tensor at its
  final shape, meta works), then ``state_bytes()`` (:func:`galore2_state`) or each state
  tensor with the layout galore2.fsdp shards it by (:func:`measured`, from
  :mod:`galore2.plan.state`).
* Everything else is counted from its package's storage rules (:func:`counted`), each
  checked against the package's real state after a step on a small model
  (``tests/benchmarks/test_bench_suite.py``, ``tests/recipes/test_memory_estimate.py``: exact equality).

Rules, per parameter of n elements (m × n₂ for a matrix; ``big``/``small`` = the larger /
smaller side; r = rank; fp32 weights for the peers):

* torch AdamW and bitsandbytes AdamW8bit (0.50.2): the rules of
  :mod:`galore2.plan.state` (the memory planner's, used here as they are).
* galore-torch GaLoreAdamW, pytorch-optimizer GaLore, apollo-torch APOLLO, fira
  FiraAdamW: a projected matrix keeps fp32 moments at the projected shape (big × r) and
  an fp32 basis (r × small); APOLLO and Fira also a 0-d fp32 norm of their last scaled
  gradient (APOLLO's ``scaled_grad``, Fira's ``scaling_grad``; APOLLO-Mini: r = 1).
  Other parameters: two fp32 moments (Fira's step counter is a Python int).
* galore-torch 1.0 and fira 1.0.2 keep their basis as a *view* of the full SVD factor
  (``U[:, :r]`` or ``Vh[:r]``, copied only when the weights are not fp32), so with fp32
  weights each projected matrix holds small × small fp32 elements of basis, not r × small.
* galore-torch GaLoreAdafactor (no first moment): factored second moment of the
  projected gradient (big + r), the basis as above, and a 0-d fp32 RMS per parameter;
  unprojected matrices m + n₂; vectors n.
* pytorch-optimizer Ranger21: five fp32 tensors per element (gradient EMA, negative-
  momentum EMA, variance EMA, its running max, the lookahead copy).
"""

from __future__ import annotations

import warnings
from collections.abc import Iterable

import torch
from torch import nn

from galore2.groups import select
from galore2.plan import state as plan_state
from galore2.plan.state import BNB_BLOCK, BNB_MIN_8BIT, Piece, measured, nbytes
from recipes.config import OptimConfig
from recipes.optimizers import NAMES, build_optimizer, projects, setting

from .peers import PEERS

__all__ = ["BNB_BLOCK", "BNB_MIN_8BIT", "RULES", "Piece", "breakdown", "counted", "galore2_state",
           "measured", "nbytes", "optimizer_state", "projected_params"]  # fmt: skip

RANGER21_TENSORS = 5
RULES = (*plan_state.RULES, "gt_galore_adamw", "gt_galore_adafactor", "at_apollo",
         "at_apollo_mini", "fira_adamw", "pto_galore", "pto_ranger21")  # fmt: skip
GALORE2 = tuple(n for n in NAMES if n not in plan_state.RULES)
#: peers whose basis is a view of the whole SVD factor (small × small with fp32 weights)
_FULL_FACTOR = ("gt_galore_adamw", "gt_galore_adafactor", "fira_adamw")
#: peers that keep a 0-d norm of the last scaled gradient per projected matrix
_LAST_NORM = ("at_apollo", "at_apollo_mini", "fira_adamw")


def breakdown(pieces: list[Piece]) -> dict[str, int]:
    """``state_bytes()``-style columns of counted pieces."""
    out = {k: nbytes(p for p in pieces if p.kind == k) for k in ("moments", "basis", "other")}
    return {**out, "total": sum(out.values())}


def _projected(name: str, p: nn.Parameter, rank: int) -> list[Piece]:
    m, n = p.shape[0], p.numel() // p.shape[0]
    big, small = max(m, n), min(m, n)
    r = min(1 if name == "at_apollo_mini" else rank, small)
    basis = [Piece((small if name in _FULL_FACTOR else r, small), 4, kind="basis")]
    if name == "gt_galore_adafactor":
        return [Piece((big,), 4), Piece((r,), 4), Piece((), 4, kind="other"), *basis]
    norm = [Piece((), 4, kind="other")] if name in _LAST_NORM else []
    return [Piece((big, r), 4)] * 2 + basis + norm


def counted(
    name: str, model: nn.Module, projected: Iterable[nn.Parameter] = (), rank: int = 0
) -> list[Piece]:
    """The state optimizer ``name`` (one of :data:`RULES`) holds for ``model``, by its
    package's rules; ``projected``: the parameters of its projected group, at ``rank``."""
    if name not in RULES:
        raise ValueError(f"no storage rule for {name!r}; rules: {', '.join(RULES)}")
    if name in plan_state.RULES:  # torch AdamW, bitsandbytes AdamW8bit: galore2.plan's rules
        return plan_state.counted(name, model)
    ids = {id(p) for p in projected}
    out: list[Piece] = []
    for p in (p for p in model.parameters() if p.requires_grad):
        shape = tuple(p.shape)
        if name == "pto_ranger21":
            out += [Piece(shape, 4)] * RANGER21_TENSORS
        elif id(p) in ids:
            out += _projected(name, p, rank)
        elif name == "gt_galore_adafactor":
            out += [Piece((d,), 4) for d in shape] if p.dim() == 2 else [Piece(shape, 4)]
            out.append(Piece((), 4, kind="other"))
        else:
            out += [Piece(shape, 4)] * 2
    return out


def galore2_state(opt: torch.optim.Optimizer) -> dict[str, int]:
    """``state_bytes()`` of a galore2 optimizer after ``init_state()`` (moments / basis /
    other / total)."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # e.g. rank >= min dim of a small weight
        opt.init_state()
    return {k: int(v) for k, v in opt.state_bytes().items()}


def projected_params(model: nn.Module, cfg: OptimConfig) -> list[nn.Parameter]:
    """The parameters the recipe projects for optimizer ``cfg.name`` (none if it is full rank)."""
    if not projects(cfg.name, PEERS):
        return []
    return select(model, cfg.target_modules)[0]  # the split recipes.optimizers.param_groups makes


def optimizer_state(model: nn.Module, cfg: OptimConfig) -> dict[str, int] | None:
    """moments / basis / other / total bytes the recipe optimizer ``cfg`` holds for ``model``:
    measured for galore2, counted by rule for the others, ``None`` when there is neither
    (a CUDA-only peer with no verified rule)."""
    if cfg.name in GALORE2:
        return galore2_state(build_optimizer(model, cfg, 1, PEERS))
    if cfg.name in RULES:
        return breakdown(counted(cfg.name, model, projected_params(model, cfg), setting(cfg, "rank")))
    return None
