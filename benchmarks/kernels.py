"""Fused Triton kernels (galore2.kernels) vs the torch path on Llama-7B layer shapes (GPU).

Usage (repository root, venv active, a CUDA GPU, triton installed)::

    python -m benchmarks.run --tasks kernels [--repeats 50] [--warmup 10] [--json PATH]

It needs CUDA: without a CUDA device (or without triton) the runner says so and skips it,
writing nothing. ``--quick``: 2 warm-up and 5 timed calls.

Shapes: the 7B model's 4096×4096 (attention) and 11008×4096 / 4096×11008 (MLP) weights
at GaLore rank r = 1024.

* ``adam8bit`` — one 8-bit Adam step on the projected gradient: r×n moments blocked
  along dim 0 (GaLore's left side: 1024×4096, 1024×11008) and m×r moments blocked along
  dim 1 (right side: 4096×1024, 11008×1024); fp32 gradient. Contenders: the torch path
  (``ScaleByAdam8bit.update`` with ``GALORE2_KERNELS=torch``: bitsandbytes' blockwise
  dequantize, ``ScaleByAdam``'s torch ops, bitsandbytes' quantize), the Triton kernel
  (the same call with ``GALORE2_KERNELS=auto``) and bitsandbytes' fused 8-bit blockwise
  Adam (``optimizer_update_8bit_blockwise``, flat blocks of 256) — which also applies
  the update to a parameter of the moments' shape (+8 bytes per element) and returns no
  direction (−4).
* ``lowrank`` — the back-projection ``p ← decay·p − lr·scale·(A @ B)``: p 4096×4096 and
  4096×11008, A p-rows × 1024, B 1024 × p-columns, fp32 (full-precision products:
  TF32 off, torch's default) and bf16. Torch path ``p.addmm_`` (cuBLAS) vs the Triton
  matmul with the update in its epilogue, both through ``apply_update``.
* ``hadamard`` — ``rotate`` and ``unrotate`` of fp32 bases with r = 1024 columns,
  4096 and 11008 rows, blocks of 256 (``basis_group_size``'s default).

Timing (:func:`benchmarks.timing.time_calls`): CUDA events around each call, after
``--warmup`` untimed calls; before each timed call a 256 MiB buffer is zeroed so no input
is served from L2; the median of ``--repeats`` calls is reported. Each call is on the current stream, so the torch path's
several kernels include their launch gaps when the GPU outruns the CPU.

Bandwidth = the bytes the operation must move at least (each input read once, each
output written once; listed per row) / median time — the same byte count for every
contender of an operation, so it is the "effective" bandwidth. ``% copy`` divides it by
the device's measured copy bandwidth (``Tensor.copy_`` of 512 MiB fp32: 1 GiB moved).
For the compute-bound matmul TFLOP/s (2·M·N·K) is the meaningful column.

Before timing, each contender's result is checked against the torch path from the same
inputs (``max |Δ|`` relative to the torch result's max |value|).
"""

from __future__ import annotations

import contextlib
import json
import math
import os
from collections.abc import Callable, Iterator
from typing import Any

import torch

import galore2.kernels

from ._common import machine, median, render, table
from .timing import time_calls

RANK = 1024
LLAMA_7B = ((4096, 4096), (4096, 11008))  # (m, n) of the weights, as GaLore sees them
ADAM_SHAPES = [((RANK, 4096), 0), ((RANK, 11008), 0), ((4096, RANK), 1), ((11008, RANK), 1)]
BASIS_ROWS = (4096, 11008)
HADAMARD_BLOCK = 256
BETAS, EPS = (0.9, 0.999), 1e-8


@contextlib.contextmanager
def kernels_mode(mode: str) -> Iterator[None]:
    """GALORE2_KERNELS=mode inside the block (read by galore2 at every call)."""
    var = galore2.kernels.ENV_VAR
    old = os.environ.get(var)
    os.environ[var] = mode
    try:
        yield
    finally:
        if old is None:
            del os.environ[var]
        else:
            os.environ[var] = old


