"""Per-group hyperparameters: defaults and up-front validation.

Every galore2 optimizer validates each parameter group completely before it is
added (at construction and in ``add_param_group``), so a bad value never leaves
an optimizer half-configured. Errors name the key and the allowed values.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

import torch

PROJ_TYPES = ("std", "reverse_std", "left", "right", "full")
PROJECTORS = ("svd", "randomized", "power", "random")
MOMENTS_ON_REFRESH = ("keep", "reset", "project")
NONFINITE = ("skip", "raise", "ignore")
BASIS_DTYPES = ("fp32", "bf16", "int8", "int4")
_BASIS_ALIASES = {"float32": "fp32", "bfloat16": "bf16"}
TENSOR_PROJECTIONS = ("tucker", "matrix")
STATE_DTYPES = {
    "float32": torch.float32,
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
    "float64": torch.float64,
}
_DTYPE_ALIASES = {"fp32": "float32", "bf16": "bfloat16", "fp16": "float16", "fp64": "float64"}

# GaLore keys: meaningful only in a group whose ``rank`` is set.
GALORE_DEFAULTS: dict[str, Any] = {
    "rank": None,
    "update_proj_gap": 200,
    "scale": 0.25,
    "proj_type": "std",
    "projector": "randomized",
    "oversample": 8,
    "power_iters": 1,
    "moments_on_refresh": "keep",
    "seed": 0,
    # how the basis is stored (quantized bases are dequantized on use)
    "basis_dtype": "fp32",
    "basis_group_size": 256,
    "basis_hadamard": False,
    # adaptive refresh: lengthen a parameter's gap while its subspace stays put
    "adaptive_refresh": False,
    "refresh_threshold": 0.4,
    "refresh_patience": 3,
    "max_update_proj_gap": None,
    # weights with more than two dims: Tucker per-mode bases, or flattened to shape[0] x rest
    "tensor_projection": "tucker",
}


def check_galore_kwargs(galore: Mapping[str, Any]) -> None:
    """Refuse optimizer keyword arguments that are not GaLore options (a preset's ``**galore``)."""
    unknown = set(galore) - set(GALORE_DEFAULTS)
    if unknown:
        raise TypeError(
            f"unexpected keyword arguments {sorted(unknown)}; GaLore options are "
            f"{sorted(GALORE_DEFAULTS)}"
        )


def _is_int(x: Any) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def _real(x: Any) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x)


def normalize_state_dtype(value: Any) -> str:
    """Return the canonical name (``"float32"``...) of a state dtype given as str or dtype."""
    if isinstance(value, torch.dtype):
        for name, dt in STATE_DTYPES.items():
            if dt == value:
                return name
    elif isinstance(value, str):
        name = _DTYPE_ALIASES.get(value, value)
        if name in STATE_DTYPES:
            return name
    raise ValueError(
        f"state_dtype must be one of {sorted(STATE_DTYPES)} (or torch dtypes / "
        f"{sorted(_DTYPE_ALIASES)}), got {value!r}"
    )


