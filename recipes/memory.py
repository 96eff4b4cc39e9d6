"""Expected per-GPU peak memory of a recipe, per optimizer (meta device: nothing is allocated).

    python -m recipes.memory --config llama_7b [--batch-size 1] [--seq-len 2048] [--world-size 1]

Per GPU, in bytes. Weights, gradients (ordinary step or per-layer updates, FSDP2's
unsharded copies at world size > 1) and activations (with the config's activation
checkpointing) are those of the memory planner, whose formulas live in one place:
:mod:`galore2.plan.formulas` (``python -m recipes.plan llama_7b`` gives the same figures
for AdamW, 8-bit AdamW and galore2's main optimizers, and their fit on a GPU). This
module adds the recipe's view: every recipe optimizer, its state measured
(``init_state()`` on the meta device) or counted (torch AdamW and bitsandbytes
AdamW8bit, by :mod:`galore2.plan.state`'s rules); the notes
printed under the table give each row's convention.
"""

from __future__ import annotations

import argparse
import dataclasses
import warnings
from dataclasses import dataclass

import torch
from torch import nn

import galore2
from galore2.plan import Footprint, Shapes, state
from galore2.plan import formulas as plan
from galore2.storage.dtype import normalize_state_dtype

from .cli import DEBUG_HELP, run_cli
from .config import JobConfig, ModelConfig
from .model import build_model, llama_config, param_dtype
from .optimizers import NAMES, build_optimizer, galore_settings, setting
from .resolve import parse_args

# galore2's optimizers and the baselines it replaces (the recipe's names)
OPTIMIZERS: tuple[str, ...] = NAMES
HF_TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
MEASURED = "measured (init_state on meta)"
COUNTED = {"adamw": "exact count (torch AdamW rules)",
           "adamw8bit": "exact count (bitsandbytes 0.50.2 rules)"}  # fmt: skip


@dataclass
class Row:
    optimizer: str
    source: str  # how the optimizer state was obtained
    weights: int  # bytes per GPU
    grads: int
    state: int
    activations: int

    @property
    def total(self) -> int:
        return self.weights + self.grads + self.state + self.activations


def shapes(cfg: ModelConfig) -> Shapes:
    """The planner's :class:`~galore2.plan.Shapes` of the recipe's Llama."""
    return Shapes.from_config(llama_config(cfg))


def layer_bytes(cfg: ModelConfig, batch: int, seq: int, a: int) -> int:
    """Bytes one decoder layer saves for backward (:func:`galore2.plan.layer_bytes`)."""
    return plan.layer_bytes(shapes(cfg), batch, seq, a)


def activation_bytes(cfg: ModelConfig, batch: int, seq: int, a: int) -> int:
    """Peak activation bytes of one forward + backward with the config's activation
    checkpointing (:func:`galore2.plan.activation_bytes`)."""
    return plan.activation_bytes(shapes(cfg), batch, seq, a, cfg.activation_checkpointing)


def galore_optimizer(model: nn.Module, job: JobConfig, state_dtype: str = "float32"):
    """The recipe's GaLoreAdamW over ``model`` with all state created (meta works)."""
    o = job.optim
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # e.g. rank >= min dim of a small weight
        groups = galore2.param_groups(
            model, o.target_modules or HF_TARGETS, **galore_settings(o)
        )  # fmt: skip
        opt = galore2.GaLoreAdamW(groups, state_dtype=state_dtype)
        opt.init_state()
    return opt


def _state(name: str, model: nn.Module, opt, job: JobConfig) -> tuple[list[state.Piece], str]:
    """(pieces, source) of optimizer ``name``'s state; ``opt`` is the measured GaLoreAdamW."""
    if name in COUNTED:
        return state.counted(name, model), COUNTED[name]
    if name != "galore_adamw":
        opt = build_optimizer(model, dataclasses.replace(job.optim, name=name), 1000)
        opt.init_state()
    return state.measured(opt), MEASURED


def estimate(
    job: JobConfig,
    batch_size: int,
    seq_len: int,
    world_size: int = 1,
    per_layer: bool = False,
    optimizers: tuple[str, ...] | list[str] = OPTIMIZERS,
    state_dtype: str = "float32",
) -> list[Row]:
    """One Row per optimizer: bytes per GPU of weights, gradients, state and activations."""
    unknown = sorted(set(optimizers) - set(OPTIMIZERS))
    if unknown:
        raise ValueError(f"unknown optimizers {unknown}; known: {', '.join(OPTIMIZERS)}")
    normalize_state_dtype(state_dtype)  # a clear error for an unknown dtype
    dtype = param_dtype(job.model, torch.device("cuda"))  # the recipe's dtype on a GPU
    model = build_model(job.model, "meta").to(dtype)
    W = world_size
    fp = Footprint.of(model, shapes(job.model))
    weights = fp.weights(W)
    grads = fp.gradients(W, per_layer, job.train.grad_accum)
    acts = fp.activations(batch_size, seq_len, job.model.activation_checkpointing)
    opt = (
        galore_optimizer(model, job, state_dtype)
        if set(optimizers) - {"adamw", "adamw8bit"}
        else None
    )
    rows = []
    for name in optimizers:
        pieces, source = _state(name, model, opt, job)
        rows.append(Row(name, source, weights, grads, state.nbytes(pieces, W), acts))
    return rows


