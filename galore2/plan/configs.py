"""What ``python -m galore2.plan CONFIG`` plans for: a Hugging Face ``config.json``.

CONFIG is a Hugging Face ``config.json``, or a folder holding one: the model is
``AutoModelForCausalLM.from_config`` of it, on the meta device (offline; needs
``transformers``, imported only here). Invalid values (a negative ``hidden_size``, a
field of the wrong type, heads that do not divide the hidden size) are a ``ValueError``
naming the file, before any model is built.

The planner is self-contained: it never imports the recipe (``recipes/`` of a source
checkout, not part of the wheel) nor edits ``sys.path``. A recipe config is planned by the
recipe, which resolves it with its own parser and passes the result down as a
:class:`Source`: ``python -m recipes.plan llama_7b`` (``recipes/plan.py``).
"""

from __future__ import annotations

import importlib
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import nn

from .formulas import SIZE_NAMES, missing_sizes

__all__ = ["Source", "build_model", "load"]

#: how a recipe config is planned (the recipe passes its resolved config down)
RECIPE_PLANNER = "python -m recipes.plan"


@dataclass
class Source:
    """A loaded CONFIG: the model config to build and the settings it brings.

    ``None`` fields are the planner's defaults (a Hugging Face config brings no training
    settings; a recipe config brings all of them)."""

    label: str  # how the output names it
    kind: str  # "hf", or "recipe" (recipes.plan builds it)
    config: Any  # a transformers PretrainedConfig
    dtype: torch.dtype | None = None  # parameter dtype (recipe: its dtype on a GPU)
    batch_size: int | None = None
    seq_len: int | None = None
    grad_accum: int | None = None
    target_modules: Any = None  # param_groups' target_modules (None: "all-linear")
    galore: dict[str, Any] = field(default_factory=dict)  # GaLore group settings, rank too
    weight_bits: int | None = None  # 8: int8 linear weights (galore2.quantize_weights)
    weight_group_size: int | None = 256  # their inputs per scale (None: one per row)


def _transformers(what: str) -> Any:
    try:
        return importlib.import_module("transformers")
    except ImportError as e:
        raise ImportError(
            f"CONFIG {what}: building the model needs transformers, which is not installed "
            "(pip install transformers, or pip install 'galore2[recipe]')"
        ) from e


def _resolve(spec: str) -> Path:
    path = Path(spec)
    if path.is_dir():
        if not (path / "config.json").is_file():
            raise FileNotFoundError(f"CONFIG {spec!r}: the folder has no config.json")
        return path / "config.json"
    if path.suffix == ".toml":
        raise ValueError(
            f"CONFIG {spec!r}: a recipe config; the recipe plans it with its own parser: "
            f"{RECIPE_PLANNER} {spec} (from a galore2 source checkout)"
        )
    if path.is_file():
        if path.suffix != ".json":
            raise ValueError(
                f"CONFIG {spec!r}: expected a Hugging Face config.json (.json) or the folder "
                f"holding one, got a {path.suffix or 'suffix-less'} file"
            )
        return path
    hint = (
        ""
        if path.suffix or len(path.parts) > 1
        else (f" (a recipe config name? {RECIPE_PLANNER} {spec}, from a galore2 source checkout)")
    )
    raise FileNotFoundError(f"CONFIG {spec!r}: no such file or folder{hint}")


def _hf(path: Path) -> Source:
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except UnicodeDecodeError:
        raise ValueError(
            f"CONFIG {str(path)!r}: not a text file (not UTF-8); expected a Hugging Face "
            "config.json"
        ) from None
    except json.JSONDecodeError as e:
        raise ValueError(f"CONFIG {str(path)!r}: not valid JSON ({e})") from None
    if not isinstance(data, dict) or not isinstance(data.get("model_type"), str):
        raise ValueError(
            f'CONFIG {str(path)!r}: a Hugging Face config.json needs a "model_type" key'
        )
    transformers = _transformers(str(path))
    model_type = data.pop("model_type")
    if model_type not in transformers.CONFIG_MAPPING:
        raise ValueError(
            f"CONFIG {str(path)!r}: model_type {model_type!r} is unknown to transformers "
            f"{transformers.__version__}"
        )
    missing = missing_sizes(data)
    if missing:  # transformers would plan its class defaults (Llama-7B) without a word
        raise ValueError(
            f"CONFIG {str(path)!r}: the model's sizes are missing: {', '.join(missing)} "
            f"(the planner needs {', '.join(n[0] for n in SIZE_NAMES.values())} or their "
            "aliases; the model's own defaults would plan another model)"
        )
    try:
        config = transformers.AutoConfig.for_model(model_type, **data)
    except Exception as e:  # transformers' own checks: ValueError, TypeError, its own kinds
        raise ValueError(
            f"CONFIG {str(path)!r}: not a valid {model_type} config: {_why(e)}"
        ) from None
    return Source(label=str(path), kind="hf", config=config)


def _why(e: BaseException) -> str:
    """An exception's message on one line, with its cause's (transformers wraps them)."""
    text = " ".join(str(e).split())
    cause = e.__cause__
    if cause is not None and str(cause) and str(cause) not in text:
        text += f": {' '.join(str(cause).split())}"
    return text


def load(spec: str | Path) -> Source:
    """The :class:`Source` of the Hugging Face config CONFIG ``spec`` names (see the module
    docstring); a clear ``FileNotFoundError`` / ``ValueError`` / ``ImportError`` otherwise."""
    return _hf(_resolve(str(spec)))


def build_model(config: Any, dtype: torch.dtype) -> nn.Module:
    """``AutoModelForCausalLM.from_config(config)`` on the meta device, in ``dtype``
    (nothing is allocated)."""
    transformers = _transformers(type(config).__name__)
    try:
        with torch.device("meta"):
            model = transformers.AutoModelForCausalLM.from_config(config)
    except (ValueError, TypeError, RuntimeError) as e:  # e.g. a negative size
        raise ValueError(
            f"the model config ({type(config).__name__}) does not build a causal LM: {_why(e)}"
        ) from None
    return model.to(dtype)
