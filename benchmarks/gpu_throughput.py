"""Training throughput of every optimizer on the recipe at Llama-350M shapes (issue 27).

``python -m benchmarks.run --tasks gpu_throughput`` (on a GPU: a few minutes per optimizer):
the recipe (``recipes.pretrain``, in this process) at ``llama_350m`` shapes — 24 layers, dim
1024, the 168 attention/MLP matrices projected at r = 256, bf16 parameters on a GPU — on the
embedded corpus with byte tokens, batch 64 × 256, for ``STEPS`` steps without evaluation::

    --config llama_350m --data.dataset embedded --data.tokenizer byte \\
    --train.eval_batches 0 --train.log_every 1 --steps 30

for torch AdamW (foreach), galore-torch's GaLoreAdamW (when installed) and every galore2
preset; each row is the median ``tokens_per_s`` of steps 4–30, and its ratio to AdamW's in
the same run. The runner skips it without CUDA; :func:`throughput_section` with ``quick``
(or without CUDA) runs the tiny recipe config for a few steps instead (a smoke test, numbers
not meaningful), which the test suite does.
"""

from __future__ import annotations

import statistics
import warnings

import torch

from recipes import optimizers

from ._common import render, table, tiny_run
from .peers import PEERS

#: recipe optimizer names: the baseline first
OPTIMIZERS = ("adamw", "gt_galore_adamw", "galore_adamw", "galore_adamw8bit", "galore_adafactor",
              "fira", "apollo", "apollo_mini", "galore_muon", "ranger21", "galore_ranger21")  # fmt: skip
LRS = {"adamw": "1e-3"}  # the others: GaLore's 1e-2 (the rate does not depend on lr)
FLAGS = ("--data.dataset", "embedded", "--data.tokenizer", "byte", "--train.eval_batches", "0",
         "--train.log_every", "1")  # fmt: skip
STEPS, FIRST = 30, 4  # median of steps FIRST..STEPS
QUICK_STEPS, QUICK_FIRST = 3, 2


def rate(name: str, config: str, steps: int, first: int) -> float:
    """Median tokens/s of steps ``first``..``steps`` of one recipe run."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        history = tiny_run(name, LRS.get(name, "1e-2"), FLAGS, steps, config=config, evals=1)
    return statistics.median(r["tokens_per_s"] for r in history if r["step"] >= first)


def gpu_throughput(quick: bool = False) -> str:
    """The task (``needs_cuda``: the runner skips it without a GPU)."""
    return throughput_section(quick)


def throughput_section(quick: bool = False, names: tuple[str, ...] = OPTIMIZERS) -> str:
    """The section's body for ``names`` (the first is the baseline); the tiny config for a
    few steps with ``quick`` or without CUDA (what the test suite runs)."""
    small = quick or not torch.cuda.is_available()
    config = "tiny" if small else "llama_350m"
    steps, first = (QUICK_STEPS, QUICK_FIRST) if small else (STEPS, FIRST)
    names = tuple(n for n in names if optimizers.available(n, PEERS))
    rates = {n: rate(n, config, steps, first) for n in names}
    base = rates[names[0]]
    rows = [[n, f"{r:,.0f}", f"{r / base:.2f}"] for n, r in rates.items()]
    device = torch.cuda.get_device_name() if torch.cuda.is_available() else "CPU (no CUDA)"
    note = (
        "**Smoke run (tiny config, CPU or `--quick`): not the GPU measurement.**\n\n"
        if small
        else ""
    )
    return note + render("gpu_throughput", config=config, steps=steps, first=first,
                         device=device, flags=" ".join(FLAGS),
                         table=table(["optimizer", "tokens/s", "÷ AdamW"], rows))  # fmt: skip
