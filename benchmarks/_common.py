"""Helpers shared by the benchmarks: machine description, Markdown, tiny-recipe runs (timing: benchmarks/timing.py)."""

from __future__ import annotations

import contextlib
import os
import platform
import re
import statistics
import sys
import tempfile
from collections.abc import Sequence
from datetime import datetime, timezone
from functools import cache
from pathlib import Path
from typing import Any, NamedTuple
from unittest import mock

import torch

from .peers import PEERS, quiet_peers


class Section(NamedTuple):
    """What a task returns to be written: its Markdown ``body`` and an optional ``note``
    that goes between the title and the command (time taken, rows kept from a previous run)."""

    body: str
    note: str = ""


def median(xs: Sequence[float]) -> float:
    return statistics.median(xs)


def cpu_model() -> str:
    """The CPU's model name and its widest x86 vector extension (matmul speed depends on it)."""
    try:
        info = Path("/proc/cpuinfo").read_text()
    except OSError:
        return platform.processor() or "unknown"
    first = info.split("\n\n", 1)[0]  # the first processor's block
    fields = {
        k.strip(): v.strip()
        for k, v in (ln.split(":", 1) for ln in first.splitlines() if ":" in ln)
    }
    name = fields.get("model name", "unknown")
    flags = fields.get("flags", "").split()
    vector = next((f for f in ("avx512f", "avx2", "sse4_2") if f in flags), None)
    return f"{name}, {vector}" if vector else name


def machine() -> dict[str, str]:
    """What the numbers were measured on."""
    return {
        "date": datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
        "platform": platform.platform(),
        "processor": platform.processor() or platform.machine(),
        "cpu_model": cpu_model(),
        "python": platform.python_version(),
        "cpu_count": str(os.cpu_count()),
        "torch": torch.__version__,
        "torch_threads": str(torch.get_num_threads()),
    }


def machine_md() -> str:
    return "\n".join(f"- {k}: `{v}`" for k, v in machine().items())


def command(argv: Sequence[str] | None = None) -> str:
    """The runner's command line that reproduces this run (``argv``: its arguments)."""
    return " ".join(["python -m benchmarks.run", *(sys.argv[1:] if argv is None else argv)])


def table(headers: Sequence[str], rows: Sequence[Sequence[Any]]) -> str:
    """A GitHub-flavoured Markdown table (floats already formatted by the caller)."""
    lines = [
        "| " + " | ".join(headers) + " |",
        "|" + "|".join("---" for _ in headers) + "|",
    ]
    lines += ["| " + " | ".join(str(c) for c in row) + " |" for row in rows]
    return "\n".join(lines)


def import_galore_torch() -> Any:
    """``galore_torch`` (imported under :func:`quiet_peers`)."""
    with quiet_peers():
        import galore_torch
    return galore_torch


TEMPLATES = Path(__file__).with_name("templates")


@cache
def _parts(name: str) -> dict[str, str]:
    """``templates/NAME.md`` split at ``<!-- part: KEY -->`` lines (the first part is "main")."""
    chunks = re.split(
        r"^<!-- part: (\w+) -->\n", (TEMPLATES / f"{name}.md").read_text(), flags=re.M
    )
    parts = {"main": chunks[0]} | dict(zip(chunks[1::2], chunks[2::2], strict=True))
    return {k: v.removesuffix("\n") for k, v in parts.items()}


def render(name: str, part: str = "main", **fields: Any) -> str:
    """A prose template of ``benchmarks/templates`` with its ``{placeholders}`` filled."""
    return _parts(name)[part].format(**fields)


def tiny_run(
    optimizer: str,
    lr: str,
    flags: Sequence[str] = (),
    steps: int | None = None,
    out: Path | None = None,
    config: str = "tiny",
    evals: int = 2,
) -> list[dict[str, Any]]:
    """One run of the README's tiny recipe in this process
    (``python -m recipes.pretrain --config tiny --optimizer OPTIMIZER --optim.lr LR``); its
    metrics history. ``steps``: another run length, evaluated ``evals`` times (twice);
    ``out``: keep its files there (default: a temporary directory); ``config``: another
    recipe config (``recipes/configs/CONFIG.toml``)."""
    from recipes.pretrain import main as pretrain

    if out is None:
        with tempfile.TemporaryDirectory() as tmp:
            return tiny_run(optimizer, lr, flags, steps, Path(tmp), config, evals)
    # An lr sweep's diverging point runs to the end (its rows count the skipped updates,
    # ``nonfinite_skips``) instead of stopping the whole benchmark.
    argv = ["--config", config, "--optimizer", optimizer, "--optim.lr", lr, "--out", str(out),
            "--train.progress", "false", "--train.max_skip_steps", "0", *flags]  # fmt: skip
    if steps:
        argv += ["--steps", str(steps), "--train.eval_every", str(max(1, steps // evals))]
    return pretrain(argv, PEERS)


def val_losses(history: list[dict[str, Any]]) -> list[float]:
    return [r["val_loss"] for r in history if "val_loss" in r]


#: the parts of the default path a GPU session's A/B rows turn off (:func:`variant`)
VARIANTS = ("", "stacked", "synced")


def variant(name: str) -> contextlib.AbstractContextManager:
    """The default path with one part off while a row runs, as a GPU session compares them:
    ``"stacked"`` — every GaLore shape batch stacked (its gradients copied into one stack and
    projected by one ``bmm``, the dense updates applied by foreach kernels), the path where
    the grouped kernels do not run (:func:`galore2.optim.lowrank_batch.along_data` told that
    they do not); ``"synced"`` — every step reads its own non-finite flags
    (:mod:`galore2.core.deferred` off: ``DEVICES`` without CUDA); ``""`` — the default."""
    if name not in VARIANTS:
        raise ValueError(f"variant {name!r}: one of {VARIANTS}")
    if name == "stacked":
        from galore2.optim import lowrank_batch

        return mock.patch.object(lowrank_batch, "grouped_would_run", lambda u: False)
    if name == "synced":
        from galore2.core import deferred

        return mock.patch.object(deferred, "DEVICES", deferred.DEVICES - {"cuda"})
    return contextlib.nullcontext()
