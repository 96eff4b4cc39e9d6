"""The suite's PNG figures: validation loss vs tokens, and optimizer-state memory bars."""

from __future__ import annotations

import textwrap
from pathlib import Path
from typing import Any

from .contenders import BY_KEY


def _pyplot():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _style(key: str, i: int) -> dict[str, Any]:
    contender = BY_KEY.get(key)  # (a key only an older results file has counts as a peer)
    ours = contender is not None and contender.package == "galore2"
    return {
        "color": f"C{i % 10}",
        "linestyle": "-" if ours else "--",
        "marker": "o" if ours else "s",
    }


def convergence(curves: dict[str, tuple[str, list[tuple[int, float]]]], out: Path, title: str):
    """``curves``: key → (legend label, [(tokens, val loss), ...]) at each contender's best lr."""
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(8, 5), dpi=120)
    for i, (key, (label, curve)) in enumerate(curves.items()):
        xs, ys = zip(*curve, strict=True)
        ax.plot(xs, ys, label=label, markersize=3, linewidth=1.2, **_style(key, i))
    ax.set_xlabel("training tokens")
    ax.set_ylabel("validation loss (nats / byte)")
    ax.set_title(title, fontsize=10)
    finals = [c[-1][1] for _, c in curves.values()]
    ax.set_ylim(min(finals) - 0.05, min(finals) + 1.0)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7, ncol=2)
    fig.tight_layout()
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out)
    plt.close(fig)


def memory(bars: dict[str, float], out: Path, title: str, unit: str = "GB"):
    """Horizontal bars: label → size in ``unit``, largest first."""
    plt = _pyplot()
    items = sorted(bars.items(), key=lambda kv: kv[1])
    fig, ax = plt.subplots(figsize=(8, 0.32 * len(items) + 1.2), dpi=120)
    labels = [k for k, _ in items]
    values = [v for _, v in items]
    colours = ["C0" if k.startswith("galore2") else "C7" for k in labels]
    ax.barh(labels, values, color=colours)
    for y, v in enumerate(values):
        ax.text(v, y, f" {v:.2f}", va="center", fontsize=7)
    ax.set_xlabel(unit)
    ax.set_title("\n".join(textwrap.wrap(title, 70)), fontsize=9)
    ax.tick_params(axis="y", labelsize=7)
    ax.set_xlim(0, max(values) * 1.15)
    fig.tight_layout()
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out)
    plt.close(fig)
