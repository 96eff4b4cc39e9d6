"""The project's targets for the side-by-side suite, checked against one run's figures."""

from __future__ import annotations

from typing import Any

from . import per_byte
from ._common import table

OURS_PROJECTED = ("galore_adamw", "galore_adamw_power", "galore_adamw8bit",
                  "galore_adamw8bit_int8", "galore_adamw8bit_int4", "galore_adafactor",
                  "galore_adafactor_int8")  # fmt: skip
LOW_MEMORY = ("galore_adamw8bit_int8", "galore_adamw8bit_int4", "galore_adafactor_int8")
# galore-torch's class for the same algorithm; its GaLoreAdamW where that one cannot run here
# (its GaLoreAdamW8bit is CUDA-only)
COUNTERPART = {"galore_adamw8bit": "gt_galore_adamw8bit",
               "galore_adamw8bit_int8": "gt_galore_adamw8bit",
               "galore_adamw8bit_int4": "gt_galore_adamw8bit",
               "galore_adafactor": "gt_galore_adafactor",
               "galore_adafactor_int8": "gt_galore_adafactor"}  # fmt: skip


def _counterpart(key: str, measured: dict[str, Any]) -> str:
    twin = COUNTERPART.get(key, "gt_galore_adamw")
    return twin if measured.get(twin) else "gt_galore_adamw"


def _per_byte_rows(results: dict[str, Any], labels: dict[str, str]) -> list[list[str]]:
    """Issue 17's targets: the best loss per byte of optimizer state. A: at ≤ 0.35× AdamW's
    7B state galore2's best ≤ every peer's; B: at ≤ 10%, ≤ APOLLO-Mini's and ≤ galore2
    8-bit + INT8 basis' (the best low-memory variant before issue 17)."""
    items = per_byte.rows(results)
    loss = {r["key"]: r["loss"] for r in items}
    rows: list[list[str]] = []
    ours, peer = per_byte.best_within(items, 0.35, True), per_byte.best_within(items, 0.35, False)
    if ours and peer:
        rows.append(["A: at ≤ 0.35× AdamW's 7B state, galore2's best val loss ≤ every peer's",
                     f"{labels[ours['key']]} {ours['loss']:.4f} vs {labels[peer['key']]} "
                     f"{peer['loss']:.4f} ({ours['loss'] / peer['loss']:.3f}×)",
                     _met(ours["loss"] <= peer["loss"])])  # fmt: skip
    ours = per_byte.best_within(items, 0.10, True)
    mini, int8 = loss.get("apollo_mini"), loss.get("galore_adamw8bit_int8")
    if ours and mini is not None and int8 is not None:
        rows.append(["B: at ≤ 10% of AdamW's 7B state, galore2's best ≤ APOLLO-Mini's and ≤ "
                     "galore2 8-bit + INT8 basis'",
                     f"{labels[ours['key']]} {ours['loss']:.4f} vs {mini:.4f} / {int8:.4f}",
                     _met(ours["loss"] <= mini and ours["loss"] <= int8)])  # fmt: skip
    return rows


def _met(ok: bool | None) -> str:
    return "n/a" if ok is None else ("**met**" if ok else "**missed**")


def targets_md(
    results: dict[str, Any], labels: dict[str, str], minutes: float | None = None
) -> str:
    conv = {k: min(r["best"] for r in rs) for k, rs in results["convergence"].items()}
    foot, s7 = results["footprint"], results["state_7b"]
    rows: list[list[str]] = []
    gt = conv.get("gt_galore_adamw")
    if gt is not None and "galore_adamw" in conv:
        ours = conv["galore_adamw"]
        rows.append(["fp32 GaLore best val loss ≤ galore-torch's (same state memory)",
                     f"{ours:.4f} vs {gt:.4f} ({ours / gt:.3f}×)", _met(ours <= gt)])  # fmt: skip
    gt_af = conv.get("gt_galore_adafactor")
    if gt_af is not None and "galore_adafactor" in conv:
        ours = conv["galore_adafactor"]
        rows.append(["GaLoreAdafactor best val loss ≤ galore-torch GaLoreAdafactor's",
                     f"{ours:.4f} vs {gt_af:.4f} ({ours / gt_af:.3f}×)",
                     _met(ours <= gt_af)])  # fmt: skip
    adamw7 = s7.get("adamw")
    for k in LOW_MEMORY:
        if gt is None or k not in conv or not adamw7 or s7.get(k) is None:
            continue
        share = s7[k] / adamw7
        ratio = conv[k] / gt
        rows.append([f"{labels[k]}: ≤ 1.02× galore-torch's loss at ≤ 10% of AdamW's 7B state",
                     f"{ratio:.3f}× loss at {100 * share:.1f}% state",
                     _met(ratio <= 1.02 and share <= 0.10)])  # fmt: skip
    rows += _per_byte_rows(results, labels)
    base, gt_f = foot.get("adamw"), foot.get("gt_galore_adamw")
    for k in OURS_PROJECTED:
        if not foot.get(k) or base is None:
            continue
        step = foot[k]["step_ms"]
        vs_adamw = step / base["step_ms"]
        rows.append([f"{labels[k]}: step ≤ 1.3× AdamW(foreach)'s", f"{vs_adamw:.2f}×",
                     _met(vs_adamw <= 1.3)])  # fmt: skip
        twin = _counterpart(k, foot)
        if foot.get(twin):
            vs_gt = step / foot[twin]["step_ms"]
            rows.append([f"{labels[k]}: step never slower than galore-torch's "
                         f"({labels.get(twin, twin)})", f"{vs_gt:.2f}×",
                         _met(vs_gt <= 1.0)])  # fmt: skip
    if gt_f and gt_f["refresh_ms"]:
        for k in ("galore_adamw", "galore_adamw_power"):
            mine = foot.get(k, {}).get("refresh_ms")
            if mine:
                speedup = gt_f["refresh_ms"] / mine
                rows.append([f"{labels[k]}: refresh ≥ 8× faster than galore-torch's (CPU)",
                             f"{speedup:.1f}× ({mine:.0f} vs {gt_f['refresh_ms']:.0f} ms)",
                             _met(speedup >= 8)])  # fmt: skip
    took = (
        f"(one run of all tasks, {minutes:.1f} minutes)"
        if minutes is not None
        else "(the latest run of each task; see each section's date)"
    )
    return (
        f"Each target from the suite's issue, evaluated on the figures of the sections above "
        f"{took}.\n\n" + table(["target", "measured", "verdict"], rows)
    )
