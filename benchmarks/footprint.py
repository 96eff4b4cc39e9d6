"""Tasks (b) memory and (c) speed: each contender alone in a fresh process on one Llama.

The suite's ``footprint`` task (``python -m benchmarks.run --tasks footprint``) runs, for
every contender, this module's worker in a fresh interpreter (not a runner of its own)::

    python -m benchmarks.footprint KEY [--quick]     # prints one JSON line

Model (``recipes.model.build_model``, fp32, CPU): the recipe's Llama-350M layer shapes
(``llama_350m``: vocab 32000, dim 1024, 16 heads, ffn 2736, untied head) with 4 of its
24 layers — 116M parameters; the projected optimizers get the attention and MLP
matrices at its r = 256 (α = 0.25), everything else full rank, as in the recipe.
``--quick``: vocab 4096, dim 256, 2 layers, ffn 688, r = 64.

The gradients are fixed seeded random tensors (scale 1e-2) assigned once; the
process then takes ``STEPS`` = 3·T + 1 optimizer steps with T = ``GAP`` = 10 and
times each on its own. Reported:

* ``state_bytes`` — optimizer state after the run (galore2's ``state_bytes()``,
  else every tensor the optimizer's state holds, its projector objects included,
  each storage counted once);
* ``peak_rss_delta`` — the process's peak resident memory during the steps minus
  its resident memory just before the first one (Linux: the peak is reset through
  ``/proc/self/clear_refs``), i.e. state plus the step's temporaries;
* ``step_ms`` — median step time over steps 1 … 3T (the first step, which creates
  state, is left out); for projected optimizers the three refresh steps are the
  three slowest of those 30 and ``refresh_ms`` is their mean minus the median
  (the cost of one refresh of every projected matrix).
"""

from __future__ import annotations

import argparse
import gc
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import torch

from recipes.config import ModelConfig
from recipes.metrics import optimizer_state_bytes
from recipes.model import build_model
from recipes.optimizers import build_optimizer

from .contenders import BY_KEY, Contender
from .peers import PEERS, quiet_peers

SIZES = {
    "full": {"vocab_size": 32000, "dim": 1024, "n_layers": 4, "n_heads": 16, "ffn_dim": 2736},
    "quick": {"vocab_size": 4096, "dim": 256, "n_layers": 2, "n_heads": 4, "ffn_dim": 688},
}
RANK = {"full": 256, "quick": 64}
GAP = 10
STEPS = 3 * GAP + 1
ROOT = Path(__file__).resolve().parents[1]


def _status_kb(field: str) -> int | None:
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith(field + ":"):
                return int(line.split()[1])
    except OSError:
        return None
    return None


def _reset_peak() -> bool:
    try:
        Path("/proc/self/clear_refs").write_text("5")
    except OSError:
        return False
    return True


def describe(quick: bool) -> str:
    size = SIZES["quick" if quick else "full"]
    return (
        f"Llama vocab {size['vocab_size']}, dim {size['dim']}, {size['n_layers']} layers, "
        f"ffn {size['ffn_dim']}, untied head, fp32; projected matrices at r = "
        f"{RANK['quick' if quick else 'full']}, T = {GAP}"
    )


def measure(contender: Contender, quick: bool) -> dict[str, Any]:
    """Run the steps in this process and return the figures (see the module docstring)."""
    name = "quick" if quick else "full"
    cfg = ModelConfig(**SIZES[name], max_seq_len=128)
    torch.manual_seed(0)
    model = build_model(cfg)
    gen = torch.Generator().manual_seed(1)
    for p in model.parameters():
        p.grad = torch.randn(p.shape, generator=gen) * 1e-2
    optim_cfg = contender.optim_config(lr=1e-3, rank=RANK[name], update_proj_gap=GAP)
    opt = build_optimizer(model, optim_cfg, STEPS, PEERS)
    gc.collect()
    base_kb = _status_kb("VmRSS")
    peak_ok = _reset_peak()
    times = []
    for _ in range(STEPS):
        start = time.perf_counter()
        opt.step()
        times.append(time.perf_counter() - start)
    peak_kb = _status_kb("VmHWM") if peak_ok else None
    steady = times[1:]
    med = statistics.median(steady)
    refresh = None
    if contender.projected:
        slowest = sorted(steady)[-(len(steady) // GAP) :]
        refresh = 1e3 * (statistics.mean(slowest) - med)
    delta = None if peak_kb is None or base_kb is None else 1024 * (peak_kb - base_kb)
    return {
        "params": sum(p.numel() for p in model.parameters()),
        "state_bytes": optimizer_state_bytes(opt),
        "peak_rss_delta": delta,
        "step_ms": 1e3 * med,
        "first_step_ms": 1e3 * times[0],
        "refresh_ms": refresh,
        "threads": torch.get_num_threads(),
    }


def in_subprocess(key: str, quick: bool, timeout: float = 1800) -> dict[str, Any]:
    """:func:`measure` for ``key`` in a fresh interpreter (so memory figures are its own)."""
    cmd = [sys.executable, "-m", "benchmarks.footprint", key, *(["--quick"] if quick else [])]
    done = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=timeout)
    if done.returncode != 0:
        tail = done.stderr.strip().splitlines()[-1:] or ["(no output)"]
        raise RuntimeError(f"footprint worker for {key!r} failed: {tail[0]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("key", choices=sorted(BY_KEY))
    parser.add_argument("--quick", action="store_true")
    args = parser.parse_args(argv)
    with quiet_peers():
        figures = measure(BY_KEY[args.key], args.quick)
    print(json.dumps(figures))


if __name__ == "__main__":
    main()
