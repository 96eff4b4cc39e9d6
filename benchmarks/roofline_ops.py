"""Where a step's bytes go: the roofline count of one row, attributed per op.

``python -m benchmarks.roofline_ops [LABEL] [--config llama_350m]`` (a few seconds; LABEL: a
galore2 row of ``benchmarks/roofline.py``, default ``GaLoreAdamW``): the row's step at 2 and 4
layers counted as the roofline counts it (:class:`~benchmarks.roofline.RooflineCounter`,
meta tensors), then per op name and dtype of its first tensor argument: launches, bytes
read and written, matmul GFLOP at 4 layers, and the per-layer increment of its bytes
((4 layers − 2 layers) / 2) — the numbers behind BENCHMARKS.md's per-element account.
"""

from __future__ import annotations

import argparse
import dataclasses
from collections import defaultdict
from typing import Any

from recipes.resolve import parse_args

from . import roofline

#: (launches, bytes read, bytes written, FLOPs) per (op, dtype of its first tensor)
Totals = dict[tuple[str, str], list[int]]


def by_op(label: str, config: str, layers: int) -> Totals:
    """Per (op, first tensor's dtype) totals of row ``label``'s counted step at ``layers``."""
    cfg = parse_args(["--config", config])
    model_cfg = dataclasses.replace(cfg.model, n_layers=layers)
    totals: Totals = defaultdict(lambda: [0, 0, 0, 0])

    class Attributed(roofline.RooflineCounter):
        def launched(self, func: Any, args: tuple, kwargs: dict, out: Any) -> None:
            c = self.counts
            before = (c.read, c.written, sum(c.flops.values()))
            super().launched(func, args, kwargs, out)
            tensors = roofline._tensors(args)
            dtype = roofline._DTYPES.get(tensors[0].dtype, "") if tensors else ""
            t = totals[(func.overloadpacket.__name__, dtype)]
            t[0] += 1
            t[1] += c.read - before[0]
            t[2] += c.written - before[1]
            t[3] += sum(c.flops.values()) - before[2]

    makers = dict(roofline.rows(cfg.optim, projector="svd"))
    if label not in makers:
        raise SystemExit(f"no galore2 row {label!r}; one of: {', '.join(makers)}")
    make = makers[label]
    with roofline.meta_reads():
        model = roofline.build_model(model_cfg, device="meta", dtype=roofline.torch.bfloat16)
        roofline.count_step(make, model, mode=Attributed)
    return totals


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("label", nargs="?", default="GaLoreAdamW")
    ap.add_argument("--config", default="llama_350m")
    args = ap.parse_args()
    lo, hi = (by_op(args.label, args.config, n) for n in roofline.LAYERS)
    span = roofline.LAYERS[1] - roofline.LAYERS[0]
    print(f"{args.label} at {args.config} widths, {roofline.LAYERS[1]} layers "
          "(MB read, MB written, GFLOP; per layer: MB)")  # fmt: skip
    rows = sorted(hi.items(), key=lambda kv: -(kv[1][1] + kv[1][2]))
    for (op, dtype), (n, r, w, f) in rows:
        low = lo.get((op, dtype), [0, 0, 0, 0])
        per = (r + w - low[1] - low[2]) / span
        print(f"{op:>18} {dtype:>4} {n:4d} launches {r / 1e6:9.1f} r {w / 1e6:9.1f} w "
              f"{f / 1e9:7.1f} GF   per layer {per / 1e6:7.1f}")  # fmt: skip


if __name__ == "__main__":
    main()
