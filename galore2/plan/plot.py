"""``--plot out.png``: a plan's memory per optimizer as stacked bars (matplotlib, lazy)."""

from __future__ import annotations

import importlib
from pathlib import Path
from typing import Any

from .planner import OPTIMIZERS
from .report import Report, count
from .units import UNITS

__all__ = ["plot"]

_PARTS = (("weights", "weights", "#4C72B0"), ("gradients", "gradients", "#DD8452"),
          ("state", "optimizer state", "#55A868"), ("held", "step cache", "#8172B3"),
          ("peak", "activations or step temporaries (the larger)", "#C44E52"))  # fmt: skip
_OPTIONS = {(False, False): "plain", (True, False): "PL", (False, True): "AC",
            (True, True): "PL+AC"}  # fmt: skip


def _pyplot() -> Any:
    try:
        matplotlib = importlib.import_module("matplotlib")
    except ImportError as e:
        raise ImportError(
            "--plot needs matplotlib (pip install matplotlib, or 'galore2[recipe]')"
        ) from e
    matplotlib.use("Agg")
    return importlib.import_module("matplotlib.pyplot")


def plot(report: Report, path: str | Path) -> Path:
    """Write a PNG to ``path``: one panel per FSDP world size; per optimizer one bar per
    option set (PL: per-layer updates, AC: activation checkpointing), stacked weights /
    gradients / state / step cache / the larger of activations and step temporaries (their
    sum is the row's total), and a dashed line at the GPU memory."""
    path = Path(path)
    if path.suffix.lower() != ".png":
        raise ValueError(f"--plot must name a .png file, got {str(path)!r}")
    if not path.parent.is_dir():
        raise FileNotFoundError(f"--plot {str(path)!r}: folder {str(path.parent)!r} does not exist")
    plt = _pyplot()
    scale, unit = UNITS[report.unit.lower()], report.unit
    worlds = report.worlds()
    names = list(dict.fromkeys(r.optimizer for r in report.rows))
    options = list(dict.fromkeys((r.per_layer, r.checkpointing) for r in report.rows))
    width = 0.8 / len(options)
    fig, axes = plt.subplots(
        len(worlds),
        1,
        figsize=(max(8.0, 1.9 * len(names)), 1.0 + 4.6 * len(worlds)),
        squeeze=False,
        layout="constrained",
    )
    budget = report.gpu_memory / scale
    for ax, w in zip(axes[:, 0], worlds, strict=True):
        rows = {(r.optimizer, r.per_layer, r.checkpointing): r
                for r in report.rows if r.world_size == w}  # fmt: skip
        top = max(max(r.total for r in rows.values()) / scale, budget)
        minor, minor_labels = [], []
        for j, opt in enumerate(options):
            xs = [i - 0.4 + width * (j + 0.5) for i in range(len(names))]
            minor += xs
            minor_labels += [_OPTIONS[opt]] * len(xs)
            bottom = [0.0] * len(names)
            for attr, label, color in _PARTS:
                h = [getattr(rows[(n, *opt)], attr) / scale for n in names]
                ax.bar(xs, h, width * 0.92, bottom=bottom, color=color, zorder=2,
                       label=label if j == 0 and ax is axes[0, 0] else None)  # fmt: skip
                bottom = [b + x for b, x in zip(bottom, h, strict=True)]
            for x, total, n in zip(xs, bottom, names, strict=True):
                fits = rows[(n, *opt)].fits(report.gpu_memory)
                ax.text(x, total + top * 0.015, f"{total:.1f}", rotation=90, ha="center",
                        va="bottom", fontsize=8, zorder=4, fontweight="bold" if fits else None,
                        color="#1B5E20" if fits else "#B71C1C",
                        bbox={"boxstyle": "square,pad=0.05", "fc": "white", "ec": "none"})  # fmt: skip
        ax.axhline(budget, color="black", linestyle="--", linewidth=1.2, zorder=3,
                   label=f"GPU memory ({budget:g} {unit})" if ax is axes[0, 0] else None)  # fmt: skip
        ax.set_xticks(minor, minor_labels, minor=True, fontsize=7, rotation=90)
        ax.set_xticks(range(len(names)),
                      [OPTIMIZERS[n].label.replace(", ", ",\n") for n in names], fontsize=9)  # fmt: skip
        ax.tick_params(axis="x", which="major", pad=34, length=0)
        ax.tick_params(axis="x", which="minor", length=2)
        ax.set_ylim(0, top * 1.18)
        ax.set_ylabel(f"{unit} per GPU")
        ax.set_title(f"FSDP world size {w}", fontsize=10)
        ax.grid(axis="y", alpha=0.3, zorder=0)
    fig.legend(loc="outside lower center", ncol=5, fontsize=9, frameon=False)
    fig.suptitle(
        f"{report.label}: {count(report.n_params)} parameters, batch {report.batch_size} × "
        f"seq {report.seq_len}, GaLore rank {report.rank}, {report.dtype}\n"
        "PL: per-layer updates, AC: activation checkpointing; totals in green fit, in red do not",
        fontsize=10,
    )
    fig.savefig(path, dpi=130)
    plt.close(fig)
    return path
