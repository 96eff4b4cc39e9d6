"""Every fp32 normalized value in [−1, 1]: the dynamic 8-bit CPU path's code vs bitsandbytes'.

    python -m tools.dynamic8_exhaustive      # ~3 minutes a map on one core

The CPU path of :mod:`galore2.storage.dynamic8` reproduces bitsandbytes' CPU quantizer
through tables built from its rule (``_cpu_tables``); its once-per-process check and the
tests probe the values next to every code step and table bin edge. This script checks
all 2,130,706,433 fp32 values in [−1, 1], both code maps: blocks of 255 values after a
1.0 (absmax 1, so each value is its own normalized value ``x · fl(1 / 1)``) through
``quantize_`` on the CPU path and through bitsandbytes' ``quantize_blockwise``. The rest
of the quantizer (absmax, the reciprocal, the product) is IEEE arithmetic, compared
against bitsandbytes in tests/storage/test_dynamic8_cpu.py. Prints the mismatches per
map (0 expected); exits 1 if any.
"""

from __future__ import annotations

import sys
import time

import torch

from galore2.storage import dynamic8 as D

PER = 255 << 16  # values per call


def check(signed: bool) -> int:
    code = D.dynamic_code(signed, torch.device("cpu"))
    bnb = D.bnb_functional()
    first, last = (int(D._ordered(torch.tensor([v]))[0]) for v in (-1.0, 1.0))
    bad = 0
    for start in range(first, last + 1, PER):
        y = D._unordered(torch.arange(start, min(start + PER, last + 1)))
        n = y.numel()
        y = torch.cat((y, y.new_ones(-n % 255))).view(-1, 255)
        x = torch.cat((torch.ones(y.shape[0], 1), y), 1)
        want, state = bnb.quantize_blockwise(x.flatten(), code=code, blocksize=D.BLOCK)
        got = torch.empty(x.shape, dtype=torch.uint8)
        absmax = torch.empty(x.shape[0], 1)
        assert D.use_torch(got), "the CPU path is not taken here"
        D.quantize_(x, got, absmax, 1, signed)
        assert torch.equal(absmax.flatten(), state.absmax)
        bad += int((got.flatten() != want).sum())
    return bad


def main() -> None:
    torch.set_num_threads(1)
    total = 0
    for signed in (True, False):
        start = time.perf_counter()
        bad = check(signed)
        total += bad
        name = "signed" if signed else "unsigned"
        print(f"{name}: {bad} mismatches ({time.perf_counter() - start:.0f} s)", flush=True)
    sys.exit(1 if total else 0)


if __name__ == "__main__":
    main()
