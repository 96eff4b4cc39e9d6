"""Host time of the step as it runs on CUDA, measured on the CPU: the kernels stubbed.

``python -m benchmarks.gpu_host [--rows LABEL ...] [--rounds N] [--profile LABEL]``

On an H200 galore2's step was host-bound (BENCHMARKS.md, "GPU session": GaLoreAdamW 6.59
ms a step on 3.17 ms of device time), and the path it takes there — galore2's fused ops,
the grouped kernels along the data, the deferred flags — is not the CPU's. This runs that
path on the CPU: Triton's interpreter stands for CUDA (``GALORE2_KERNELS=triton``, the
fused ops' and the deferred flags' device lists extended to the CPU, 8-bit moments on the
kernel's stacks), and every Triton launch returns at once (``InterpretedFunction.run``
stubbed: no kernel runs, its outputs keep what they held). What is left is the host's part
of a CUDA step — galore2's Python (planning, checks, tables, the chain), torch's dispatch
of the eager ops that stay (the non-finite check's norm, copies of the flags, views) —
without the launches' own cost (about 25 µs each through Triton's launcher on an H200
machine: ``kernels`` × that is printed beside it).

The model is the overhead task's 24-layer Llama with hidden size 64 (bf16 weights, 168
projected matrices at rank 16, no refresh after the first step), so the eager ops that run
for real cost next to nothing. Each row: the median host time of a non-refresh
``opt.step()`` over interleaved rounds, and torch ``AdamW(fused=True)`` on the same model
in the same process (on the CPU: its CPU kernel, a few hundred µs). ``--profile LABEL``
prints the row's cProfile (galore2's own functions by self time).
"""

from __future__ import annotations

import argparse
import contextlib
import cProfile
import json
import os
import pstats
import subprocess
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from unittest import mock

import torch

from ._common import median, table
from ._common import render as render_md
from .overhead import DEEP
from .step_counts import contender_maker
from .timing import llama, time_steps

#: (label, contender key, extra galore2 options)
ROWS: tuple[tuple[str, str, dict], ...] = (
    ("GaLoreAdamW", "galore_adamw", {}),
    ("GaLoreAdamW8bit", "galore_adamw8bit", {}),
    ("APOLLO", "galore2_apollo", {}),
    ("Fira", "galore2_fira", {}),
)
ROUNDS, STEPS, WARMUP = 10, 5, 3
PROCESSES = 3
BASELINE = "torch AdamW (fused)"
LAUNCH_S = 25e-6  # the host's time per eager launch measured on an H200 machine


@contextlib.contextmanager
def cuda_path() -> Iterator[list[int]]:
    """The CUDA path on CPU tensors, every Triton launch stubbed; yields a one-item list
    counting the launches stubbed. Triton's interpreter must be on (``TRITON_INTERPRET=1``
    before galore2's kernel modules are imported: :func:`main` sets it)."""
    if os.environ.get("TRITON_INTERPRET") != "1":
        raise RuntimeError("benchmarks.gpu_host needs TRITON_INTERPRET=1 set before triton loads")
    import triton.runtime.interpreter as interp

    from galore2 import _numerics
    from galore2.core import deferred
    from galore2.kernels import ops, tables
    from galore2.storage import dynamic8

    launches = [0]

    def stub(self, *args, **kwargs):
        launches[0] += 1

    tables.clear()
    with (
        mock.patch.dict(os.environ, {"GALORE2_KERNELS": "triton"}),
        mock.patch.object(interp.InterpretedFunction, "run", stub),
        mock.patch.object(ops, "FUSED_OP_DEVICES", ("cpu", "cuda", "meta")),
        mock.patch.object(deferred, "DEVICES", frozenset({"cpu", "cuda", "meta"})),
        mock.patch.object(dynamic8, "use_torch", lambda t: False),
        # no kernel wrote the projections the check reads: every gradient reads as usable
        mock.patch.object(_numerics, "host_list", lambda t: [True] * t.numel()),
    ):
        yield launches


def _model() -> torch.nn.Module:
    model = llama(DEEP).to(torch.bfloat16)
    gen = torch.Generator().manual_seed(1)
    for p in model.parameters():
        p.grad = (torch.randn(p.shape, generator=gen) * 1e-2).to(torch.bfloat16)
    return model


def _fused(model: torch.nn.Module) -> torch.optim.Optimizer:
    return torch.optim.AdamW(model.parameters(), fused=True)


def makers(labels: list[str] | None = None) -> dict[str, Callable]:
    """torch's fused AdamW first, then the chosen rows (galore2 as the recipe builds it,
    ``foreach`` left to its default: batched off the CPU, here forced by the patches)."""
    out: dict[str, Callable] = {BASELINE: _fused}
    for label, key, options in ROWS:
        if labels is None or label in labels:
            out[label] = contender_maker(key, foreach=True, **options)
    return out


