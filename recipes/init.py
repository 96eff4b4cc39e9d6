"""Initial values for a model materialized from the meta device, one parameter at a time.

``LlamaForCausalLM(config)`` (transformers 5) initializes in three passes over the default
generator of the device it is built on:

1. the base model's constructors: ``nn.Embedding`` draws ``normal_(0, 1)``, every
   ``nn.Linear`` ``kaiming_uniform_(a=√5)``, in registration order;
2. the base model's ``post_init``: ``normal_(0, initializer_range)`` for every embedding and
   linear weight, ones for every RMSNorm weight, in the same order;
3. the head (``lm_head``): its constructor's draw, then its ``normal_`` (a head tied to
   the embedding draws both into a tensor the tie then discards).

``initialize`` replays exactly these draws, each on a full-shape fp32 scratch tensor on the
target device, and writes the draw that survives (the last one per parameter) into the
parameter cast to its dtype, or into the parameter's local shard under FSDP2. Every rank
draws the same full tensors, so the weights are those of a one-process fp32 build cast to
the training dtype, bit for bit, for every world size; the memory above the final weights
is one fp32 parameter (the largest: the embedding). tests/recipes/test_build.py compares
the replay with transformers' own build; if a transformers release changes its order, that
test says so (the weights stay deterministic per seed and of the same distribution).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import nn
from torch.distributed.tensor import DTensor, distribute_tensor

from galore2.core.stored import store_of

RMSNORM = "RMSNorm"


@dataclass(frozen=True)
class Draw:
    """One initializing write: ``kind`` ("embedding", "kaiming", "normal" or "ones") into the
    ``weight`` of ``module``; ``last``: the write that survives."""

    module: nn.Module
    kind: str
    last: bool


@dataclass(frozen=True)
class InitOrder:
    """The writes of ``LlamaForCausalLM(config)``'s initialization, in order."""

    draws: tuple[Draw, ...]

    @staticmethod
    def of(model: nn.Module) -> InitOrder:
        """Read from the bare (meta) model, before any wrapping renames its modules."""
        base = model.model
        head = [m for name, m in model.named_children() if name != "model"]
        ctor, post = [], []
        for _, m in _weighted(base):
            if isinstance(m, nn.Embedding):
                if m.padding_idx is not None:  # transformers zeroes that row: not replayed
                    raise ValueError("cannot initialize an embedding with a padding_idx")
                ctor.append((m, "embedding"))
                post.append((m, "normal"))
            elif isinstance(m, nn.Linear):
                ctor.append((m, "kaiming"))
                post.append((m, "normal"))
            else:
                post.append((m, "ones"))
        tail = []
        for h in head:
            for name, m in _weighted(h):
                if not isinstance(m, nn.Linear):
                    raise ValueError(f"cannot initialize head module {name} ({type(m).__name__})")
                tail += [(m, "kaiming"), (m, "normal")]
        # the last write to each weight survives, except that a head tied to the embedding
        # draws into its own tensor, which the tie then replaces by the embedding's
        base_weights = {id(m.weight) for m, _ in post}
        final: dict[int, int] = {}
        for i, (m, _) in enumerate(ctor + post + tail):
            if i < len(ctor) + len(post) or id(m.weight) not in base_weights:
                final[id(m.weight)] = i
        draws = tuple(
            Draw(m, kind, final[id(m.weight)] == i)
            for i, (m, kind) in enumerate(ctor + post + tail)
        )
        covered = {id(d.module.weight) for d in draws}
        missing = [n for n, p in model.named_parameters() if id(p) not in covered]
        if missing:
            raise ValueError(f"no initialization known for parameters {missing}")
        return InitOrder(draws)


def _weighted(root: nn.Module):
    """(name, module) for every module of ``root`` holding a ``weight``, in registration order;
    biases and other parameters are refused (Llama has none)."""
    out = []
    for name, m in root.named_modules():
        own = dict(m.named_parameters(recurse=False))
        if not own:
            continue
        if set(own) != {"weight"}:
            raise ValueError(f"cannot initialize {name}: parameters {sorted(own)} (only weight)")
        if not isinstance(m, (nn.Embedding, nn.Linear)) and RMSNORM not in type(m).__name__:
            raise ValueError(f"cannot initialize {name} ({type(m).__name__})")
        out.append((name, m))
    return out


def _draw(kind: str, shape: torch.Size, std: float, device: torch.device) -> torch.Tensor:
    t = torch.empty(shape, dtype=torch.float32, device=device)
    if kind == "embedding":
        t.normal_(0.0, 1.0)
    elif kind == "kaiming":
        nn.init.kaiming_uniform_(t, a=math.sqrt(5))
    elif kind == "normal":
        t.normal_(0.0, std)
    else:
        t.fill_(1.0)
    return t


def _write(param: torch.Tensor, full: torch.Tensor) -> None:
    """``full`` (the whole fp32 tensor, on every rank) into ``param`` or its local shard, cast
    to the parameter's dtype by ``copy_``."""
    store = store_of(param)
    if store is not None:  # int8 weights: the fp32 draw quantized (round to nearest)
        store.assign(full)
    elif isinstance(param, DTensor):
        part = distribute_tensor(full, param.device_mesh, param.placements, src_data_rank=None)
        param.to_local().copy_(part.to_local())
    else:
        param.copy_(full)


@torch.no_grad()
def initialize(model: nn.Module, order: InitOrder, config, device: torch.device) -> None:
    """Fill ``model`` (materialized by ``to_empty``) with the values of ``order``'s replay,
    and recompute its rotary buffers (``inv_freq``), which ``to_empty`` left undefined."""
    std = config.initializer_range
    for d in order.draws:
        weight = d.module.weight
        full = _draw(d.kind, weight.shape, std, device)
        if d.last:
            _write(weight, full)  # copy_ casts: no second full-size temporary
        del full
    for name, m in model.named_modules():
        buffers = dict(m.named_buffers(recurse=False))
        if not buffers or store_of(getattr(m, "weight", None)) is not None:
            continue  # int8 weights: their buffers are the weight, written above
        if not type(m).__name__.endswith("RotaryEmbedding"):
            raise ValueError(f"no initialization known for buffers {sorted(buffers)} of {name}")
        with torch.device("cpu"):  # a few numbers, computed as the constructor does
            fresh = type(m)(config)
        for key, buf in buffers.items():
            buf.copy_(getattr(fresh, key))
