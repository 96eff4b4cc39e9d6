"""Host time of one ``galore2::adamw_`` call through ``torch.library``'s op against the
direct call galore2 makes in plain eager mode (:mod:`galore2.kernels.direct`).

``python -m benchmarks.op_overhead [--weights N] [--calls N]``: a plain group of ``N``
bf16 weights of 4 elements with float32 moments on the CPU (the torch passes run inside;
the work is negligible next to the dispatch), each variant called ``--calls`` times,
interleaved, under ``torch.no_grad()`` at one thread; the median host time per call of
each: the op, the direct call, and the implementation alone. 51 weights are Llama-350M's
plain group (embeddings, head, 49 norms).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time

import torch

from galore2.kernels import ops


def measure(weights: int = 51, calls: int = 400) -> dict[str, float]:
    """Median seconds per call of each variant (see the module docstring)."""
    torch.set_num_threads(1)
    lists = (
        [torch.zeros(4, dtype=torch.bfloat16) for _ in range(weights)],
        [torch.zeros(4, dtype=torch.bfloat16) for _ in range(weights)],
        [torch.zeros(4) for _ in range(weights)],
        [torch.zeros(4) for _ in range(weights)],
    )
    args = (*lists, 3, 1e-3, 0.9, 0.999, 1e-8, 1.0)
    variants = {"through the op": ops.adamw_op, "direct (galore2's call)": ops.adamw_,
                "implementation alone": ops._adamw}  # fmt: skip
    times: dict[str, list[float]] = {k: [] for k in variants}
    with torch.no_grad():
        for f in variants.values():
            for _ in range(20):
                f(*args)
        for _ in range(calls):
            for label, f in variants.items():
                start = time.perf_counter()
                f(*args)
                times[label].append(time.perf_counter() - start)
    return {k: statistics.median(v) for k, v in times.items()}


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    p.add_argument("--weights", type=int, default=51)
    p.add_argument("--calls", type=int, default=400)
    args = p.parse_args(argv)
    res = measure(args.weights, args.calls)
    print(f"galore2::adamw_ over {args.weights} weights, torch {torch.__version__}, "
          f"median of {args.calls} interleaved calls")  # fmt: skip
    for label, s in res.items():
        print(f"| {label} | {s * 1e6:.0f} µs |")


if __name__ == "__main__":
    main(sys.argv[1:])
