"""Memory of building the recipe's model: peak RSS growth while building, over the weights' bytes.

    python -m benchmarks.build_memory --config llama_1b --dtype bf16            # one build, JSON
    python -m benchmarks.build_memory --config llama_1b --dtype bf16 --legacy   # the old build
    python -m benchmarks.run --tasks build_memory                               # both, a table

One build per process (peak RSS is a process's high-water mark). The child imports
everything and builds the model once on the meta device first (so imports and lazy
initialization are not counted), resets the high-water mark (``/proc/self/clear_refs``),
reads ``VmRSS``, builds, and reports ``VmHWM − VmRSS(before)`` over the bytes of the built
model's parameters. Before building, glibc's ``malloc`` is given a fixed mmap threshold
(``mallopt``, :func:`_count_live_bytes`): every block over 64 KiB is mapped on allocation and
unmapped on free, so the high-water mark counts live bytes, not freed chunks the allocator
kept (with its default, adaptive threshold those added 15-60 MB, varying with the machine and
its load, to a 0.2 GB build). ``--legacy`` is the build before issue 28: ``LlamaForCausalLM(config)``
in fp32 on the CPU, then cast (``model.to(dtype)``). Linux only (``/proc/self/status``).
The ratio is a count of bytes, not a timing: tests/recipes/test_build.py bounds it.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

from ._common import Section, table

ROOT = Path(__file__).resolve().parents[1]
DTYPES = ("bf16", "fp32")


def _status_kb(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise RuntimeError(f"/proc/self/status has no {field}")


def _count_live_bytes() -> None:
    """glibc only: a fixed mmap threshold of 64 KiB (``M_MMAP_THRESHOLD``, which also turns
    off its adaptive raise), so a freed tensor's pages leave the resident set at once."""
    import ctypes

    m_mmap_threshold = -3  # <malloc.h>
    if not ctypes.CDLL("libc.so.6").mallopt(m_mmap_threshold, 64 * 1024):
        raise RuntimeError("mallopt(M_MMAP_THRESHOLD) refused: peak RSS would count free chunks")


def _reset_peak() -> None:
    """Set this process's VmHWM to its current VmRSS (Linux ≥ 4.0)."""
    Path("/proc/self/clear_refs").write_text("5")


def measure(argv: list[str]) -> dict:
    """One build in this process (see the module docstring); ``argv`` as for ``main``."""
    import torch

    from recipes.model import build_model, llama_config
    from recipes.resolve import parse_args

    p = argparse.ArgumentParser(prog="python -m benchmarks.build_memory")
    p.add_argument("--config", default="llama_1b", help="a recipe config name or TOML file")
    p.add_argument("--dtype", choices=DTYPES, default="bf16")
    p.add_argument("--legacy", action="store_true", help="fp32 build, then cast (before)")
    p.add_argument("--threads", type=int, default=2)
    args, overrides = p.parse_known_args(argv)
    torch.set_num_threads(args.threads)
    cfg = parse_args(["--config", args.config, *overrides]).model
    dtype = {"bf16": torch.bfloat16, "fp32": torch.float32}[args.dtype]
    build_model(cfg, "meta")  # imports and lazy set-up, not counted
    from transformers import LlamaForCausalLM

    _count_live_bytes()
    _reset_peak()
    before = _status_kb("VmRSS")
    start = time.perf_counter()
    torch.manual_seed(0)
    if args.legacy:
        model = LlamaForCausalLM(llama_config(cfg)).to(dtype)
    else:
        model = build_model(cfg, "cpu", dtype=dtype)
    seconds = time.perf_counter() - start
    growth = (_status_kb("VmHWM") - before) * 1024
    from galore2.core.stored import store_of

    weights = sum(  # int8 weights (--model.weight_bits 8): the codes and scales stored
        s.nbytes() if (s := store_of(p)) is not None else p.numel() * p.element_size()
        for p in model.parameters()
    )
    return {
        "config": args.config,
        "dtype": args.dtype,
        "build": "legacy (fp32, then cast)" if args.legacy else "meta, in dtype",
        "params": sum(p.numel() for p in model.parameters()),
        "weights_bytes": weights,
        "peak_growth_bytes": growth,
        "ratio": growth / weights,
        "seconds": seconds,
    }


def run_child(*argv: str, timeout: float = 900) -> dict:
    """``measure`` in a fresh process; its JSON result."""
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "2"}
    cmd = [sys.executable, "-m", "benchmarks.build_memory", *argv]
    done = subprocess.run(
        cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout, check=False
    )
    if done.returncode:
        raise RuntimeError(f"{' '.join(cmd)} failed:\n{done.stderr[-3000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def build_memory(quick: bool) -> Section:
    """The legacy and the meta build of llama_1b (quick: llama_60m), bf16, one process each."""
    config = "llama_60m" if quick else "llama_1b"
    rows = []
    for legacy in (True, False):
        r = run_child("--config", config, "--dtype", "bf16", *(["--legacy"] if legacy else []))
        rows.append([
            r["build"], f"{r['weights_bytes'] / 1e9:.2f}", f"{r['peak_growth_bytes'] / 1e9:.2f}",
            f"{r['ratio']:.2f}×", f"{r['seconds']:.1f}",
        ])  # fmt: skip
    head = ["build", "bf16 weights (GB)", "peak RSS growth (GB)", "growth / weights", "s"]
    note = (
        f"`{config}` built in bf16 on the CPU, each build in its own process "
        "(`python -m benchmarks.build_memory`)."
    )
    return Section(table(head, rows), note)


def main(argv: list[str] | None = None) -> int:
    print(json.dumps(measure(sys.argv[1:] if argv is None else argv)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
