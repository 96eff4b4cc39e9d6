"""``python -m galore2.plan CONFIG [options]``: the command line of the memory planner."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from ..quantize import quantize_weights
from .configs import Source, build_model, load
from .formulas import Footprint, Shapes
from .planner import OPTIMIZERS, plan, projected
from .plot import plot
from .report import Report
from .units import parse_size, size_unit

__all__ = ["main", "parser", "run"]

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
SWITCH = {"both": (False, True), "off": (False,), "on": (True,)}
#: the defaults of a Hugging Face config (a recipe config brings its own)
HF_BATCH, HF_SEQ, HF_DTYPE = 1, 2048, "bf16"


#: CONFIG of ``python -m galore2.plan`` (``recipes.plan`` passes its own description)
CONFIG_HELP = "a Hugging Face config.json, or the folder holding one"
#: what :func:`main` raises for bad input and :func:`run` prints as one line
ERRORS = (ValueError, TypeError, FileNotFoundError, ImportError)


def parser(prog: str = "python -m galore2.plan", config_help: str = CONFIG_HELP
           ) -> argparse.ArgumentParser:  # fmt: skip
    """The argument parser (every option declared here, once; ``recipes.plan`` reuses it
    with its own ``prog`` and CONFIG)."""
    ap = argparse.ArgumentParser(
        prog=prog,
        description="Will it fit? Per-GPU memory (weights, gradients, optimizer state, "
        "activations) of AdamW, 8-bit AdamW and galore2's optimizers for any causal LM, "
        "and which configurations fit a GPU. Nothing is allocated (meta device).",
        epilog="Formulas: the docstring of galore2.plan.formulas (docs/guides/memory-planner.md).",
    )
    ap.add_argument("config", metavar="CONFIG", help=config_help)
    ap.add_argument("--gpu-memory", default="24GB",
                    help="memory per GPU, with a unit: GB, GiB, MB, ... (default 24GB)")  # fmt: skip
    ap.add_argument("--world-size", nargs="+", default=["1"], metavar="N",
                    help="FSDP world size(s): '1,8' or '1 8' (default 1)")  # fmt: skip
    ap.add_argument("--batch-size", type=int,
                    help=f"sequences per GPU (default: the recipe's, else {HF_BATCH})")  # fmt: skip
    ap.add_argument("--seq-len", type=int,
                    help=f"tokens per sequence (default: the recipe's, else {HF_SEQ})")  # fmt: skip
    ap.add_argument("--rank", type=int,
                    help="GaLore rank (default: the recipe's, else hidden size / 4, as in "
                    "GaLore's pre-training runs)")  # fmt: skip
    ap.add_argument("--grad-accum", type=int,
                    help="micro-batches per step (default: the recipe's, else 1)")  # fmt: skip
    ap.add_argument("--dtype", choices=sorted(DTYPES),
                    help=f"parameter dtype (default: the recipe's on a GPU, else {HF_DTYPE})")  # fmt: skip
    ap.add_argument("--per-layer", choices=list(SWITCH), default="both",
                    help="per-layer updates (default both)")  # fmt: skip
    ap.add_argument("--checkpointing", choices=list(SWITCH), default="both",
                    help="activation checkpointing (default both)")  # fmt: skip
    ap.add_argument("--optimizers", default=",".join(OPTIMIZERS),
                    help=f"comma-separated subset of {','.join(OPTIMIZERS)}")  # fmt: skip
    ap.add_argument("--weight-bits", type=int, choices=[8],
                    help="8: every linear weight but the head's as int8 codes + scales "
                    "(galore2.quantize_weights; default: the recipe's model.weight_bits, "
                    "else the parameter dtype)")  # fmt: skip
    ap.add_argument("--json", action="store_true", help="print JSON (bytes) instead of tables")
    ap.add_argument("--plot", metavar="OUT.png", help="also write a bar chart to this PNG")
    return ap


def _world_sizes(values: list[str]) -> list[int]:
    items = [x.strip() for v in values for x in v.split(",") if x.strip()]
    if not items or not all(x.isdigit() and int(x) >= 1 for x in items):
        raise ValueError(
            f"--world-size must be integers >= 1 ('1,8' or '1 8'), got {' '.join(values)!r}"
        )
    return list(dict.fromkeys(int(x) for x in items))


def _positive(name: str, value: int | None) -> None:
    if value is not None and value < 1:
        raise ValueError(f"--{name} must be >= 1, got {value}")


@dataclass(frozen=True)
class _Args:
    """The command line, checked (before any model is built)."""

    ns: argparse.Namespace
    gpu_memory: int
    unit: str
    worlds: list[int]
    optimizers: list[str]


def _check(ns: argparse.Namespace) -> _Args:
    gpu = parse_size(ns.gpu_memory)
    unit = size_unit(ns.gpu_memory)  # sizes print in the unit the budget is written in
    worlds = _world_sizes(ns.world_size)
    for name in ("batch_size", "seq_len", "rank", "grad_accum"):
        _positive(name.replace("_", "-"), getattr(ns, name))
    names = [x.strip() for x in ns.optimizers.split(",") if x.strip()]
    unknown = [n for n in names if n not in OPTIMIZERS]
    if unknown or not names:
        raise ValueError(
            f"--optimizers: unknown {unknown or 'empty list'}; choose from {', '.join(OPTIMIZERS)}"
        )
    if ns.plot is not None:
        out = Path(ns.plot)
        if out.suffix.lower() != ".png":
            raise ValueError(f"--plot must name a .png file, got {ns.plot!r}")
        if not out.parent.is_dir():
            raise FileNotFoundError(
                f"--plot {ns.plot!r}: folder {str(out.parent)!r} does not exist"
            )
    return _Args(ns, gpu, unit, worlds, list(dict.fromkeys(names)))


def _targets(target_modules: Any) -> str:
    if target_modules in (None, "all-linear"):
        return "every linear layer but the output head"
    if isinstance(target_modules, str):
        return f"modules matching {target_modules!r}"
    return "modules whose name contains " + " or ".join(repr(t) for t in target_modules)


def build(args: _Args, source: Source) -> Report:
    """The report for checked arguments and a loaded CONFIG."""
    ns = args.ns
    dtype = DTYPES[ns.dtype] if ns.dtype else source.dtype or DTYPES[HF_DTYPE]
    shapes = Shapes.from_config(source.config)  # checked before anything is built
    model = build_model(source.config, dtype)
    bits = ns.weight_bits or source.weight_bits
    if bits is not None:  # the weights (and the optimizers' working copies) as stored
        quantize_weights(model, bits, source.weight_group_size)
    fp = Footprint.of(model, shapes)
    galore = dict(source.galore)
    recipe_rank = galore.pop("rank", None)
    rank = ns.rank or recipe_rank or max(1, fp.shapes.dim // 4)
    batch = ns.batch_size or source.batch_size or HF_BATCH
    seq = ns.seq_len or source.seq_len or HF_SEQ
    accum = ns.grad_accum or source.grad_accum or 1
    targets = source.target_modules or "all-linear"
    rows = plan(model, batch_size=batch, seq_len=seq, rank=rank, world_sizes=args.worlds,
                per_layer=SWITCH[ns.per_layer], checkpointing=SWITCH[ns.checkpointing],
                optimizers=args.optimizers, target_modules=targets, galore=galore,
                grad_accum=accum, footprint=fp)  # fmt: skip
    label = source.label + (f", int{bits} weights" if bits else "")
    return Report(rows, label=label, model=type(model).__name__, n_params=fp.n_params,
                  dtype=str(dtype).removeprefix("torch."), batch_size=batch, seq_len=seq,
                  grad_accum=accum, rank=rank, targets=_targets(targets),
                  gpu_memory=args.gpu_memory, unit=args.unit,
                  projected=projected(model, targets))  # fmt: skip


def main(
    argv: list[str] | None = None,
    *,
    loader: Callable[[str], Source] | None = None,
    prog: str = "python -m galore2.plan",
    config_help: str = CONFIG_HELP,
) -> Report:
    """Parse ``argv``, print the plan (tables or ``--json``), write ``--plot``; returns the
    :class:`~galore2.plan.report.Report`. Bad input raises ``ValueError`` /
    ``FileNotFoundError`` / ``ImportError`` naming the argument, before any model is built.

    ``loader`` turns CONFIG into a :class:`~galore2.plan.configs.Source` (default: a
    Hugging Face config, :func:`~galore2.plan.configs.load`); the recipe passes its own
    (``recipes.plan``) with its ``prog`` and ``config_help``."""
    args = _check(parser(prog, config_help).parse_args(argv))
    report = build(args, (loader or load)(args.ns.config))
    if args.ns.plot:
        plot(report, args.ns.plot)
    print(report.to_json() if args.ns.json else report.text())
    return report


def run(argv: list[str] | None = None, **kwargs: Any) -> None:
    """:func:`main` (``kwargs`` too) for the command line: an error prints one line and exits
    with status 2."""
    try:
        main(argv, **kwargs)
    except ERRORS as e:
        print("error: " + " ".join(str(e).split()), file=sys.stderr)
        sys.exit(2)
