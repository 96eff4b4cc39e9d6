"""Loss per byte of optimizer state: every contender's best tiny-recipe loss next to its Llama-7B
state, and the README's "which optimizer should I use" table, from the suite's saved figures.

Runs nothing: it reads ``results/suite_convergence.json`` (best validation loss of the lr
sweep), ``suite_state_7b.json`` (state at Llama-7B shapes, meta device) and
``suite_footprint.json`` (median step time, 116M-parameter Llama) — the latest run of each
— and writes its BENCHMARKS.md section and the block between the ``which-optimizer``
markers of every page holding one (:func:`pages`: docs/guides/choosing.md, and README.md
while it has the block) (``python -m benchmarks.run --tasks per_byte``; ``tests/benchmarks``
checks that each page's block is what the saved figures give).
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

from ._common import Section, table
from .contenders import CONTENDERS

#: memory budgets of the README table (× AdamW's fp32 state at Llama-7B), and their names
BUDGETS = ((0.10, "≤ 10%: 8-bit Adam and below"), (0.35, "≤ 35%: GaLore's fp32 budget"),
           (1.0, "≤ AdamW's"))  # fmt: skip
APOLLO = "apollo"  # apollo-torch's APOLLO: the peer to beat (issue 17)
README_MARKERS = ("<!-- BEGIN which-optimizer -->", "<!-- END which-optimizer -->")
#: the pages that hold the which-optimizer block, relative to the repository root; the guide
#: always does, README.md only while it still has one (see :func:`pages`)
PAGES = ("docs/guides/choosing.md", "README.md")


def pages(root: Path) -> list[Path]:
    """The pages to write: the choosing guide, and README.md if it still holds the block."""
    guide, readme = (root / p for p in PAGES)
    return [guide, *([readme] if README_MARKERS[0] in readme.read_text() else [])]


def load(raw: Path) -> dict[str, dict[str, Any]]:
    """The saved figures: {task: {contender key: value}} for the three measured tasks."""
    out = {}
    for task in ("convergence", "state_7b", "footprint"):
        path = raw / f"suite_{task}.json"
        out[task] = json.loads(path.read_text()) if path.exists() else {}
    return out


def rows(figures: dict[str, dict[str, Any]]) -> list[dict[str, Any]]:
    """Per contender with a convergence result: loss, lr, ratios to AdamW and APOLLO, 7B state
    share, step time share (None where a figure is missing)."""
    conv = {k: min(v, key=lambda r: r["best"]) for k, v in figures["convergence"].items() if v}
    s7, foot = figures["state_7b"], figures["footprint"]
    adamw, apollo = conv.get("adamw"), conv.get(APOLLO)
    base_step = (foot.get("adamw") or {}).get("step_ms")
    out = []
    for c in CONTENDERS:
        best = conv.get(c.key)
        if best is None:
            continue
        state = s7.get(c.key)
        step = (foot.get(c.key) or {}).get("step_ms")
        out.append({
            "key": c.key, "label": c.label, "ours": c.package == "galore2", "lr": best.get("lr"),
            "loss": best["best"],
            "vs_adamw": best["best"] / adamw["best"] if adamw else None,
            "vs_apollo": best["best"] / apollo["best"] if apollo else None,
            "state": state / s7["adamw"] if state and s7.get("adamw") else None,
            "step": step / base_step if step and base_step else None,
        })  # fmt: skip
    return out


def _f(x: float | None, fmt: str) -> str:
    return "" if x is None else fmt.format(x)


def per_byte_md(items: list[dict[str, Any]]) -> str:
    body = table(
        ["optimizer", "best lr", "best val loss", "÷ AdamW", "÷ APOLLO", "7B state ÷ AdamW",
         "step ÷ AdamW"],
        [[r["label"], _f(r["lr"], "{:g}"), f"{r['loss']:.4f}", _f(r["vs_adamw"], "{:.3f}"),
          _f(r["vs_apollo"], "{:.3f}"), _f(r["state"], "{:.3f}"), _f(r["step"], "{:.2f}")]
         for r in sorted(items, key=lambda r: (r["state"] is None, r["state"] or 0, r["loss"]))],
    )  # fmt: skip
    return (
        "Every contender of the convergence section, sorted by Llama-7B state: best validation "
        "loss of its tiny-recipe lr sweep, ÷ torch AdamW's and ÷ apollo-torch APOLLO's (the "
        "best peer at 0.35×), its optimizer state at Llama-7B shapes ÷ AdamW's (state_7b "
        "section), and its median step time on the 116M-parameter footprint model ÷ AdamW's "
        "(footprint section; blank where not measured). Loss figures are deterministic; "
        "step times are from the footprint run's date.\n\n" + body
    )


def best_within(items: list[dict[str, Any]], budget: float, ours: bool) -> dict[str, Any] | None:
    """The row (galore2's when ``ours``, else a peer's) with the lowest loss whose Llama-7B
    state is at most ``budget`` × AdamW's; None if none fits."""
    fits = [r for r in items if r["ours"] == ours and r["state"] is not None]
    return min((r for r in fits if r["state"] <= budget), key=lambda r: r["loss"], default=None)


def which_md(items: list[dict[str, Any]]) -> str:
    """README's table: per memory budget, galore2's best variant and the best peer."""
    lines = []
    for budget, name in BUDGETS:
        ours, peer = best_within(items, budget, True), best_within(items, budget, False)
        if ours is None:
            continue
        lines.append([
            name, f"**{ours['label']}** (lr {ours['lr']:g})", f"{ours['loss']:.4f}",
            f"{ours['state']:.3f}",
            "" if peer is None else f"{peer['label']} {peer['loss']:.4f} ({peer['state']:.3f})",
        ])  # fmt: skip
    return (
        "Which optimizer should I use? By optimizer-state budget (Llama-7B shapes, × AdamW's "
        "fp32 state), the variant with the best validation loss on the suite's tiny recipe "
        "(same token budget and lr sweep for everyone; `python -m benchmarks.run --tasks "
        "per_byte` writes this table from the saved figures, the full list is BENCHMARKS.md's "
        '"loss per byte" section):\n\n'
        + table(
            [
                "state budget",
                "use",
                "best val loss",
                "7B state ÷ AdamW",
                "best peer in budget (state ÷ AdamW)",
            ],
            lines,
        )
    )


def readme_block(readme: str, block: str) -> str:
    begin, end = README_MARKERS
    pattern = re.compile(re.escape(begin) + ".*?" + re.escape(end), re.S)
    if not pattern.search(readme):
        raise ValueError(f"the page has no {begin} … {end} block")
    return pattern.sub(lambda _: f"{begin}\n{block}\n{end}", readme)


def per_byte(suite: Any) -> Section | None:
    """The suite task: the section, and the pages' blocks rewritten (not with --quick)."""
    items = rows(load(suite.raw))
    if not items:
        print("per_byte: no saved convergence figures; not written")
        return None
    if not suite.quick:
        for page in pages(suite.root):
            page.write_text(readme_block(page.read_text(), which_md(items)))
    return Section(per_byte_md(items))


__all__ = ["pages", "per_byte", "per_byte_md", "readme_block", "rows", "which_md"]
