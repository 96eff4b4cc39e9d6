"""Host overhead of a step: the CPU proxies of issue 27 (what a launch-bound GPU feels).

``python -m benchmarks.run --tasks overhead [--rounds N]`` (a few minutes on a 2-core CPU):

* **host time** — the median host time of one non-refresh ``opt.step()`` on a 24-layer Llama
  with hidden size 64 (``recipes.model.build_model``: 219 parameters, 168 projected matrices
  at rank 16, ``update_proj_gap`` 10**9; the math vanishes, dispatch remains), as a ratio to
  ``torch.optim.AdamW(foreach=True)`` on the same model in the same process. Steps are timed
  one by one in interleaved rounds (:func:`benchmarks.timing.time_steps`), so background load
  hits every optimizer alike; each optimizer on its own copy of the model, fixed seeded
  gradients, two untimed warm-up steps each. The whole measurement runs in several fresh
  processes one after another (``--processes``, 3): one process's ratio depends on where its
  allocations landed — the same code read 0.99× in one process and 1.32× in the next on the
  2-core CPU (GaLoreMuon, 2026-11-26), steady within each — so the table gives the median of
  the processes' ratios and their range.
* **kernels** — device kernels of one non-refresh step on the tiny recipe's model (4 layers,
  hidden 128, 28 projected matrices): :func:`benchmarks.step_counts.count_step`'s
  ``launches`` (non-view ops on floating-point tensors; host step counters excluded), and the
  budget of issue 27: 3 × torch AdamW (foreach)'s + 3 per projected matrix.

Every galore2 optimizer is built by the recipe (:func:`benchmarks.step_counts.contender_maker`)
with ``foreach=True`` (the batched path, the default off the CPU); GaLoreAdamW also with
``capturable=True`` (device-side non-finite decisions).

``python -m benchmarks.overhead [--rounds N] [--keys KEY ...] [--no-time]`` prints the same
table for chosen contender keys (``--no-time``: kernel counts only).
"""

from __future__ import annotations

import argparse
import multiprocessing
import warnings
from collections.abc import Callable

import torch

from recipes.config import ModelConfig

from ._common import median, render, table
from .contenders import BY_KEY, why_not
from .peers import quiet_peers
from .step_counts import contender_maker, count_step, tiny_model
from .timing import llama, seeded_grads, time_steps

DEEP = ModelConfig(vocab_size=256, dim=64, n_layers=24, n_heads=4, ffn_dim=172, max_seq_len=64)
QUICK_DEEP = ModelConfig(vocab_size=256, dim=64, n_layers=2, n_heads=4, ffn_dim=172)
WARMUP = 2
ROUNDS, STEPS = 15, 5
PROCESSES = 3
TINY_PROJECTED = 28  # the tiny model's attention/MLP matrices

#: (label, contender key, extra galore2 options); torch AdamW (foreach) is the baseline
ROWS: tuple[tuple[str, str, dict], ...] = (
    ("galore-torch GaLoreAdamW", "gt_galore_adamw", {}),
    ("GaLoreAdamW, foreach=True", "galore_adamw", {"foreach": True}),
    ("GaLoreAdamW, foreach=True, capturable=True", "galore_adamw",
     {"foreach": True, "capturable": True}),
    ("GaLoreAdamW8bit, foreach=True", "galore_adamw8bit", {"foreach": True}),
    ("GaLoreAdafactor, foreach=True", "galore_adafactor", {"foreach": True}),
    ("Fira, foreach=True", "galore2_fira", {"foreach": True}),
    ("APOLLO, foreach=True", "galore2_apollo", {"foreach": True}),
    ("APOLLO-Mini, foreach=True", "galore2_apollo_mini", {"foreach": True}),
    ("GaLoreMuon, foreach=True", "galore2_muon", {"foreach": True}),
    ("Ranger21, foreach=True", "ranger21", {"foreach": True}),
    ("GaLoreRanger21, foreach=True", "galore_ranger21", {"foreach": True}),
)  # fmt: skip

Maker = Callable[[torch.nn.Module], torch.optim.Optimizer]


def adamw(model: torch.nn.Module) -> torch.optim.Optimizer:
    return torch.optim.AdamW(model.parameters(), foreach=True)


def makers(keys: tuple[str, ...] | None = None) -> dict[str, Maker]:
    """The baseline first, then every row whose package is installed."""
    out: dict[str, Maker] = {"torch AdamW (foreach)": adamw}
    for label, key, options in ROWS:
        if (keys is None or key in keys) and why_not(key) is None and key in BY_KEY:
            out[label] = contender_maker(key, **options)
    return out


def deep_model(quick: bool = False) -> torch.nn.Module:
    return llama(QUICK_DEEP if quick else DEEP)


