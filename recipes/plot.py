"""Compare loss curves: ``python -m recipes.plot RUN_DIR [RUN_DIR ...] [--out PNG] [--x tokens]``.

Reads each run's ``metrics.jsonl`` and draws training loss (thin) and validation
loss (markers) against tokens or steps, one colour per run, labelled by the run
folder name (or its ``config.json`` optimizer when folder names collide).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from .cli import DEBUG_HELP, run_cli
from .metrics import read_metrics


def _label(run: Path, seen: set[str]) -> str:
    label = run.name
    cfg = run / "config.json"
    if label in seen and cfg.exists():
        label = f"{label} ({json.loads(cfg.read_text())['optim']['name']})"
    seen.add(label)
    return label


def plot(runs: list[str | Path], out: str | Path, x: str = "tokens", title: str | None = None):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    if x not in ("tokens", "step"):
        raise ValueError(f"x must be 'tokens' or 'step', got {x!r}")
    fig, ax = plt.subplots(figsize=(7, 4.5), dpi=120)
    seen: set[str] = set()
    for i, run in enumerate(Path(r) for r in runs):
        if not (run / "metrics.jsonl").is_file():
            raise FileNotFoundError(f"{run}: no metrics.jsonl (is it a recipe output folder?)")
        recs = read_metrics(run)
        colour = f"C{i % 10}"
        label = _label(run, seen)
        ax.plot(
            [r[x] for r in recs],
            [r["loss"] for r in recs],
            color=colour,
            lw=1,
            alpha=0.6,
            label=f"{label} train",
        )
        val = [r for r in recs if "val_loss" in r]
        if val:
            ax.plot(
                [r[x] for r in val],
                [r["val_loss"] for r in val],
                "o-",
                color=colour,
                ms=3,
                lw=1.5,
                label=f"{label} val",
            )
    ax.set_xlabel("tokens" if x == "tokens" else "optimizer step")
    ax.set_ylabel("cross-entropy loss (nats/token)")
    ax.set_title(title or "loss curves")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    Path(out).parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out)
    plt.close(fig)
    return Path(out)


def main(argv: list[str] | None = None) -> Path:
    ap = argparse.ArgumentParser(
        prog="python -m recipes.plot", description=__doc__.splitlines()[0], epilog=DEBUG_HELP
    )
    ap.add_argument("runs", nargs="+", help="recipe output folders (each with metrics.jsonl)")
    ap.add_argument("--out", default="loss_curves.png", help="PNG to write")
    ap.add_argument("--x", default="tokens", choices=["tokens", "step"])
    ap.add_argument("--title", default=None)
    args = ap.parse_args(argv)
    path = plot(args.runs, args.out, args.x, args.title)
    print(f"wrote {path}")
    return path


if __name__ == "__main__":
    run_cli(main)
