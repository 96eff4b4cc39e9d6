"""Optimizer-state bytes of a model without training it: the one calculator behind every figure.

``python -m recipes.memory`` (per-GPU estimate) and the benchmarks' Llama-7B tables
(``python -m benchmarks.run --tasks state_7b,memory_7b,low_memory,recipe_memory_7b``) all
count through here, on a model built on the meta device (nothing allocated).

* galore2 optimizers are measured: built, ``init_state()`` (every state tensor at its
  final shape, meta works), then ``state_bytes()`` (:func:`galore2_state`) or each state
  tensor with the layout galore2.fsdp shards it by (:func:`measured`).
* Everything else is counted from its package's storage rules (:func:`counted`), each
  checked against the package's real state after a step on a small model
  (``tests/benchmarks/test_bench_suite.py``, ``tests/recipes/test_memory_estimate.py``: exact equality).

Rules, per parameter of n elements (m × n₂ for a matrix; ``big``/``small`` = the larger /
smaller side; r = rank; fp32 weights for the peers):

* torch AdamW: two moments in the parameter dtype + an fp32 ``step`` tensor (CPU).
* bitsandbytes AdamW8bit (0.50.2): tensors under 4096 elements two fp32 moments;
  larger ones two uint8 moments + one fp32 absmax per 256 elements each; plus its two
  256-entry fp32 code maps, shared by all parameters.
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

import math
import warnings
from collections.abc import Iterable
from typing import NamedTuple

import torch
from torch import nn

from galore2.projectors import FULL, LEFT, NONE, RIGHT

from .config import OptimConfig
from .optimizers import NAMES, build_optimizer, param_groups, projects
from .peers import PEERS

BNB_BLOCK, BNB_MIN_8BIT = 256, 4096  # bitsandbytes 0.50.2 8-bit optimizers
RANGER21_TENSORS = 5
RULES = ("adamw", "adamw8bit", "gt_galore_adamw", "gt_galore_adafactor", "at_apollo",
         "at_apollo_mini", "fira_adamw", "pto_galore", "pto_ranger21")  # fmt: skip
GALORE2 = tuple(n for n in NAMES if n not in PEERS and n not in ("adamw", "adamw8bit"))
#: peers whose basis is a view of the whole SVD factor (small × small with fp32 weights)
_FULL_FACTOR = ("gt_galore_adamw", "gt_galore_adafactor", "fira_adamw")
#: peers that keep a 0-d norm of the last scaled gradient per projected matrix
_LAST_NORM = ("at_apollo", "at_apollo_mini", "fira_adamw")

_INNER = {NONE: "rows", RIGHT: "rows", LEFT: "cols", FULL: "replicate"}  # galore2.fsdp layouts
_BASES = {
    f"proj.{side}{suffix}": layout
    for side, layout in (("left", "rows"), ("right", "replicate"))
    for suffix in ("", ".q", ".scale")
}  # fp32/bf16 bases, or quantized codes + scales


class Piece(NamedTuple):
    """One state tensor: its shape, bytes per element, how FSDP shards it (``rows``,
    ``cols``, ``replicate``, or ``cpu``: never sharded) and which ``state_bytes()`` column
    it counts in (``moments``, ``basis``, ``other``)."""

    shape: tuple[int, ...]
    itemsize: int
    layout: str = "rows"
    kind: str = "moments"


def nbytes(pieces: Iterable[Piece], world: int = 1) -> int:
    """Bytes of ``pieces`` on one of ``world`` FSDP ranks (a sharded dim split like
    ``torch.chunk``: the largest shard counts)."""
    total = 0
    for p in pieces:
        dims = list(p.shape)
        i = {"rows": 0, "cols": min(1, len(dims) - 1)}.get(p.layout)
        if i is not None and dims and world > 1:
            dims[i] = -(-dims[i] // world)
        total += p.itemsize * math.prod(dims)
    return total


def breakdown(pieces: list[Piece]) -> dict[str, int]:
    """``state_bytes()``-style columns of counted pieces."""
    out = {k: nbytes(p for p in pieces if p.kind == k) for k in ("moments", "basis", "other")}
    return {**out, "total": sum(out.values())}


def _eight_bit(shape: tuple[int, ...]) -> list[Piece]:
    n = math.prod(shape)
    if n < BNB_MIN_8BIT:
        return [Piece(shape, 4)] * 2
    return [Piece(shape, 1)] * 2 + [Piece((-(-n // BNB_BLOCK),), 4)] * 2


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
    ids = {id(p) for p in projected}
    out: list[Piece] = []
    for p in (p for p in model.parameters() if p.requires_grad):
        shape = tuple(p.shape)
        if name == "adamw":
            out += [Piece(shape, p.element_size())] * 2 + [Piece((), 4, "cpu", "other")]
        elif name == "adamw8bit":
            out += _eight_bit(shape)
        elif name == "pto_ranger21":
            out += [Piece(shape, 4)] * RANGER21_TENSORS
        elif id(p) in ids:
            out += _projected(name, p, rank)
        elif name == "gt_galore_adafactor":
            out += [Piece((d,), 4) for d in shape] if p.dim() == 2 else [Piece(shape, 4)]
            out.append(Piece((), 4, kind="other"))
        else:
            out += [Piece(shape, 4)] * 2
    if name == "adamw8bit":  # the two shared quantization maps
        out += [Piece((256,), 4, "replicate", "other")] * 2
    return out


def measured(opt: torch.optim.Optimizer) -> list[Piece]:
    """Every state tensor of a galore2 optimizer (after ``init_state()``), laid out as
    galore2.fsdp shards it."""
    out: list[Piece] = []
    for state in opt.state.values():
        inner = _INNER[int(state["galore.side"])] if "galore.side" in state else "rows"
        for key, v in state.items():
            if isinstance(v, torch.Tensor):
                layout = _BASES.get(key, inner) if v.dim() else "cpu"
                out.append(Piece(tuple(v.shape), v.element_size(), layout))
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
    if not projects(cfg.name):
        return []
    return [p for g in param_groups(model, cfg, True) if "rank" in g for p in g["params"]]


def optimizer_state(model: nn.Module, cfg: OptimConfig) -> dict[str, int] | None:
    """moments / basis / other / total bytes the recipe optimizer ``cfg`` holds for ``model``:
    measured for galore2, counted by rule for the others, ``None`` when there is neither
    (a CUDA-only peer with no verified rule)."""
    if cfg.name in GALORE2:
        return galore2_state(build_optimizer(model, cfg, 1))
    if cfg.name in RULES:
        return breakdown(counted(cfg.name, model, projected_params(model, cfg), cfg.rank))
    return None
