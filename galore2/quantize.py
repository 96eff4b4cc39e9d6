"""``quantize_weights``: keep a model's linear weights as int8 codes + scales.

    model = build_model().to("cuda", torch.bfloat16)
    galore2.quantize_weights(model, bits=8, group_size=256)
    opt = galore2.GaLoreAdamW(galore2.param_groups(model, rank=128), lr=1e-3)
    updates = galore2.per_layer(model, opt)   # one dense working copy at a time

Every selected ``nn.Linear`` becomes a :class:`~galore2.storage.weights.QuantizedLinear`
(format, forward/backward and checkpoint layout: :mod:`galore2.storage.weights`); every
galore2 optimizer updates it through its apply stage (:mod:`galore2.core.stored`) with
stochastic rounding. Embeddings, the output head, norms and biases keep their dtype.
"""

from __future__ import annotations

import zlib
from collections.abc import Sequence

from torch import nn

from ._numerics import mix_seed
from .fsdp.detect import is_dtensor
from .groups import _matcher, _output_head_names
from .storage.weights import QuantizedLinear

BITS = (8,)


def quantize_weights(
    model: nn.Module,
    bits: int = 8,
    group_size: int | None = 256,
    *,
    target_modules: str | Sequence[str] = "all-linear",
    seed: int = 0,
) -> list[str]:
    """Store the weights of ``model``'s chosen linear layers as int8 codes + fp32 scales.

    Args:
        model: quantized in place (call it after moving the model to its device and dtype;
            the dequantized weight is computed in the shell parameter's dtype).
        bits: 8 (int8 absmax codes); other widths are not supported yet.
        group_size: inputs per scale along each row (≥ 2); ``None``: one scale per output
            channel (the whole row). A group size above ``in_features`` means the whole row.
        target_modules: the modules to quantize, as :func:`galore2.param_groups` selects the
            modules it projects: ``"all-linear"`` (every ``nn.Linear`` but the output head),
            a regex searched in module names, or a list of name substrings.
        seed: the stochastic rounding seed; each weight's seed mixes it with the module name.

    Returns:
        The names of the modules quantized.

    Raises:
        ValueError: a bad argument, a selected module that is not an ``nn.Linear``, a
            DTensor (FSDP2) weight, or nothing selected — before any module changes.
    """
    if isinstance(bits, bool) or bits not in BITS:
        raise ValueError(f"bits must be one of {BITS} (int8 weights), got {bits!r}")
    if group_size is not None and (
        isinstance(group_size, bool) or not isinstance(group_size, int) or group_size < 2
    ):
        raise ValueError(f"group_size must be an int >= 2 or None (per row), got {group_size!r}")
    if isinstance(seed, bool) or not isinstance(seed, int):
        raise ValueError(f"seed must be an int, got {seed!r}")
    if not isinstance(model, nn.Module):
        raise TypeError(f"model must be an nn.Module, got {type(model).__name__}")
    targets, match = _matcher(target_modules)
    heads = _output_head_names(model) if match is None else set()
    chosen: list[tuple[str, nn.Linear]] = []
    for name, module in model.named_modules():
        if isinstance(module, QuantizedLinear):
            continue  # already quantized
        if match is None:
            hit = isinstance(module, nn.Linear) and name not in heads
        else:
            hit = any(match(name, t) for t in targets)
            if hit and not isinstance(module, nn.Linear):
                if any(True for _ in module.children()):
                    continue  # a container whose name matches: its linear children decide
                raise ValueError(
                    f"quantize_weights: module {name!r} ({type(module).__name__}) is not an "
                    "nn.Linear; int8 weights exist for nn.Linear only"
                )
        if not hit:
            continue
        w = module.weight
        if is_dtensor(w):
            raise ValueError(
                "quantize_weights: int8 weights are not supported under FSDP2 (module "
                f"{name!r} holds a DTensor); train on one device with per-layer updates "
                "(galore2.per_layer), or keep bf16 weights when sharding"
            )
        if not w.is_floating_point() or w.dim() != 2:
            raise ValueError(f"quantize_weights: {name!r} has a {w.dtype} weight; need a float one")
        chosen.append((name, module))
    if not chosen:
        raise ValueError(
            f"quantize_weights: target_modules={target_modules!r} selected no nn.Linear"
        )
    for name, module in chosen:
        QuantizedLinear.convert(module, group_size, mix_seed(seed, zlib.crc32(name.encode())))
    return [name for name, _ in chosen]


__all__ = ["quantize_weights"]