class Timer:
    """Median seconds of a call on the current CUDA stream (see the module docstring)."""

    def __init__(self, warmup: int, repeats: int, flush_bytes: int = 256 << 20) -> None:
        self.warmup, self.repeats, self.flush_bytes = warmup, repeats, flush_bytes

    def __call__(self, fn: Callable[[], Any]) -> float:
        return median(time_calls(fn, self.repeats, self.warmup, "cuda", self.flush_bytes))


def copy_bandwidth(timer: Timer, nbytes: int = 512 << 20) -> float:
    """Bytes per second of ``dst.copy_(src)`` for nbytes of fp32 (2·nbytes moved)."""
    src = torch.randn(nbytes // 4, device="cuda")
    dst = torch.empty_like(src)
    return 2 * nbytes / timer(lambda: dst.copy_(src))


def _rel_err(got: torch.Tensor, want: torch.Tensor) -> float:
    scale = want.abs().max().item() or 1.0
    return (got.float() - want.float()).abs().max().item() / scale


def _row(op: str, shape: str, impl: str, seconds: float, nbytes: int, copy_bw: float, **extra):
    bw = nbytes / seconds
    return {
        "op": op,
        "shape": shape,
        "impl": impl,
        "us": seconds * 1e6,
        "bytes": nbytes,
        "GB/s": bw / 1e9,
        "% copy": 100 * bw / copy_bw,
        **extra,
    }


# ---- 8-bit Adam -----------------------------------------------------------------------
def bench_adam8bit(timer: Timer, copy_bw: float) -> list[dict[str, Any]]:
    try:
        import bitsandbytes.functional as bnb_f
    except ImportError:
        print("bitsandbytes is not installed: skipping the 8-bit Adam comparison")
        return []
    from galore2.storage import dynamic8 as A8

    transform = galore2.optim.ScaleByAdam8bit()
    group = {"betas": BETAS, "eps": EPS}
    rows = []
    gen = torch.Generator(device="cuda").manual_seed(0)
    for shape, dim in ADAM_SHAPES:
        numel = math.prod(shape)
        blocks = math.prod(A8.absmax_shape(shape, dim))
        g = torch.randn(shape, device="cuda", generator=gen)

        def fresh(shape=shape, dim=dim, g=g) -> dict[str, torch.Tensor]:
            """The state after one torch-path step from zero moments (realistic codes)."""
            scales = A8.absmax_shape(shape, dim)
            s = {
                "adam.exp_avg": torch.zeros(shape, dtype=torch.uint8, device="cuda"),
                "adam.exp_avg.absmax": torch.zeros(scales, device="cuda"),
                "adam.exp_avg_sq": torch.zeros(shape, dtype=torch.uint8, device="cuda"),
                "adam.exp_avg_sq.absmax": torch.zeros(scales, device="cuda"),
                "adam.block_dim": torch.tensor(dim),
                "adam.step": torch.tensor(0),
            }
            with kernels_mode("torch"):
                transform.update(g, s, group, None)
            return s

        torch_state, triton_state = fresh(), fresh()
        with kernels_mode("torch"):
            want = transform.update(g, torch_state, group, None)
        with kernels_mode("auto"):
            assert galore2.kernels.use_triton(g), "auto selection did not pick the Triton kernel"
            got = transform.update(g, triton_state, group, None)
        check = _rel_err(got, want)
        # bytes: gradient in (4), two code bytes in and out, fp32 direction out; 4 absmax
        # (two in, two out) of 4 bytes per block
        nbytes = numel * (4 + 2 + 2 + 4) + blocks * 16
        label = f"{shape[0]}×{shape[1]} (blocks along dim {dim})"
        for impl, state, mode in (
            ("torch", torch_state, "torch"),
            ("triton", triton_state, "auto"),
        ):

            def call(g=g, state=state, mode=mode) -> None:
                with kernels_mode(mode):
                    transform.update(g, state, group, None)

            rows.append(
                _row(
                    "adam8bit",
                    label,
                    impl,
                    timer(call),
                    nbytes,
                    copy_bw,
                    check=check if impl == "triton" else 0.0,
                )
            )

        # bitsandbytes' fused 8-bit blockwise Adam (flat blocks of 256), updating p as well
        p = torch.zeros(shape, device="cuda")
        state1 = torch.zeros(shape, dtype=torch.uint8, device="cuda")
        state2 = torch.zeros_like(state1)
        flat_blocks = -(-numel // 256)
        absmax1 = torch.zeros(flat_blocks, device="cuda")
        absmax2 = torch.zeros_like(absmax1)
        qmap1 = A8.dynamic_code(True, g.device)
        qmap2 = A8.dynamic_code(False, g.device)

        args = ("adam", g, p, state1, state2, *BETAS, 0.0, 0.0, EPS, 1, 1e-3)
        maps = (qmap1, qmap2, absmax1, absmax2)

        def bnb_step(args=args, maps=maps) -> None:
            bnb_f.optimizer_update_8bit_blockwise(*args, *maps)

        bnb_bytes = numel * (4 + 8 + 2 + 2) + flat_blocks * 16
        rows.append(
            _row(
                "adam8bit",
                label,
                "bitsandbytes (fused, + p update)",
                timer(bnb_step),
                bnb_bytes,
                copy_bw,
            )
        )
    return rows


# ---- back-projection epilogue -----------------------------------------------------------
def bench_lowrank(timer: Timer, copy_bw: float) -> list[dict[str, Any]]:
    from galore2.core.apply import apply_update
    from galore2.core.transform import LowRankUpdate

    rows = []
    gen = torch.Generator(device="cuda").manual_seed(1)
    lr, decay = 1e-3, 1 - 1e-3 * 0.1
    for (m, n), dtype in [(s, d) for d in (torch.float32, torch.bfloat16) for s in LLAMA_7B]:
        size = torch.finfo(dtype).bits // 8
        A = (torch.randn(m, RANK, device="cuda", generator=gen) / RANK**0.5).to(dtype)
        B = torch.randn(RANK, n, device="cuda", generator=gen).to(dtype)
        p0 = torch.randn(m, n, device="cuda", generator=gen).to(dtype)
        u = LowRankUpdate(A, B, p0.shape, scale=0.25)
        results = {}
        for mode in ("torch", "auto"):
            p = p0.clone()
            with kernels_mode(mode):
                apply_update(p, u, lr, decay)
            results[mode] = p
        check = _rel_err(results["auto"] - p0, results["torch"] - p0)  # relative to the update
        nbytes = (2 * m * n + m * RANK + RANK * n) * size
        flop = 2 * m * n * RANK
        label = f"{m}×{n}, r={RANK}, {str(dtype).removeprefix('torch.')}"
        for impl, mode in (("torch (addmm_)", "torch"), ("triton", "auto")):
            p = p0.clone()

            def call(p=p, u=u, mode=mode) -> None:
                with kernels_mode(mode):
                    apply_update(p, u, lr, decay)

            seconds = timer(call)
            extra = {"TFLOPs": flop / seconds / 1e12, "check": check if mode == "auto" else 0.0}
            rows.append(_row("lowrank", label, impl, seconds, nbytes, copy_bw, **extra))
    return rows


# ---- Hadamard rotation -----------------------------------------------------------------
def bench_hadamard(timer: Timer, copy_bw: float) -> list[dict[str, Any]]:
    from galore2.storage import hadamard as H

    rows = []
    gen = torch.Generator(device="cuda").manual_seed(2)
    signs = H.random_signs(7, RANK, "cuda")
    for n_rows in BASIS_ROWS:
        x = torch.randn(n_rows, RANK, device="cuda", generator=gen)
        nbytes = 2 * x.numel() * 4 + RANK * 4
        for name, fn in (("rotate", H.rotate), ("unrotate", H.unrotate)):
            with kernels_mode("torch"):
                want = fn(x, HADAMARD_BLOCK, signs)
            with kernels_mode("auto"):
                got = fn(x, HADAMARD_BLOCK, signs)
            check = _rel_err(got, want)
            label = f"{name} {n_rows}×{RANK}, block {HADAMARD_BLOCK}"
            for impl, mode in (("torch", "torch"), ("triton", "auto")):

                def call(fn=fn, x=x, mode=mode) -> None:
                    with kernels_mode(mode):
                        fn(x, HADAMARD_BLOCK, signs)

                rows.append(
                    _row(
                        "hadamard",
                        label,
                        impl,
                        timer(call),
                        nbytes,
                        copy_bw,
                        check=check if mode == "auto" else 0.0,
                    )
                )
    return rows


def _report(rows: list[dict[str, Any]], copy_bw: float) -> str:
    torch_us = {(r["op"], r["shape"]): r["us"] for r in rows if r["impl"].startswith("torch")}
    headers = [
        "op",
        "shape",
        "impl",
        "µs",
        "MB moved",
        "GB/s",
        "% copy",
        "TFLOP/s",
        "vs torch",
        "max |Δ|",
    ]
    body = []
    for r in rows:
        base = torch_us.get((r["op"], r["shape"]))
        body.append(
            [
                r["op"],
                r["shape"],
                r["impl"],
                f"{r['us']:.1f}",
                f"{r['bytes'] / 1e6:.1f}",
                f"{r['GB/s']:.0f}",
                f"{r['% copy']:.0f}%",
                f"{r['TFLOPs']:.1f}" if "TFLOPs" in r else "",
                f"{base / r['us']:.2f}×" if base else "",
                f"{r['check']:.1e}" if r.get("check") else "",
            ]
        )
    return render("kernels", device=torch.cuda.get_device_name(), copy_gbps=copy_bw / 1e9,
                  table=table(headers, body))  # fmt: skip


def unavailable() -> str | None:
    """Why the kernels cannot be measured here (``None``: they can)."""
    from galore2.kernels import dispatch  # not public: the import error, the interpreter flag

    if not torch.cuda.is_available():
        return "needs a CUDA GPU (torch.cuda.is_available() is False here)"
    if not galore2.kernels.triton_available():
        return (f"needs triton, which cannot be imported ({dispatch.triton_import_error()}); "
                "pip install triton")  # fmt: skip
    if dispatch.interpreter_enabled():
        return "TRITON_INTERPRET is set: the kernels would run in Triton's interpreter; unset it"
    return None


def kernels(quick: bool, repeats: int | None = None, warmup: int | None = None,
            json_path: str | None = None) -> str | None:  # fmt: skip
    """The report (``None`` after printing why, where the kernels cannot run)."""
    why = unavailable()
    if why is not None:
        print(f"kernels: skipped, it {why}; nothing measured or written.")
        return None
    torch.backends.cuda.matmul.allow_tf32 = False  # torch's default: full-precision fp32 matmuls
    timer = Timer(warmup or (2 if quick else 10), repeats or (5 if quick else 50))
    copy_bw = copy_bandwidth(timer)
    rows = (
        bench_adam8bit(timer, copy_bw)
        + bench_lowrank(timer, copy_bw)
        + bench_hadamard(timer, copy_bw)
    )
    if json_path:
        with open(json_path, "w") as f:
            json.dump({"machine": machine(), "device": torch.cuda.get_device_name(),
                       "copy_GBps": copy_bw / 1e9, "rows": rows}, f, indent=1)  # fmt: skip
    return _report(rows, copy_bw)