def validate_group(group: Mapping[str, Any]) -> dict[str, Any]:
    """Check a fully-defaulted parameter group; return the normalized values to write back.

    Raises ``ValueError`` naming the offending key and what is allowed.
    """
    out: dict[str, Any] = {}
    lr = group["lr"]
    if isinstance(lr, torch.Tensor):
        if lr.numel() != 1:
            raise ValueError(
                f"lr must be a float or a one-element tensor, got shape {tuple(lr.shape)}"
            )
        lr_value = float(lr)
    elif _real(lr):
        lr_value = float(lr)
    else:
        raise ValueError(f"lr must be a finite float >= 0, got {lr!r}")
    if lr_value < 0:
        raise ValueError(f"lr must be >= 0, got {lr_value}")

    # Adam-form keys. A group without betas (GaLoreAdafactor: eps is a pair there) has its
    # betas/eps-like keys checked by its transform's validate().
    if "betas" in group:
        betas = group["betas"]
        if not (isinstance(betas, (tuple, list)) and len(betas) == 2):
            raise ValueError(
                f"betas must be a pair (beta1, beta2) with each in [0, 1), got {betas!r}"
            )
        for i, b in enumerate(betas):
            if not _real(b) or not 0.0 <= b < 1.0:
                raise ValueError(f"betas[{i}] must be in [0, 1), got {b!r}")
        out["betas"] = (float(betas[0]), float(betas[1]))
        eps = group["eps"]
        if not _real(eps) or eps <= 0:
            raise ValueError(f"eps must be a finite float > 0, got {eps!r}")
    wd = group["weight_decay"]
    if not _real(wd) or wd < 0:
        raise ValueError(f"weight_decay must be a finite float >= 0, got {wd!r}")
    if not isinstance(group.get("maximize", False), bool):
        raise ValueError(f"maximize must be a bool, got {group['maximize']!r}")
    if group["nonfinite"] not in NONFINITE:
        raise ValueError(f"nonfinite must be one of {NONFINITE}, got {group['nonfinite']!r}")
    out["state_dtype"] = normalize_state_dtype(group["state_dtype"])

    rank = group.get("rank")
    if rank is not None and (not _is_int(rank) or rank < 1):
        raise ValueError(f"rank must be an int >= 1 (or None for plain AdamW), got {rank!r}")
    gap = group["update_proj_gap"]
    if not _is_int(gap) or gap < 1:
        raise ValueError(f"update_proj_gap must be an int >= 1, got {gap!r}")
    scale = group["scale"]
    if not _real(scale) or scale <= 0:
        raise ValueError(f"scale must be a finite float > 0, got {scale!r}")
    if group["proj_type"] not in PROJ_TYPES:
        raise ValueError(f"proj_type must be one of {PROJ_TYPES}, got {group['proj_type']!r}")
    if group["projector"] not in PROJECTORS:
        raise ValueError(f"projector must be one of {PROJECTORS}, got {group['projector']!r}")
    if group["moments_on_refresh"] not in MOMENTS_ON_REFRESH:
        raise ValueError(
            f"moments_on_refresh must be one of {MOMENTS_ON_REFRESH}, "
            f"got {group['moments_on_refresh']!r}"
        )
    if not _is_int(group["oversample"]) or group["oversample"] < 0:
        raise ValueError(f"oversample must be an int >= 0, got {group['oversample']!r}")
    iters = group["power_iters"]
    min_iters = 1 if group["projector"] == "power" else 0
    if not _is_int(iters) or iters < min_iters:
        raise ValueError(
            f"power_iters must be an int >= {min_iters} for projector={group['projector']!r}, "
            f"got {iters!r}"
        )
    if not _is_int(group["seed"]) or not 0 <= group["seed"] < 2**62:
        raise ValueError(f"seed must be an int in [0, 2**62), got {group['seed']!r}")
    out.update(_validate_storage(group))
    out.update(_validate_adaptive(group))
    if group["tensor_projection"] not in TENSOR_PROJECTIONS:
        raise ValueError(
            f"tensor_projection must be one of {TENSOR_PROJECTIONS}, "
            f"got {group['tensor_projection']!r}"
        )
    return out


def _validate_storage(group: Mapping[str, Any]) -> dict[str, Any]:
    value = group["basis_dtype"]
    if isinstance(value, torch.dtype):
        value = {torch.float32: "fp32", torch.bfloat16: "bf16"}.get(value, value)
    name = _BASIS_ALIASES.get(value, value) if isinstance(value, str) else value
    if name not in BASIS_DTYPES:
        raise ValueError(
            f"basis_dtype must be one of {BASIS_DTYPES} (or torch.float32 / torch.bfloat16), "
            f"got {group['basis_dtype']!r}"
        )
    size = group["basis_group_size"]
    if not _is_int(size) or size < 2:
        raise ValueError(f"basis_group_size must be an int >= 2, got {size!r}")
    hadamard = group["basis_hadamard"]
    if not isinstance(hadamard, bool):
        raise ValueError(f"basis_hadamard must be a bool, got {hadamard!r}")
    if hadamard and name not in ("int8", "int4"):
        raise ValueError(
            f"basis_hadamard=True needs basis_dtype 'int8' or 'int4' (it rotates before "
            f"quantizing), got basis_dtype={name!r}"
        )
    if hadamard and size & (size - 1):
        raise ValueError(
            f"basis_group_size must be a power of two when basis_hadamard=True, got {size}"
        )
    if name != "fp32" and group["projector"] == "random":
        raise ValueError(
            f"basis_dtype={name!r} needs a stored basis; projector='random' regenerates its "
            "basis from a seed and stores none (use basis_dtype='fp32')"
        )
    return {"basis_dtype": name}


def _validate_adaptive(group: Mapping[str, Any]) -> dict[str, Any]:
    if not isinstance(group["adaptive_refresh"], bool):
        raise ValueError(f"adaptive_refresh must be a bool, got {group['adaptive_refresh']!r}")
    threshold = group["refresh_threshold"]
    if not _real(threshold) or not 0.0 < threshold <= 1.0:
        raise ValueError(f"refresh_threshold must be a float in (0, 1], got {threshold!r}")
    patience = group["refresh_patience"]
    if not _is_int(patience) or patience < 1:
        raise ValueError(f"refresh_patience must be an int >= 1, got {patience!r}")
    cap = group["max_update_proj_gap"]
    gap = group["update_proj_gap"]
    if cap is not None and (not _is_int(cap) or cap < gap):
        raise ValueError(
            f"max_update_proj_gap must be None (8 x update_proj_gap) or an int >= "
            f"update_proj_gap ({gap}), got {cap!r}"
        )
    return {}
