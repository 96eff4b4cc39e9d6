"""Per-GPU weights, gradients and activations of a decoder-only transformer, by formula.

The one place these formulas live: ``python -m galore2.plan`` and the recipe's
``python -m recipes.memory`` both call them. Optimizer state is not here: it is measured
(:mod:`galore2.plan.state`).

Per GPU, in bytes; p = bytes per parameter (the model's dtype: 2 for bf16), W = FSDP world
size, every sharded tensor split along dim 0 like ``torch.chunk`` (the largest shard
counts). The FSDP2 units are each decoder layer and the root (everything else:
embeddings, final norm, output head; :func:`decoder_layers` finds the layers).

* **weights** = Σ numel·p / W; an int8 weight (``galore2.quantize_weights``) counts its
  stored codes and scales instead, plus, once, what dequantizing the largest one in a
  forward or backward allocates: the dense weight (numel·p) and one block of rows' fp32
  decode temporaries, counted on the meta device (:func:`dequantized_bytes`). The step's
  fp32 working copy and re-quantization (one weight at a time) are the step's own memory,
  which ``python -m galore2.plan`` measures with the step. W > 1
  adds FSDP2's unsharded (all-gathered) copies of the root unit (not resharded after
  forward) and of one decoder layer: + (root + layer)·p.
* **gradients** = Σ numel·p / W, or with per-layer updates (and no gradient accumulation)
  the largest parameter's gradient (W = 1) / the largest unit's flat sharded gradient
  (W > 1). W > 1 adds the larger unit's unsharded gradient·p and, when p < 4, its fp32
  reduce-scatter input (·4).
* **activations**, t = batch·seq tokens, a = p, d = hidden size, q = heads·head_dim,
  k = kv heads·head_dim, h = heads, f = MLP size, V = vocabulary, L = layers::

      norm  = (4 + 2a)·t·d + 4t        fp32 input copy, normalized x, norm output, rsqrt
      layer = 2·norm + a·t·(2q + 2k) + 4·h·t + 4a·t·f
              q, k, v after RoPE, attention output (o_proj input), fp32 log-sum-exp of
              flash / SDPA (no seq² matrix); MLP gate, silu(gate), up, silu·up
      bwd   = a·t·(2d + 3f)            gradient temporaries of one layer's backward
      loss  = t·V·(a + 3·4)            logits, saved fp32 log-softmax, its gradient in and out
      kept  = L·a·t·d with activation checkpointing (each layer's input), else L·layer
      activations = kept + norm + max(loss, a·t·V + bwd + (layer if checkpointing else 0))

  i.e. the peak is at the loss backward or in the last layer's (recomputed) backward.
  ``layer`` equals the bytes autograd saves for a Llama decoder layer (RMSNorm, RoPE,
  SDPA attention, gated SiLU MLP; checked on CPU by
  ``tests/recipes/test_memory_estimate.py``). Other architectures (LayerNorm, a GELU MLP
  without gate, biases, eager attention with its seq² matrix) save somewhat different
  tensors; for them the same formula is an estimate.

Not counted: the CUDA context and allocator fragmentation, FSDP2's prefetch of the next
layer's parameters. The optimizer step's own memory is measured (:mod:`galore2.plan.step`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from ..core.stored import store_of
from ..storage.weights import dequantize
from .state import Piece, nbytes
from .step import LiveBytes, storage_bytes

__all__ = ["Footprint", "Shapes", "activation_bytes", "decoder_layers", "layer_bytes"]


def _field(config: Any, *names: str) -> Any:
    return _named(config, *names)[1]


#: each size a model config must give, by the names configs use for it (the first is
#: Hugging Face's own); GPT-2's ``n_inner`` may be null (4 × hidden size)
SIZE_NAMES: dict[str, tuple[str, ...]] = {
    "vocab_size": ("vocab_size",),
    "dim": ("hidden_size", "n_embd", "d_model"),
    "n_layers": ("num_hidden_layers", "n_layer", "num_layers"),
    "n_heads": ("num_attention_heads", "n_head", "num_heads"),
    "ffn_dim": ("intermediate_size", "n_inner", "ffn_dim"),
}
#: sizes a config may leave out (the model's own rule: as many kv heads as heads...)
OPTIONAL_SIZE_NAMES: dict[str, tuple[str, ...]] = {
    "n_kv_heads": ("num_key_value_heads",),
    "head_dim": ("head_dim",),
}


def missing_sizes(data: dict[str, Any]) -> list[str]:
    """The sizes a config's JSON ``data`` leaves out (its ``text_config`` for a multimodal
    one), each as its names joined by '/': transformers would fill them with its class's
    defaults (a Llama config without sizes is Llama-7B)."""
    text = data.get("text_config")
    keys = set(data) | (set(text) if isinstance(text, dict) else set())
    return ["/".join(names) for names in SIZE_NAMES.values() if not keys & set(names)]


def _named(config: Any, *names: str) -> tuple[str, Any]:
    """The first of ``names`` that ``config`` sets, and its value (``names[0]``, None)."""
    for name in names:
        value = getattr(config, name, None)
        if value is not None:
            return name, value
    return names[0], None


@dataclass(frozen=True)
class Shapes:
    """The sizes of a decoder-only transformer that the activation formula reads.

    Args:
        vocab_size: V. dim: hidden size d. n_layers: L. n_heads: h.
        n_kv_heads: key/value heads (grouped-query attention; = n_heads without).
        ffn_dim: the MLP's intermediate size f. head_dim: per-head size (default d / h).
    """

    vocab_size: int
    dim: int
    n_layers: int
    n_heads: int
    ffn_dim: int
    n_kv_heads: int | None = None
    head_dim: int | None = None

    def __post_init__(self) -> None:
        for name in ("vocab_size", "dim", "n_layers", "n_heads", "ffn_dim"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"Shapes.{name} must be an int >= 1, got {value!r}")
        if self.head_dim is None and self.dim % self.n_heads:
            raise ValueError(
                f"Shapes: dim ({self.dim}) must be divisible by n_heads ({self.n_heads}) "
                "unless head_dim is given"
            )

    @property
    def q_dim(self) -> int:
        """heads × head_dim (= dim for most models)."""
        return self.n_heads * (self.head_dim or self.dim // self.n_heads)

    @property
    def kv_dim(self) -> int:
        """kv heads × head_dim."""
        return (self.n_kv_heads or self.n_heads) * (self.head_dim or self.dim // self.n_heads)

    @classmethod
    def from_config(cls, config: Any) -> Shapes:
        """The shapes of a Hugging Face ``PretrainedConfig`` (its text config for a
        multimodal one); ``n_inner=None`` (GPT-2) means 4 × hidden size."""
        if callable(getattr(config, "get_text_config", None)):
            config = config.get_text_config()
        named = {
            k: _named(config, *names) for k, names in {**SIZE_NAMES, **OPTIONAL_SIZE_NAMES}.items()
        }
        fields = {k: v for k, (_, v) in named.items()}
        dim = fields["dim"]
        for name, value in named.values():  # a config's own name for a bad value
            bad = not isinstance(value, int) or isinstance(value, bool) or value < 1
            if value is not None and bad:
                raise ValueError(
                    f"the model config ({type(config).__name__}) has {name}={value!r}; it "
                    "must be an int >= 1"
                )
        if fields["ffn_dim"] is None and hasattr(config, "n_inner") and isinstance(dim, int):
            fields["ffn_dim"] = 4 * dim
        missing = [k for k in ("vocab_size", "dim", "n_layers", "n_heads", "ffn_dim")
                   if fields[k] is None]  # fmt: skip
        if missing:
            raise ValueError(
                f"the model config ({type(config).__name__}) has no {', '.join(missing)} "
                "(looked for hidden_size, num_hidden_layers, num_attention_heads, "
                "intermediate_size, vocab_size and their common aliases)"
            )
        return cls(**fields)


def _norm(s: Shapes, t: int, a: int) -> int:
    return (4 + 2 * a) * t * s.dim + 4 * t


def layer_bytes(shapes: Shapes, batch: int, seq: int, a: int) -> int:
    """Bytes one decoder layer saves for backward (``layer`` in the module docstring).

    Args:
        shapes: the model's sizes. batch, seq: sequences per GPU and tokens per sequence.
        a: bytes per activation element (the parameter dtype's).
    """
    t = batch * seq
    attn = a * t * (2 * shapes.q_dim + 2 * shapes.kv_dim) + 4 * shapes.n_heads * t
    return 2 * _norm(shapes, t, a) + attn + 4 * a * t * shapes.ffn_dim


def activation_bytes(shapes: Shapes, batch: int, seq: int, a: int, checkpointing: bool) -> int:
    """Peak activation bytes of one forward + backward (formula in the module docstring);
    ``checkpointing``: activation checkpointing of every decoder layer."""
    t, layer = batch * seq, layer_bytes(shapes, batch, seq, a)
    kept = shapes.n_layers * (a * t * shapes.dim if checkpointing else layer) + _norm(shapes, t, a)
    bwd = a * t * (2 * shapes.dim + 3 * shapes.ffn_dim)
    loss = t * shapes.vocab_size * (a + 12)
    return kept + max(loss, a * t * shapes.vocab_size + bwd + (layer if checkpointing else 0))


def decoder_layers(model: nn.Module, n_layers: int | None = None) -> nn.ModuleList:
    """The model's repeated decoder layers (each an FSDP2 unit): the ``nn.ModuleList``
    holding the most parameters (of ``n_layers`` modules, when given)."""
    lists = [m for m in model.modules() if isinstance(m, nn.ModuleList) and len(m)]
    if n_layers is not None:
        lists = [m for m in lists if len(m) == n_layers]
    if not lists:
        raise ValueError(
            f"{type(model).__name__} has no nn.ModuleList of "
            f"{n_layers if n_layers is not None else 'any number of'} decoder layers"
        )
    return max(lists, key=lambda m: sum(p.numel() for p in m.parameters()))


def dequantized_bytes(store: Any, dtype: torch.dtype) -> int:
    """The bytes dequantizing the int8 weight ``store`` (an
    :class:`~galore2.storage.weights.Int8WeightStore`) into ``dtype`` allocates at its
    peak, as each forward and backward does: the dense weight and the fp32 temporaries of
    one block of rows (:func:`galore2.storage.weights.dequantize`, with an accelerator's
    blocks), counted by :class:`~galore2.plan.step.LiveBytes` on the meta device."""
    meta = torch.device("meta")
    codes, scales = (torch.empty(t.shape, dtype=t.dtype, device=meta) for t in store.tensors())
    live = LiveBytes(meta)
    live.track([codes, scales])  # held already (their views are not new)
    with live:
        dequantize(codes, scales, store.module.layout, dtype)
    return live.peak - storage_bytes([codes, scales], meta)


def _largest(params: list, stores: list) -> list[tuple[Any, Any]]:
    """(parameter, store) of the int8 weight with the most elements (none: empty)."""
    found = [(p, s) for p, s in zip(params, stores, strict=True) if s is not None]
    return [max(found, key=lambda ps: ps[0].numel())] if found else []


@dataclass(frozen=True)
class Footprint:
    """A model's parameters as FSDP2 units, and its shapes: what the weight, gradient and
    activation formulas read. Build it with :meth:`of` (a meta-device model is fine)."""

    shapes: Shapes
    itemsize: int  # p: bytes per parameter (and per activation element)
    params: tuple[Piece, ...]  # every parameter
    root: tuple[Piece, ...]  # the root unit: every parameter outside the decoder layers
    layer: tuple[Piece, ...]  # one decoder layer (the first)
    #: the weights as stored where that differs from ``params`` (int8 weights: codes and
    #: scales, galore2.storage.weights), and the bytes the largest such weight's
    #: dequantization allocates (forward, backward: :func:`dequantized_bytes`)
    stored: tuple[Piece, ...] | None = None
    dequantized: int = 0

    @classmethod
    def of(cls, model: nn.Module, shapes: Shapes | None = None) -> Footprint:
        """``model``'s footprint; ``shapes`` default to those of ``model.config``."""
        if shapes is None:
            if getattr(model, "config", None) is None:
                raise ValueError("Footprint.of: pass shapes= for a model without .config")
            shapes = Shapes.from_config(model.config)
        layers = decoder_layers(model, shapes.n_layers)
        in_layers = {id(p) for p in layers.parameters()}

        def pieces(params) -> tuple[Piece, ...]:
            return tuple(Piece(tuple(p.shape), p.element_size()) for p in params)

        params = list(model.parameters())
        stores = [store_of(p) for p in params]
        stored = tuple(
            piece
            for p, store in zip(params, stores, strict=True)
            for piece in (pieces(store.tensors()) if store is not None else pieces([p]))
        )
        return cls(
            shapes=shapes,
            itemsize=max(p.element_size() for p in params),
            params=pieces(params),
            root=pieces(p for p in params if id(p) not in in_layers),
            layer=pieces(layers[0].parameters()),
            stored=stored if any(stores) else None,
            dequantized=max((dequantized_bytes(s, p.dtype) for p, s in
                             _largest(params, stores)), default=0),  # fmt: skip
        )

    @property
    def n_params(self) -> int:
        """Number of parameter elements."""
        return sum(math.prod(p.shape) for p in self.params)

    def weights(self, world: int = 1) -> int:
        """Parameter bytes per GPU (module docstring: **weights**)."""
        out = nbytes(self.stored or self.params, world) + self.dequantized
        if world > 1:  # FSDP2's unsharded (all-gathered) root and current layer
            out += nbytes(self.root) + nbytes(self.layer)
        return out

    def gradients(self, world: int = 1, per_layer: bool = False, grad_accum: int = 1) -> int:
        """Gradient bytes per GPU (module docstring: **gradients**)."""
        out = nbytes(self.params, world)
        if per_layer and grad_accum == 1:
            out = max(nbytes([x]) for x in self.params)
            if world > 1:
                out = max(nbytes(self.root, world), nbytes(self.layer, world))
        if world > 1:  # the unit's unsharded gradient, and its fp32 reduce-scatter input
            unit = max(nbytes(self.root), nbytes(self.layer))
            p = self.itemsize
            out += unit + (unit * 4 // p if p < 4 else 0)
        return out

    def activations(self, batch: int, seq: int, checkpointing: bool) -> int:
        """Peak activation bytes per GPU (module docstring: **activations**)."""
        return activation_bytes(self.shapes, batch, seq, self.itemsize, checkpointing)
