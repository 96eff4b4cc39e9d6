"""The memory planner on a recipe config: ``python -m recipes.plan CONFIG [planner options]``.

    python -m recipes.plan llama_7b --world-size 1,8 --gpu-memory 80GB

CONFIG is a recipe config name (``recipes/configs/NAME.toml``) or a TOML path. The recipe
reads it with its own parser (:func:`recipes.resolve.parse_args`) and passes the resolved
settings down to :mod:`galore2.plan` as a :class:`galore2.plan.configs.Source`: its
Llama's config, its dtype on a GPU, batch size, sequence length, gradient accumulation,
target modules and GaLore settings. Every option of ``python -m galore2.plan`` applies
(``--help``). The planner itself never imports the recipe: it plans a Hugging Face
``config.json`` from any folder with only the wheel installed.
"""

from __future__ import annotations

from pathlib import Path

import torch

from galore2.plan import cli
from galore2.plan.configs import Source

from .config import JobConfig, resolve_config_path
from .model import llama_config, param_dtype
from .optimizers import galore_settings
from .resolve import parse_args

CONFIG_HELP = "a recipe config name (recipes/configs/NAME.toml) or a recipe .toml file"

__all__ = ["load", "main", "source"]


def source(job: JobConfig, label: str) -> Source:
    """What the planner needs of a resolved recipe configuration ``job``."""
    return Source(
        label=label,
        kind="recipe",
        config=llama_config(job.model),
        dtype=param_dtype(job.model, torch.device("cuda")),
        batch_size=job.train.batch_size,
        seq_len=job.data.seq_len,
        grad_accum=job.train.grad_accum,
        target_modules=job.optim.target_modules,
        galore=galore_settings(job.optim),
        weight_bits=job.model.weight_bits,
        weight_group_size=job.model.weight_group_size,
    )


def load(spec: str) -> Source:
    """The :class:`~galore2.plan.configs.Source` of recipe config ``spec`` (a name or a
    path), as the recipe resolves it; a ``ValueError`` naming the file for a Hugging Face
    config (``python -m galore2.plan`` plans those) or a file that is not TOML."""
    given = Path(spec)
    if given.suffix == ".json" or (given.is_dir() and (given / "config.json").is_file()):
        raise ValueError(
            f"CONFIG {spec!r}: a Hugging Face config.json, not a recipe config; plan it with "
            f"python -m galore2.plan {spec}"
        )
    path = resolve_config_path(spec)
    try:
        job = parse_args(["--config", str(path)])
    except ValueError as e:  # tomllib's errors and UnicodeDecodeError are ValueErrors
        if str(path) in str(e):
            raise
        raise ValueError(
            f"CONFIG {str(path)!r}: not a recipe config ({' '.join(str(e).split())}); "
            "a recipe config is a TOML file (recipes/configs/NAME.toml), a Hugging Face "
            "config.json is planned by python -m galore2.plan"
        ) from None
    return source(job, f"recipe {Path(path).stem}")


def main(argv: list[str] | None = None):
    """:func:`galore2.plan.cli.main` with CONFIG read by the recipe; returns the report."""
    return cli.main(argv, loader=load, prog="python -m recipes.plan", config_help=CONFIG_HELP)


if __name__ == "__main__":
    cli.run(loader=load, prog="python -m recipes.plan", config_help=CONFIG_HELP)
