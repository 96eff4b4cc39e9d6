"""The recipe's model: ``transformers.LlamaForCausalLM`` from a ModelConfig, optionally FSDP2-sharded.

No hub access: the model is built from a ``LlamaConfig`` on the meta device and
materialized in its training dtype where it trains (``build_model``; recipes/init.py
fills the values). Under ``torchrun`` every decoder layer is ``fully_shard``-ed, then the
root, before any memory exists; on GPU
parameters are stored and computed in bf16 (``model.dtype``) and gradients are
reduced in fp32 (``MixedPrecisionPolicy(reduce_dtype=float32)``).
Activation checkpointing wraps each decoder layer; ``torch.compile`` compiles each
layer (per-layer compile keeps FSDP2's hooks outside the compiled graphs).
"""

from __future__ import annotations

import torch
from torch import nn

from .config import ModelConfig


def llama_config(cfg: ModelConfig):
    from transformers import LlamaConfig

    if cfg.dim % cfg.n_heads:
        raise ValueError(
            f"model.dim ({cfg.dim}) must be divisible by model.n_heads ({cfg.n_heads})"
        )
    kv = cfg.n_kv_heads or cfg.n_heads
    if cfg.n_heads % kv:
        raise ValueError(
            f"model.n_heads ({cfg.n_heads}) must be divisible by model.n_kv_heads ({kv})"
        )
    return LlamaConfig(
        vocab_size=cfg.vocab_size,
        hidden_size=cfg.dim,
        intermediate_size=cfg.ffn_dim,
        num_hidden_layers=cfg.n_layers,
        num_attention_heads=cfg.n_heads,
        num_key_value_heads=kv,
        max_position_embeddings=cfg.max_seq_len,
        rope_theta=cfg.rope_theta,
        rms_norm_eps=cfg.norm_eps,
        tie_word_embeddings=cfg.tie_embeddings,
        initializer_range=cfg.init_std,
        use_cache=False,
        attn_implementation="sdpa",
    )


def param_dtype(cfg: ModelConfig, device: torch.device) -> torch.dtype:
    choices = {"fp32": torch.float32, "bf16": torch.bfloat16}
    if cfg.dtype == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    if cfg.dtype not in choices:
        raise ValueError(f"model.dtype must be one of auto, fp32, bf16; got {cfg.dtype!r}")
    return choices[cfg.dtype]


def build_model(
    cfg: ModelConfig,
    device: torch.device | str = "cpu",
    *,
    dtype: torch.dtype = torch.float32,
    world_size: int = 1,
) -> nn.Module:
    """A freshly initialized LlamaForCausalLM in ``dtype`` on ``device``, never held in fp32.

    Built on the meta device, given its structure there (``prepare``: activation
    checkpointing, compile, FSDP2 sharding per decoder layer when ``world_size > 1``), then
    materialized in ``dtype`` where it trains (``to_empty``) and initialized one parameter at
    a time (``recipes.init.initialize``): the values are those of
    ``LlamaForCausalLM(config)`` built under the same seed in fp32 and cast, bit for bit,
    for every world size. ``device="meta"``: the bare meta model (no init, no wrapping).
    ``cfg.weight_bits=8`` quantizes the linear weights on the meta device first
    (:func:`quantize`): codes and scales are materialized, never the dense weights.
    """
    from transformers import LlamaForCausalLM

    from .init import InitOrder, initialize

    if cfg.weight_bits is not None and world_size > 1:
        raise ValueError(
            "model.weight_bits: int8 weights are not supported under FSDP2 (world size "
            f"{world_size}); train on one GPU with --optim.per_layer true, or leave "
            "model.weight_bits unset"
        )
    config = llama_config(cfg)
    with torch.device("meta"):
        model = LlamaForCausalLM(config)
    device = torch.device(device)
    model = quantize(model, cfg)  # on meta, before wrapping renames the modules (the seeds)
    if device.type == "meta":
        return model.to(dtype)
    order = InitOrder.of(model)  # read before wrapping renames the modules
    model = prepare(model, cfg, dtype, world_size)
    model.to_empty(device=device)
    if config.tie_word_embeddings:  # to_empty gave the head a tensor of its own
        model.tie_weights()
    initialize(model, order, config, device)  # an int8 weight quantizes its fp32 draw
    return model


def quantize(model: nn.Module, cfg: ModelConfig) -> nn.Module:
    """``model.weight_bits``: the linear weights but the head's as int8 codes + scales
    (``galore2.quantize_weights``; embeddings, head and norms keep the training dtype)."""
    if cfg.weight_bits is not None:
        from galore2 import quantize_weights

        try:
            quantize_weights(model, cfg.weight_bits, cfg.weight_group_size)
        except ValueError as e:
            raise ValueError(f"model.weight_bits / model.weight_group_size: {e}") from None
    return model


def n_params(model: nn.Module, *, exclude_embeddings: bool = False) -> int:
    total = sum(p.numel() for p in model.parameters())
    if exclude_embeddings:
        total -= model.get_input_embeddings().weight.numel()
    return total


def flops_per_token(cfg: ModelConfig, n_non_embedding: int, seq_len: int) -> float:
    """Training FLOPs per token: 6·N plus attention's 12·layers·dim·seq (PaLM appendix B)."""
    return 6.0 * n_non_embedding + 12.0 * cfg.n_layers * cfg.dim * seq_len


def prepare(model: nn.Module, cfg: ModelConfig, dtype: torch.dtype, world_size: int) -> nn.Module:
    """Activation checkpointing, compile, cast to ``dtype`` and FSDP2 sharding (world_size > 1),
    in that order; ``build_model`` applies it on the meta device, before any memory exists."""
    layers = model.model.layers
    if cfg.activation_checkpointing:
        from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper

        for i, layer in enumerate(layers):
            layers[i] = checkpoint_wrapper(layer, preserve_rng_state=False)
    if cfg.compile:
        for layer in layers:
            layer.compile()
    if dtype != torch.float32:
        model.to(dtype)
    if world_size > 1:
        from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

        mp = MixedPrecisionPolicy(param_dtype=dtype, reduce_dtype=torch.float32)
        for layer in layers:
            fully_shard(layer, mp_policy=mp)
        fully_shard(model, mp_policy=mp)
    return model


def describe(model: nn.Module) -> str:
    n = n_params(model)
    return f"{n / 1e6:.1f}M parameters" if n < 1e9 else f"{n / 1e9:.2f}B parameters"
