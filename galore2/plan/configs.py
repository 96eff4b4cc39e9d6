"""What ``python -m galore2.plan CONFIG`` plans for: a Hugging Face config or a recipe config.

CONFIG is, in this order:

* a Hugging Face ``config.json``, or a folder holding one: the model is
  ``AutoModelForCausalLM.from_config`` of it, on the meta device (offline; needs
  ``transformers``, imported only here);
* a recipe TOML file (``recipes/configs/*.toml`` of a galore2 source checkout): the
  recipe's own Llama, dtype, batch, sequence length, GaLore settings and gradient
  accumulation, read by the recipe's config parser (``recipes.config``);
* a recipe config name (``llama_7b``): ``recipes/configs/NAME.toml`` under the current
  folder, else under the source checkout this galore2 was imported from. ``recipes`` is
  not part of the installed package: a name resolves only where a checkout is.

galore2 never imports ``recipes`` at module level; a recipe config imports it when read
(from the checkout the file is in, when ``recipes`` is not importable already).
"""

from __future__ import annotations

import importlib
import json
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import nn

#: where recipe config names are looked up: the current folder's checkout, then the one
#: this galore2 lives in (an editable install or a source tree on PYTHONPATH)
_CHECKOUTS = (Path("."), Path(__file__).resolve().parents[2])
_CONFIGS = Path("recipes") / "configs"

__all__ = ["Source", "build_model", "config_dirs", "load"]


@dataclass
class Source:
    """A loaded CONFIG: the model config to build and the settings it brings.

    ``None`` fields are the planner's defaults (a Hugging Face config brings no training
    settings; a recipe config brings all of them)."""

    label: str  # how the output names it
    kind: str  # "hf" or "recipe"
    config: Any  # a transformers PretrainedConfig
    dtype: torch.dtype | None = None  # parameter dtype (recipe: its dtype on a GPU)
    batch_size: int | None = None
    seq_len: int | None = None
    grad_accum: int | None = None
    target_modules: Any = None  # param_groups' target_modules (None: "all-linear")
    galore: dict[str, Any] = field(default_factory=dict)  # GaLore group settings, rank too


def _transformers(what: str) -> Any:
    try:
        return importlib.import_module("transformers")
    except ImportError as e:
        raise ImportError(
            f"CONFIG {what}: building the model needs transformers, which is not installed "
            "(pip install transformers, or pip install 'galore2[recipe]')"
        ) from e


def config_dirs() -> list[Path]:
    """The folders recipe config names are looked up in (existing ones, in order)."""
    dirs = [(root / _CONFIGS).resolve() for root in _CHECKOUTS]
    return [d for i, d in enumerate(dirs) if d.is_dir() and d not in dirs[:i]]


def _resolve(spec: str) -> Path:
    path = Path(spec)
    if path.is_dir():
        if not (path / "config.json").is_file():
            raise FileNotFoundError(f"CONFIG {spec!r}: the folder has no config.json")
        return path / "config.json"
    if path.is_file():
        if path.suffix not in (".json", ".toml"):
            raise ValueError(
                f"CONFIG {spec!r}: expected a Hugging Face config.json (.json) or a recipe "
                f"config (.toml), got a {path.suffix or 'suffix-less'} file"
            )
        return path
    if path.suffix or len(path.parts) > 1:
        raise FileNotFoundError(f"CONFIG {spec!r}: no such file or folder")
    dirs = config_dirs()
    for d in dirs:
        if (d / f"{spec}.toml").is_file():
            return d / f"{spec}.toml"
    known = sorted({p.stem for d in dirs for p in d.glob("*.toml")})
    where = ", ".join(str(d) for d in dirs) or (
        "none found: recipe names need a galore2 source checkout (run from its root), "
        "or pass a config.json / .toml path"
    )
    raise FileNotFoundError(
        f"CONFIG {spec!r}: not a file, folder or recipe config name. Recipe configs "
        f"searched: {where}" + (f"; names: {', '.join(known)}" if known else "")
    )


def _hf(path: Path) -> Source:
    try:
        data = json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise ValueError(f"CONFIG {str(path)!r}: not valid JSON ({e})") from None
    if not isinstance(data, dict) or not isinstance(data.get("model_type"), str):
        raise ValueError(
            f'CONFIG {str(path)!r}: a Hugging Face config.json needs a "model_type" key'
        )
    transformers = _transformers(str(path))
    model_type = data.pop("model_type")
    try:
        config = transformers.AutoConfig.for_model(model_type, **data)
    except ValueError:
        raise ValueError(
            f"CONFIG {str(path)!r}: model_type {model_type!r} is unknown to transformers "
            f"{transformers.__version__}"
        ) from None
    return Source(label=str(path), kind="hf", config=config)


def _recipes(path: Path) -> Any:
    """The recipe's packages (config, model, optimizers), imported from the checkout the
    TOML file is in when ``recipes`` is not importable already."""
    try:
        importlib.import_module("recipes.config")
    except ModuleNotFoundError as e:
        if e.name not in ("recipes", "recipes.config"):
            raise
        parents = path.resolve().parents
        root = parents[2] if len(parents) > 2 else parents[-1]
        if not (root / "recipes" / "config.py").is_file():
            raise ImportError(
                f"CONFIG {str(path)!r}: a recipe config is read by galore2's recipe package "
                "(recipes/ of a source checkout), which is not importable here and not "
                f"next to the file; run from the checkout's root or pass a config.json"
            ) from None
        sys.path.insert(0, str(root))
    _transformers(str(path))  # the recipe's Llama is a transformers LlamaConfig
    return tuple(importlib.import_module(f"recipes.{m}") for m in ("config", "model", "optimizers"))


def _recipe(path: Path) -> Source:
    config, model, optimizers = _recipes(path)
    job = config.parse_args(["--config", str(path)])
    return Source(
        label=f"recipe {path.stem}",
        kind="recipe",
        config=model.llama_config(job.model),
        dtype=model.param_dtype(job.model, torch.device("cuda")),
        batch_size=job.train.batch_size,
        seq_len=job.data.seq_len,
        grad_accum=job.train.grad_accum,
        target_modules=job.optim.target_modules,
        galore=optimizers.galore_settings(job.optim),
    )


def load(spec: str | Path) -> Source:
    """The :class:`Source` CONFIG ``spec`` names (see the module docstring); a clear
    ``FileNotFoundError`` / ``ValueError`` / ``ImportError`` otherwise."""
    path = _resolve(str(spec))
    return _recipe(path) if path.suffix == ".toml" else _hf(path)


def build_model(config: Any, dtype: torch.dtype) -> nn.Module:
    """``AutoModelForCausalLM.from_config(config)`` on the meta device, in ``dtype``
    (nothing is allocated)."""
    transformers = _transformers(type(config).__name__)
    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(config)
    return model.to(dtype)