def host_ratios(
    chosen: dict[str, Maker], quick: bool = False, rounds: int | None = None
) -> dict[str, float]:
    """Median ``step()`` seconds of each optimizer ÷ the first one's, interleaved rounds."""

    def build(make: Maker) -> Callable[[], object]:
        model = deep_model(quick)  # one model each: no optimizer sees another's weights
        seeded_grads(model)
        return make(model).step

    builders = {label: (lambda make=make: build(make)) for label, make in chosen.items()}
    rounds = rounds or (2 if quick else ROUNDS)
    times = time_steps(builders, rounds, 2 if quick else STEPS, WARMUP)
    base = median(next(iter(times.values())))
    return {label: median(ts) / base for label, ts in times.items()} | {"_base_s": base}


def _ratios_here(
    labels: list[str], quick: bool, rounds: int | None, threads: int
) -> dict[str, float]:
    """:func:`host_ratios` of the rows ``labels`` (the baseline first), in this process."""
    torch.set_num_threads(threads)
    with quiet_peers():
        chosen = {label: make for label, make in makers().items() if label in labels}
        return host_ratios(chosen, quick, rounds)


def fresh_ratios(
    labels: list[str], quick: bool, rounds: int | None, processes: int
) -> dict[str, list[float]]:
    """Each row's host-time ratio in each of ``processes`` fresh interpreters (``spawn``),
    run one after another (never two at once: they would share the cores), with this
    process's torch thread count; ``"_base_s"``: the baseline's seconds in each."""
    threads = torch.get_num_threads()
    if processes <= 1:
        return {k: [v] for k, v in _ratios_here(labels, quick, rounds, threads).items()}
    out: dict[str, list[float]] = {}
    context = multiprocessing.get_context("spawn")
    for _ in range(processes):
        with context.Pool(1) as pool:
            got = pool.apply(_ratios_here, (labels, quick, rounds, threads))
        for k, v in got.items():
            out.setdefault(k, []).append(v)
    return out


def kernel_counts(chosen: dict[str, Maker]) -> dict[str, tuple[int, int]]:
    """(launches, of them matmuls) of one non-refresh step on the tiny model."""
    out = {}
    for label, make in chosen.items():
        c = count_step(make, tiny_model())
        out[label] = (c.launches, c.matmuls)
    return out


def _spread(values: list[float]) -> str:
    """``1.23×`` (one process) or ``1.23× (1.10–1.31)``: the median and the range."""
    mid = f"{median(values):.2f}×"
    return mid if len(values) == 1 else f"{mid} ({min(values):.2f}–{max(values):.2f})"


def overhead(quick: bool = False, rounds: int | None = None, processes: int | None = None) -> str:
    processes = processes or (1 if quick else PROCESSES)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        chosen = makers()
        ratios = fresh_ratios(list(chosen), quick, rounds, processes)
        kernels = kernel_counts(chosen)
    base_ms = 1e3 * median(ratios.pop("_base_s"))
    ref = kernels["torch AdamW (foreach)"][0]
    budget = 3 * ref + 3 * TINY_PROJECTED
    rows = [
        [label, _spread(ratios[label]), launches, matmuls,
         "yes" if launches <= budget else "no"]
        for label, (launches, matmuls) in kernels.items()
    ]  # fmt: skip
    head = ["optimizer", "host time ÷ AdamW (foreach)", "kernels / step", "of them matmuls",
            f"kernels ≤ {budget}"]  # fmt: skip
    cfg = QUICK_DEEP if quick else DEEP
    return render("overhead", layers=cfg.n_layers, hidden=cfg.dim, base_ms=base_ms,
                  rounds=rounds or (2 if quick else ROUNDS), steps=2 if quick else STEPS,
                  threads=torch.get_num_threads(), ref=ref, budget=budget,
                  processes=processes, table=table(head, rows))  # fmt: skip


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=ROUNDS)
    ap.add_argument("--keys", nargs="*", default=None, help="contender keys (default: every row)")
    ap.add_argument("--no-time", action="store_true", help="kernel counts only")
    ap.add_argument(
        "--processes",
        type=int,
        default=1,
        help="fresh processes to time in, one after another (median, range)",
    )
    args = ap.parse_args(argv)
    with quiet_peers():
        chosen = makers(tuple(args.keys) if args.keys else None)
        ratios = {} if args.no_time else fresh_ratios(list(chosen), False, args.rounds,
                                                      args.processes)  # fmt: skip
        kernels = kernel_counts(chosen)
    base = 1e3 * median(ratios.pop("_base_s", [0.0]))
    print(f"threads {torch.get_num_threads()}; AdamW step {base:.2f} ms")
    print("| optimizer | launches | of them matmuls | host time ÷ AdamW |")
    print("|---|---|---|---|")
    for label, (n, mm) in kernels.items():
        r = ratios.get(label)
        print(f"| {label} | {n} | {mm} | {'' if r is None else _spread(r)} |")


if __name__ == "__main__":
    main()
