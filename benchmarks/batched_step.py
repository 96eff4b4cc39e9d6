"""The batched (foreach) path of every update rule: kernels per step and host time per step.

    python -m benchmarks.batched_step [--rounds N] [--keys KEY ...]

* **launches** — :func:`benchmarks.step_counts.count_step` of one non-refresh step of each
  preset (``foreach=True``) on the tiny recipe model (4-layer Llama, hidden 128, 28
  matrices projected at rank 16), next to torch AdamW (foreach) over the same groups, and
  the issue-27 budget ``3 × AdamW's + 3 per projected matrix``;
* **host time** — the median ``opt.step()`` time on a 24-layer Llama of hidden size 64 (219
  parameters: the math is negligible, the step is its host overhead), relative to
  ``torch.optim.AdamW(foreach=True)`` in the same process, steps interleaved across
  optimizers in rounds (``benchmarks._common.time_call``), as ``benchmarks.step_time`` does.
"""

from __future__ import annotations

import argparse
import logging
import warnings

import torch

from benchmarks._common import median, time_call
from benchmarks.step_counts import contender_maker, count_step, same_groups_adamw, tiny_model
from benchmarks.step_time import llama

KEYS = ("galore_adamw", "galore_adamw8bit", "galore2_fira", "galore2_apollo",
        "galore2_apollo_mini", "galore2_muon", "galore_adafactor", "galore_ranger21")  # fmt: skip
HOST_SIZE = {"hidden": 64, "ffn": 172, "layers": 24, "heads": 2, "vocab": 256}
PROJECTED = 28  # matrices of the tiny model


def launches(keys: tuple[str, ...]) -> list[tuple[str, int, int, int]]:
    """(key, launches, of them matmuls, budget) per preset, foreach=True."""
    ref = count_step(lambda m: same_groups_adamw(contender_maker("galore_adamw")(m)), tiny_model())
    out = [("torch AdamW (foreach)", ref.launches, ref.matmuls, ref.launches)]
    for key in keys:
        c = count_step(contender_maker(key, foreach=True), tiny_model())
        out.append((key, c.launches, c.matmuls, 3 * ref.launches + 3 * PROJECTED))
    return out


def host_ratios(keys: tuple[str, ...], rounds: int, steps: int = 5) -> dict[str, float]:
    """Median step time ÷ torch AdamW(foreach)'s, per preset (foreach=True)."""
    model = llama(HOST_SIZE)
    gen = torch.Generator().manual_seed(1)
    for p in model.parameters():
        p.grad = torch.randn(p.shape, generator=gen) * 1e-2
    opts = {"adamw": torch.optim.AdamW(model.parameters(), foreach=True)}
    for key in keys:
        opts[key] = contender_maker(key, foreach=True)(model)
    times: dict[str, list[float]] = {k: [] for k in opts}
    for opt in opts.values():
        for _ in range(3):
            opt.step()
    for _ in range(rounds):
        for k, opt in opts.items():
            times[k] += time_call(opt.step, steps, warmup=0)
    base = median(times["adamw"])
    return {k: median(ts) / base for k, ts in times.items()} | {"adamw_ms": 1e3 * base}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=10)
    ap.add_argument("--keys", nargs="*", default=list(KEYS))
    ap.add_argument("--no-time", action="store_true")
    args = ap.parse_args()
    logging.getLogger("bitsandbytes").setLevel(logging.ERROR)
    keys = tuple(args.keys)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        counts = launches(keys)
        ratios = {} if args.no_time else host_ratios(keys, args.rounds)
    print(f"threads {torch.get_num_threads()}; AdamW step {ratios.get('adamw_ms', 0):.2f} ms")
    print("| preset | launches | of them matmuls | budget | host time ÷ AdamW |")
    print("|---|---|---|---|---|")
    for key, n, mm, budget in counts:
        r = ratios.get(key if key in ratios else "adamw")
        print(f"| {key} | {n} | {mm} | {budget} | {'' if r is None else f'{r:.2f}'} |")


if __name__ == "__main__":
    main()
