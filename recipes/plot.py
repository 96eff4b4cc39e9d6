"""Compare loss curves: ``python -m recipes.plot RUN_DIR [RUN_DIR ...] [--out PNG] [--x tokens]``.

Reads each run's ``metrics.jsonl`` and draws training loss (thin) and validation
loss (markers; the last value in the legend) against tokens or steps, one
colour per run (one run: train and val in two), labelled by the run folder name (or
its ``config.json`` optimizer when folder names collide).

``recipes.pretrain`` draws each run's own curves at its end (:func:`write_run_plot`):
``OUT/loss.png``.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from .cli import DEBUG_HELP, run_cli
from .config import JobConfig
from .metrics import read_metrics
from .optimizers import setting

LOSS_PNG = "loss.png"  # a run's own curves, next to its metrics.jsonl


def _label(run: Path, seen: set[str]) -> str:
    label = run.name
    cfg = run / "config.json"
    if label in seen and cfg.exists():
        label = f"{label} ({json.loads(cfg.read_text())['optim']['name']})"
    seen.add(label)
    return label


def plot(
    runs: list[str | Path],
    out: str | Path,
    x: str = "tokens",
    title: str | None = None,
    names: list[str] | None = None,
) -> Path:
    """Draw the runs' loss curves into the PNG ``out``; ``names``: each run's legend name
    (default: its folder's name; ``""`` leaves just "train" / "val")."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    if x not in ("tokens", "step"):
        raise ValueError(f"x must be 'tokens' or 'step', got {x!r}")
    if names is not None and len(names) != len(runs):
        raise ValueError(f"names must name each of the {len(runs)} runs, got {len(names)}")
    fig, ax = plt.subplots(figsize=(7, 4.5), dpi=120)
    seen: set[str] = set()
    for i, run in enumerate(Path(r) for r in runs):
        if not (run / "metrics.jsonl").is_file():
            raise FileNotFoundError(f"{run}: no metrics.jsonl (is it a recipe output folder?)")
        recs = read_metrics(run)
        colour = f"C{i % 10}"
        label = _label(run, seen) if names is None else names[i]
        ax.plot(
            [r[x] for r in recs],
            [r["loss"] for r in recs],
            color=colour,
            lw=1,
            alpha=0.6,
            label=f"{label} train".strip(),
        )
        val = [r for r in recs if "val_loss" in r]
        if val:
            ax.plot(
                [r[x] for r in val],
                [r["val_loss"] for r in val],
                "o-",
                color=colour if len(runs) > 1 else "C1",  # one run: val in its own colour
                ms=3,
                lw=1.5,
                label=f"{label} val (last {val[-1]['val_loss']:.3f})".strip(),
            )
    ax.set_xlabel("tokens" if x == "tokens" else "optimizer step")
    ax.set_ylabel("cross-entropy loss (nats/token)")
    ax.set_title(title or "loss curves", fontsize=10)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    Path(out).parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out)
    plt.close(fig)
    return Path(out)


def run_title(job: JobConfig, n_params: int, world: int = 1, projected: bool = False) -> str:
    """Two lines naming a run: optimizer and model, then its main settings (GaLore's where
    the optimizer ``projected``)."""
    m, o, t = job.model, job.optim, job.train
    size = f"{n_params / 1e6:.1f}M" if n_params < 1e9 else f"{n_params / 1e9:.2f}B"
    settings = [f"lr {setting(o, 'lr'):g}"]
    if projected:
        rank, gap, scale = (setting(o, k) for k in ("rank", "update_proj_gap", "scale"))
        settings.append(f"rank {rank}, gap {gap}, α {scale:g}")
    tokens = t.batch_size * t.grad_accum * world * job.data.seq_len
    settings.append(f"{tokens:,} tokens/step")
    return f"{o.name} · Llama, {size} parameters ({m.n_layers} layers, dim {m.dim})\n" + ", ".join(
        settings
    )


def write_run_plot(
    job: JobConfig, n_params: int, world: int = 1, projected: bool = False
) -> Path | None:
    """``OUT/loss.png``: the run's train and val loss against steps, titled by
    :func:`run_title`. Without matplotlib: one line saying so, and None."""
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        print(f"{LOSS_PNG} not written: matplotlib is not installed (pip install matplotlib)")
        return None
    out = Path(job.train.out)
    return plot(
        [out],
        out / LOSS_PNG,
        x="step",
        title=run_title(job, n_params, world, projected),
        names=[""],
    )


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