def measure(labels: list[str] | None = None, rounds: int = ROUNDS) -> dict[str, dict]:
    """Per row: median host seconds of a step, stubbed launches per step, skips seen."""
    chosen = makers(labels)
    counts: dict[str, dict] = {}
    with cuda_path() as launches, torch.no_grad():
        torch.set_num_threads(1)
        steps = {}
        for label, make in chosen.items():
            opt = make(_model())
            steps[label] = opt
        builders = {label: (lambda opt=opt: opt.step) for label, opt in steps.items()}
        times = time_steps(builders, rounds, STEPS, WARMUP)
        for label, opt in steps.items():
            before = launches[0]
            opt.step()
            counts[label] = {
                "seconds": median(times[label]),  # type: ignore[arg-type]
                "launches": launches[0] - before,
                "skips": getattr(opt, "nonfinite_skips", 0),
            }
    return counts


def profile(label: str, steps: int = 20) -> str:
    """cProfile of ``steps`` steps of row ``label``: galore2's functions by self time."""
    with cuda_path(), torch.no_grad():
        torch.set_num_threads(1)
        opt = makers([label])[label](_model())
        for _ in range(WARMUP):
            opt.step()
        pr = cProfile.Profile()
        pr.enable()
        for _ in range(steps):
            opt.step()
        pr.disable()
    stats = pstats.Stats(pr).stats  # type: ignore[attr-defined]
    total = sum(v[2] for v in stats.values()) / steps
    own = sorted(((v[2], k) for k, v in stats.items() if "/galore2/" in k[0]), reverse=True)
    lines = [f"{label}: {1e3 * total:.2f} ms profiled a step, galore2's own "
             f"{1e3 * sum(t for t, _ in own) / steps:.2f} ms"]  # fmt: skip
    for t, (path, line, name) in own[:25]:
        lines.append(f"  {1e3 * t / steps:6.3f} ms  {path.split('galore2/', 1)[-1]}:{line} {name}")
    return "\n".join(lines)


def render(counts: dict[str, dict]) -> str:
    base = counts[BASELINE]["seconds"]
    head = "| optimizer | host ms a step | launches | + launches × 25 µs | skips |"
    rows = [head, "|---|---|---|---|---|"]
    for label, c in counts.items():
        ms = 1e3 * c["seconds"]
        rows.append(f"| {label} | {ms:.2f} | {c['launches']} | "
                    f"{ms + 1e3 * LAUNCH_S * c['launches']:.2f} | {c['skips']} |")  # fmt: skip
    return "\n".join(rows) + f"\n\n(torch fused AdamW's CPU step: {1e3 * base:.2f} ms)"


def gpu_host(quick: bool = False, rounds: int | None = None, processes: int | None = None) -> str:
    """The runner's task (``python -m benchmarks.run --tasks gpu_host``): :func:`measure`
    in ``processes`` fresh interpreters one after another (3; the interpreter switched on
    before triton loads), each row's median and range over them."""
    processes = processes or (1 if quick else PROCESSES)
    rounds = rounds or (1 if quick else ROUNDS)
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    runs = []
    for _ in range(processes):
        out = subprocess.run(
            [sys.executable, "-m", "benchmarks.gpu_host", "--json", "--rounds", str(rounds)],
            cwd=Path(__file__).resolve().parents[1], env=env, capture_output=True, text=True,
            check=True,
        )  # fmt: skip
        runs.append(json.loads(out.stdout.strip().splitlines()[-1]))
    labels = [label for label in runs[0] if label != BASELINE]
    ms = {label: sorted(1e3 * r[label]["seconds"] for r in runs) for label in labels}
    ref = median(ms["GaLoreAdamW"])
    rows = []
    for label in labels:
        mid, launches = median(ms[label]), runs[0][label]["launches"]
        spread = f" [{ms[label][0]:.2f}–{ms[label][-1]:.2f}]" if len(ms[label]) > 1 else ""
        rows.append([label, f"{mid:.2f}{spread}", f"{mid / ref:.2f}×", launches,
                     f"{mid + 1e3 * LAUNCH_S * launches:.2f}"])  # fmt: skip
    head = ["optimizer", "host ms a step", "÷ GaLoreAdamW", "Triton launches (stubbed)",
            "+ launches × 25 µs"]  # fmt: skip
    return render_md("gpu_host", layers=DEEP.n_layers, hidden=DEEP.dim, rounds=rounds,
                     steps=STEPS, processes=processes, table=table(head, rows))  # fmt: skip


def main(argv: list[str] | None = None) -> None:
    if "triton" not in sys.modules:  # the kernels are decorated as triton loads
        os.environ["TRITON_INTERPRET"] = "1"
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", nargs="*", default=None, help="row labels (default: all)")
    ap.add_argument("--rounds", type=int, default=ROUNDS)
    ap.add_argument("--profile", default=None, help="print this row's profile instead")
    ap.add_argument("--json", action="store_true", help="print the measurement as JSON")
    args = ap.parse_args(argv)
    if args.profile:
        print(profile(args.profile))
        return
    counts = measure(args.rows, args.rounds)
    print(json.dumps(counts) if args.json else render(counts))


if __name__ == "__main__":
    main()
