"""Helpers shared by the benchmarks: timing, machine description, Markdown tables."""

from __future__ import annotations

import argparse
import logging
import os
import platform
import statistics
import sys
import time
import warnings
from collections.abc import Callable, Sequence
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import torch


def time_call(fn: Callable[[], Any], repeats: int, warmup: int = 1) -> list[float]:
    """Seconds per call of ``fn`` for ``repeats`` calls, after ``warmup`` untimed calls."""
    for _ in range(warmup):
        fn()
    out = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        out.append(time.perf_counter() - start)
    return out


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


def command(module: str) -> str:
    """The command line that reproduces this run."""
    return " ".join(["python -m", module, *sys.argv[1:]])


def table(headers: Sequence[str], rows: Sequence[Sequence[Any]]) -> str:
    """A GitHub-flavoured Markdown table (floats already formatted by the caller)."""
    lines = [
        "| " + " | ".join(headers) + " |",
        "|" + "|".join("---" for _ in headers) + "|",
    ]
    lines += ["| " + " | ".join(str(c) for c in row) + " |" for row in rows]
    return "\n".join(lines)


def import_galore_torch() -> Any:
    """``galore_torch`` (it imports bitsandbytes, whose CPU-kernel notices are silenced)."""
    log = logging.getLogger("bitsandbytes")
    level = log.level
    log.setLevel(logging.ERROR)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            import galore_torch
    finally:
        log.setLevel(level)
    return galore_torch


def arg_parser(doc: str | None) -> argparse.ArgumentParser:
    """An argument parser with the options every benchmark takes (``--quick``, ``--threads``)."""
    p = argparse.ArgumentParser(
        description=(doc or "").splitlines()[0],
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--quick", action="store_true", help="small sizes, for smoke tests only")
    p.add_argument(
        "--threads", type=int, default=None, help="torch.set_num_threads (default: torch's own)"
    )
    return p


def setup(args: argparse.Namespace) -> None:
    if args.threads:
        torch.set_num_threads(args.threads)


def llama(size: dict[str, int], device: str | None = None) -> torch.nn.Module:
    """An untied ``transformers.LlamaForCausalLM`` from a size dict (hidden, ffn, layers,
    heads, vocab), built from its config (no hub access); ``device="meta"`` allocates nothing."""
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        hidden_size=size["hidden"],
        intermediate_size=size["ffn"],
        num_hidden_layers=size["layers"],
        num_attention_heads=size["heads"],
        num_key_value_heads=size["heads"],
        vocab_size=size["vocab"],
        tie_word_embeddings=False,
    )
    torch.manual_seed(0)
    with torch.device(device or "cpu"):
        return LlamaForCausalLM(config)


def cli(
    module: str,
    doc: str | None,
    run: Callable[..., dict[str, Any]],
    argv: list[str] | None = None,
    **options: str,
) -> None:
    """The ``main()`` of a benchmark: ``--quick``/``--threads`` plus optional int ``options``
    (name → help, passed to ``run``), then print the command, the machine and the result."""
    parser = arg_parser(doc)
    for name, help_text in options.items():
        parser.add_argument(f"--{name}", type=int, default=None, help=help_text)
    args = parser.parse_args(argv)
    setup(args)
    out = run(quick=args.quick, **{name: getattr(args, name) for name in options})
    print(f"`{command(module)}`\n\n{machine_md()}\n\n{out['markdown']}")
