"""Expected per-GPU peak memory of a recipe, per optimizer (meta device: nothing is allocated).

    python -m recipes.memory --config llama_7b [--batch-size 1] [--seq-len 2048] [--world-size 1]

Per GPU, in bytes; p = parameter bytes (dtype ``auto`` → bf16, as on a GPU), W = FSDP world
size, sharded tensors split along dim 0 like ``torch.chunk`` (the largest shard counts):

* weights = Σ numel·p / W; gradients the same, or with per-layer updates (``grad_accum`` 1)
  the largest parameter's gradient (W = 1) / the largest FSDP unit's flat sharded gradient.
* W > 1 adds FSDP2's unsharded copies: weights + (root unit [embeddings, final norm, head:
  the root is not resharded after forward] + one decoder layer)·p; gradients + the larger
  unit's unsharded gradient·p, + its fp32 reduce-scatter input when p < 4.
* optimizer state: measured (``init_state()`` on the meta device) or counted; the notes
  printed under the table give each row's convention.
* activations, t = batch·seq tokens, a = p, d = dim, f = ffn, k = kv dim, h = heads,
  V = vocab, L = layers (``layer`` equals the bytes autograd saves, checked on CPU by
  tests/recipes/test_memory_estimate.py)::

      norm  = (4 + 2a)·t·d + 4t        fp32 input copy, normalized x, norm output, rsqrt
      layer = 2·norm + a·t·(2d + 2k) + 4·h·t + 4a·t·f
              q, k, v after RoPE, attention output (o_proj input), fp32 log-sum-exp of
              flash / SDPA (no seq² matrix); MLP gate, silu(gate), up, silu·up
      bwd   = a·t·(2d + 3f)            gradient temporaries of one layer's backward
      loss  = t·V·(a + 3·4)            logits, saved fp32 log-softmax, its gradient in and out
      kept  = L·a·t·d with activation checkpointing (each layer's input), else L·layer
      activations = kept + norm + max(loss, a·t·V + bwd + (layer if checkpointing else 0))

  i.e. the peak is at the loss backward or in the last layer's (recomputed) backward.
"""

from __future__ import annotations

import argparse
import dataclasses
import warnings
from dataclasses import dataclass

import torch
from torch import nn

import galore2
from galore2.storage.dtype import normalize_state_dtype

from . import state
from .cli import DEBUG_HELP, run_cli
from .config import JobConfig, ModelConfig, parse_args
from .model import build_model, param_dtype
from .optimizers import NAMES, build_optimizer, galore_settings
from .peers import PEERS

# galore2's optimizers and the baselines it replaces; benchmark-only peers are left out
OPTIMIZERS: tuple[str, ...] = tuple(n for n in NAMES if n not in PEERS)
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


def _norm(cfg: ModelConfig, t: int, a: int) -> int:
    return (4 + 2 * a) * t * cfg.dim + 4 * t


def layer_bytes(cfg: ModelConfig, batch: int, seq: int, a: int) -> int:
    """Bytes one decoder layer saves for backward (``layer`` in the module docstring)."""
    t, d, h, f = batch * seq, cfg.dim, cfg.n_heads, cfg.ffn_dim
    k = d // h * (cfg.n_kv_heads or h)
    return 2 * _norm(cfg, t, a) + a * t * (2 * d + 2 * k) + 4 * h * t + 4 * a * t * f


def activation_bytes(cfg: ModelConfig, batch: int, seq: int, a: int) -> int:
    """Peak activation bytes of one forward + backward (formula in the module docstring)."""
    t, layer, ac = batch * seq, layer_bytes(cfg, batch, seq, a), cfg.activation_checkpointing
    kept = cfg.n_layers * (a * t * cfg.dim if ac else layer) + _norm(cfg, t, a)
    bwd = a * t * (2 * cfg.dim + 3 * cfg.ffn_dim)
    loss = t * cfg.vocab_size * (a + 12)
    return kept + max(loss, a * t * cfg.vocab_size + bwd + (layer if ac else 0))


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
    dtype = param_dtype(job.model, torch.device("cuda"))  # the recipe's dtype on a GPU
    model = build_model(job.model, "meta").to(dtype)
    pb, W = dtype.itemsize, world_size
    normalize_state_dtype(state_dtype)  # a clear error for an unknown dtype
    in_layers = {id(p) for layer in model.model.layers for p in layer.parameters()}
    params = [state.Piece(tuple(p.shape), pb) for p in model.parameters()]
    root = [state.Piece(tuple(p.shape), pb) for p in model.parameters() if id(p) not in in_layers]
    layer = [state.Piece(tuple(p.shape), pb) for p in model.model.layers[0].parameters()]
    weights = grads = state.nbytes(params, W)
    if per_layer and job.train.grad_accum == 1:
        grads = max(state.nbytes([x], 1) for x in params)
        grads = grads if W == 1 else max(state.nbytes(root, W), state.nbytes(layer, W))
    if W > 1:  # FSDP2's unsharded (all-gathered) parameters and gradients
        unit = max(state.nbytes(root, 1), state.nbytes(layer, 1))
        weights += state.nbytes(root, 1) + state.nbytes(layer, 1)
        grads += unit + (unit * 4 // pb if pb < 4 else 0)
    acts = activation_bytes(job.model, batch_size, seq_len, pb)
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
        f"; GaLore r={o.rank} on {', '.join(o.target_modules or HF_TARGETS)} (T="
        f"{o.update_proj_gap}, α={o.scale}), galore2 moments {sd}. GB = 1e9 bytes (GiB = 2^30)."
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
        "Total = sum of columns. Not included: CUDA context / allocator fragmentation; step "
        f"temporaries (foreach AdamW's sqrt(v): +{n * dtype.itemsize / world / 1e9:.2f} GB "
        "after activations are freed; galore2: low-rank temporaries, an fp32 gradient at refresh).",
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