def table(rows: list[Row]) -> str:
    """Markdown; every size as ``GB (GiB)``."""
    head = ["optimizer", "state from", "weights", "gradients", "optimizer state"]
    lines = ["| " + " | ".join([*head, "activations (est.)", "total"]) + " |", "|---" * 7 + "|"]
    for r in rows:
        sizes = [r.weights, r.grads, r.state, r.activations, r.total]
        cells = [r.optimizer, r.source, *(f"{n / 1e9:.2f} ({n / 2**30:.2f})" for n in sizes)]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def report(job: JobConfig, batch: int, seq: int, world: int, names, label: str, sd: str) -> str:
    m, o = job.model, job.optim
    dtype = param_dtype(m, torch.device("cuda"))
    n = sum(p.numel() for p in build_model(m, "meta").parameters())
    out = [
        f"Per-GPU memory, `{label}` ({n / 1e9:.2f}B parameters, "
        f"{str(dtype).removeprefix('torch.')}): batch {batch} × seq {seq} per GPU, FSDP world "
        f"size {world}, activation checkpointing {'on' if m.activation_checkpointing else 'off'}"
        f"; GaLore r={setting(o, 'rank')} on {', '.join(o.target_modules or HF_TARGETS)} (T="
        f"{setting(o, 'update_proj_gap')}, α={setting(o, 'scale')}), galore2 moments {sd}. "
        "GB = 1e9 bytes (GiB = 2^30)."
    ]
    for per_layer in (False, True):
        title = "Per-layer updates (one gradient alive)" if per_layer else "Ordinary step"
        rows = estimate(job, batch, seq, world, per_layer, names, sd)
        out += ["", f"**{title}**", "", table(rows)]
    notes = [
        f"adamw = torch.optim.AdamW: moments in the parameter dtype ({2 * dtype.itemsize} B/param"
        "; 8 for fp32) + a 4-byte CPU step per tensor. adamw8bit (bitsandbytes 0.50.2): uint8 "
        f"moments + fp32 absmax per {state.BNB_BLOCK} elements; fp32 below "
        f"{state.BNB_MIN_8BIT} elements.",
        "galore2 rows: every state tensor of the optimizer built from this config (init_state "
        "on the meta device): moments in state_dtype (galore_adamw8bit: uint8 + fp32 absmax per "
        "256; galore_adafactor: row + column vectors), bases in optim.basis_dtype (fp32 unless "
        "--optim.basis_dtype bf16/int8/int4), KBs of CPU counters; (galore_)ranger21 add a "
        "negative momentum and full-size Lookahead weights (param dtype).",
        "Per-layer updates need a galore2 optimizer (step_param): adamw / adamw8bit rows are "
        "hypothetical there; with train.grad_accum > 1 every gradient stays alive.",
        "Total = sum of columns. Not included: CUDA context / allocator fragmentation; the "
        f"step's own memory (foreach AdamW's sqrt(v): +{n * dtype.itemsize / world / 1e9:.2f} GB "
        "after activations are freed; fused AdamW: none; galore2's temporaries), which "
        "python -m recipes.plan measures (its step columns).",
    ]
    if world > 1:
        notes.append("FSDP2: galore2's right bases (Q) are replicated; backward prefetch of the "
                     "next layer (one more layer of parameters) is not counted.")  # fmt: skip
    return "\n".join([*out, "", "Notes:", "", *(f"- {x}" for x in notes)])


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(
        prog="python -m recipes.memory",
        description="Expected per-GPU memory of a recipe config, per optimizer; "
        "other --section.field VALUE arguments override the config.",
        epilog=DEBUG_HELP,
    )
    ap.add_argument("--config", default="llama_7b", help="recipe config path or name")
    ap.add_argument("--batch-size", type=int, help="sequences per GPU (default: the config's)")
    ap.add_argument("--seq-len", type=int, help="tokens per sequence (default: the config's)")
    ap.add_argument("--world-size", type=int, default=1, help="FSDP world size")
    ap.add_argument("--optimizers", default=",".join(OPTIMIZERS))
    ap.add_argument("--state-dtype", default="float32", help="galore2 moment dtype")
    args, rest = ap.parse_known_args(argv)
    job = parse_args(["--config", args.config, *rest])
    batch, seq = args.batch_size or job.train.batch_size, args.seq_len or job.data.seq_len
    names = [x.strip() for x in args.optimizers.split(",") if x.strip()]
    print(report(job, batch, seq, args.world_size, names, args.config, args.state_dtype))


if __name__ == "__main__":
    run_cli(main)
