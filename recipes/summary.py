"""End-of-run summary and the run's resolved configuration (``OUT/config.json``)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from .config import JobConfig


def write_config(out: str | Path, job: JobConfig, changes: list[dict] | tuple = ()) -> None:
    """``OUT/config.json``: the settings in force, and under ``changes`` every setting a
    resumed run changed (``{"step", "key", "from", "to"}``: applied after ``step``)."""
    path = Path(out)
    path.mkdir(parents=True, exist_ok=True)
    record = {**job.to_dict(), "changes": list(changes)}
    (path / "config.json").write_text(json.dumps(record, indent=2) + "\n")


def _gb(n: float) -> str:
    return f"{n / 1e9:.3f} GB" if n >= 1e8 else f"{n / 1e6:.2f} MB"


def summarize(
    history: list[dict[str, Any]],
    opt_bytes: int | None,
    adamw_bytes: int,
    stopped: str | None = None,
    adamw: str = "torch AdamW",
    weights: dict[str, int] | None = None,
) -> dict:
    """Final train loss (last log window), last val loss (None without evaluation), mean
    tokens/s, state bytes vs AdamW's (``adamw``: which AdamW, e.g. "torch AdamW with bf16
    moments", the one the run would use: :func:`recipes.metrics.adamw_baseline`), skipped
    updates (``nonfinite_skips``, None if the optimizer does not count them), why the run
    ``stopped`` early (None if it did not) and, given ``weights``
    (:func:`recipes.metrics.weight_bytes`), the weights' bytes as stored and dense.
    A step logged twice counts once (its last row)."""
    by_step = {r["step"]: r for r in history}
    history = [by_step[k] for k in sorted(by_step)]
    last = history[-1]
    vals = [r["val_loss"] for r in history if "val_loss" in r]
    rates = [r["tokens_per_s"] for r in history[1:]] or [last["tokens_per_s"]]  # skip warm-up
    out = {
        "step": last["step"],
        "train_loss": last["loss"],
        "val_loss": vals[-1] if vals else None,
        "tokens_per_s": sum(rates) / len(rates),
        "tokens": last["tokens"],
        "opt_state_bytes": opt_bytes,
        "adamw_state_bytes": adamw_bytes,
        "adamw_baseline": adamw,
        "nonfinite_skips": last.get("nonfinite_skips"),
        "stopped": stopped,
    }
    if opt_bytes is not None and adamw_bytes:
        out["state_ratio"] = opt_bytes / adamw_bytes
    if weights is not None:
        out.update(weights)
    return out


def print_summary(
    job: JobConfig,
    history: list[dict[str, Any]],
    opt_bytes: int | None,
    adamw_bytes: int,
    stopped: str | None = None,
    loss_plot: Path | None = None,
    adamw: str = "torch AdamW",
    weights: dict[str, int] | None = None,
) -> dict:
    """Print the run's summary (with ``loss_plot``, the PNG of its curves, where one was
    written) and write it to ``OUT/summary.json``; ``adamw`` names the state baseline,
    ``weights`` are the model's weight bytes (:func:`recipes.metrics.weight_bytes`)."""
    s = summarize(history, opt_bytes, adamw_bytes, stopped, adamw, weights)
    val = f"{s['val_loss']:.4f}" if s["val_loss"] is not None else "n/a"
    lines = [
        f"== {job.optim.name}: {s['step']} steps, {s['tokens']:,} tokens ==",
        f"final train loss   {s['train_loss']:.4f}",
        f"final val loss     {val}",
        f"throughput         {s['tokens_per_s']:,.0f} tokens/s",
    ]
    if opt_bytes is not None:
        lines.append(
            f"optimizer state    {_gb(opt_bytes)}  vs {_gb(adamw_bytes)} for {adamw} "
            f"({s.get('state_ratio', float('nan')):.3f}×)"
        )
    if weights is not None:
        stored, dense = weights["weight_bytes"], weights["dense_weight_bytes"]
        line = f"weights            {_gb(stored)}"
        if stored != dense:  # int8 layers (--model.weight_bits 8)
            line += f" (int8 codes + scales) vs {_gb(dense)} dense ({stored / dense:.3f}×)"
        lines.append(line)
    if s["nonfinite_skips"] is not None:
        lines.append(f"skipped updates    {s['nonfinite_skips']:,} (non-finite gradients)")
    if stopped:
        lines.append(f"stopped early      {stopped}")
    if loss_plot is not None:
        lines.append(f"loss curves        {loss_plot}")
    print("\n".join(lines), flush=True)
    Path(job.train.out, "summary.json").write_text(json.dumps(s, indent=2) + "\n")
    return s
