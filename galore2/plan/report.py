"""A plan's rows with what they were computed for, as Markdown text or JSON."""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from .planner import OPTIMIZERS, Row
from .units import UNITS, format_budget, format_size

__all__ = ["Report"]

_NOTES = (
    "State: galore2 rows measured (init_state() on the meta device: every state tensor "
    "at its final shape; moments fp32 or 8-bit + fp32 absmax per 256, bases fp32 or "
    "INT8/INT4 codes + scales); AdamW counted (two moments in the parameter dtype + a step "
    "per tensor: on the device for fused, the CPU for foreach); AdamW 8-bit counted by "
    "bitsandbytes 0.50.2's rules (uint8 moments "
    "+ fp32 absmax per 256 elements, fp32 below 4096 elements). Embeddings and the output "
    "head stay full rank in every GaLore optimizer; APOLLO-Mini projects at rank 1 (its "
    "definition), Ranger21 at full rank.",
    "Weights, gradients, activations: the formulas of galore2.plan.formulas. Per-layer "
    "updates keep one gradient alive (torch optimizers need a per-parameter optimizer "
    "in a post-accumulate-grad hook for that; galore2 has galore2.per_layer).",
    "Step: measured by running two optimizer steps (a GaLore refresh and an ordinary step) "
    "on the meta device and counting the bytes alive (galore2.plan.step): 'step cache' is "
    "kept between steps beyond the state, 'step temp.' is the step's own peak above that "
    "(foreach AdamW: one temporary the size of every parameter; fused AdamW: none; "
    "galore2: its torch path, an upper bound where its Triton 8-bit kernel runs). Per-layer "
    "rows: the largest one parameter's step. The step's temporaries and the activation "
    "peak are not alive together: total = weights + grads + state + step cache + the "
    "larger of activations and step temp. FSDP world size > 1: the step's bytes / W (an "
    "estimate). AdamW 8-bit: 0 (its kernels update in place; not measured).",
    "Not counted: CUDA context and allocator fragmentation (~1-2 GB), FSDP2's prefetch "
    "of the next layer.",
)


def count(n: int) -> str:
    """A parameter count as ``6.74B`` or ``0.9M``."""
    return f"{n / 1e9:.2f}B" if n >= 1e9 else f"{n / 1e6:.1f}M"


def _unit(unit: str) -> str:
    """``GB (1e9 bytes)``, ``GiB (2^30 bytes)``, ``B``."""
    n = UNITS[unit.lower()]
    if n == 1:
        return unit
    return f"{unit} ({f'2^{n.bit_length() - 1}' if 'i' in unit else f'1e{len(str(n)) - 1}'} bytes)"


@dataclass(frozen=True)
class Report:
    """Rows of :func:`~galore2.plan.planner.plan` and the setup they were computed for."""

    rows: list[Row]
    label: str  # the CONFIG as given
    model: str  # model class name
    n_params: int
    dtype: str  # parameter dtype, e.g. "bfloat16"
    batch_size: int
    seq_len: int
    grad_accum: int
    rank: int
    targets: str  # the projected modules, described
    gpu_memory: int  # bytes
    unit: str = "GB"  # display unit, a key of UNITS in any case (the budget's)
    projected: int | None = None  # weights GaLore projects (None: not counted)

    def header(self) -> str:
        """One paragraph: the model and the settings."""
        u = self.unit
        return (
            f"Memory plan for {self.label}: {self.model}, {count(self.n_params)} "
            f"parameters in {self.dtype}; batch {self.batch_size} × seq {self.seq_len} per "
            f"GPU, gradient accumulation {self.grad_accum}; {self.galore()}. Sizes in "
            f"{_unit(u)} per GPU; GPU memory "
            f"{format_size(self.gpu_memory, u, 1)} {u}."
        )

    def galore(self) -> str:
        """What GaLore projects: ``GaLore rank 1024 on … (224 matrices)``, or plainly that
        nothing is projected."""
        if self.projected == 0:
            return (f"GaLore projects nothing: {self.targets} selects no weight, so every "
                    "GaLore row is its optimizer at full rank")  # fmt: skip
        count = "" if self.projected is None else f" ({self.projected} matrices)"
        return f"GaLore rank {self.rank} on {self.targets}{count}"

    def table(self, world: int) -> str:
        """The Markdown table of world size ``world``."""
        u, budget = self.unit, self.gpu_memory
        fit = f"fits {format_budget(budget, u)} {u}"
        head = ["optimizer", "per-layer", "act. ckpt", "weights", "grads", "state",
                "step cache", "activations", "step temp.", "total", fit]  # fmt: skip
        lines = ["| " + " | ".join(head) + " |", "|---" * 3 + "|--:" * 7 + "|---|"]
        for r in (r for r in self.rows if r.world_size == world):
            sizes = [r.weights, r.gradients, r.state, r.held, r.activations, r.step, r.total]
            verdict = "yes" if r.fits(budget) else f"no (+{format_size(r.total - budget, u)})"
            cells = [OPTIMIZERS[r.optimizer].label, "on" if r.per_layer else "off",
                     "on" if r.checkpointing else "off",
                     *(format_size(n, u) for n in sizes), verdict]  # fmt: skip
            lines.append("| " + " | ".join(cells) + " |")
        return "\n".join(lines)

    def worlds(self) -> list[int]:
        """The FSDP world sizes planned, in order."""
        return list(dict.fromkeys(r.world_size for r in self.rows))

    def text(self) -> str:
        """Header, one table per world size with a count of what fits, and notes."""
        out = [self.header()]
        for w in self.worlds():
            rows = [r for r in self.rows if r.world_size == w]
            n = sum(r.fits(self.gpu_memory) for r in rows)
            out += ["", f"**FSDP world size {w}** ({n} of {len(rows)} fit)", "", self.table(w)]
        return "\n".join([*out, "", "Notes:", "", *(f"- {x}" for x in _NOTES)])

    def to_json(self) -> str:
        """Everything as JSON (sizes in bytes; each row with its total and verdict)."""
        setup: dict[str, Any] = {k: v for k, v in self.__dict__.items() if k != "rows"}
        rows = [{**r.to_dict(), "fits": r.fits(self.gpu_memory)} for r in self.rows]
        return json.dumps({**setup, "rows": rows}, indent=2)
