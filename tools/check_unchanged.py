"""Behaviour-unchanged check for refactors: the tiny recipe's metrics, bit for bit.

    python -m tools.check_unchanged --write   # record the reference (before a refactor)
    python -m tools.check_unchanged           # compare against it (after)

Runs the tiny recipe for 200 steps with each optimizer below (logging every step,
evaluating every 50) and compares every field of ``metrics.jsonl`` except timings and
memory (``tokens_per_s``, ``peak_rss_gb``, ``peak_*``) with the reference exactly: losses,
validation losses, learning rates and optimizer-state bytes must be bitwise identical.
The reference is machine-specific (float rounding of the CPU's kernels) and depends on the
intra-op thread count (a reduction split over more threads sums in another order), so
record it on the machine that checks, at the thread count it checks with (``--threads``,
default 1: the recipe's ``--train.threads``; the count is stored with the reference and a
comparison at another count is refused).

``TOLERANT`` optimizers (recorded before issue 27's batched kernels, which may reorder
floating-point sums) are compared with a relative and absolute tolerance of 1e-6 on every
float field instead of bitwise; integer fields stay exact.
"""

from __future__ import annotations

import argparse
import json
import math
import subprocess
import sys
import tempfile
from pathlib import Path

EXACT = ("galore_adamw", "galore_adamw8bit", "galore_adafactor", "galore_ranger21")
TOLERANT = ("fira", "apollo", "apollo_mini", "galore_muon", "ranger21")
OPTIMIZERS = EXACT + TOLERANT
TOLERANCE = 1e-6
STEPS = 200
REFERENCE = Path(__file__).with_name("unchanged_reference.json")
IGNORED = ("tokens_per_s", "peak_", "time", "seconds")
META = "_recorded"  # the reference's own settings (the thread count), not an optimizer


def run(name: str, out: Path, threads: int) -> list[dict]:
    cmd = [
        sys.executable,
        "-m",
        "recipes.pretrain",
        "--config",
        "tiny",
        "--optimizer",
        name,
        "--steps",
        str(STEPS),
        "--out",
        str(out),
        "--train.progress",
        "false",
        "--train.log_every",
        "1",
        "--train.eval_every",
        "50",
        "--train.checkpoint_every",
        "-1",
        "--train.resume",
        "false",
        "--train.threads",
        str(threads),
    ]
    subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL)
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    return [{k: v for k, v in r.items() if not k.startswith(IGNORED)} for r in rows]


def same(a: dict, b: dict, tolerant: bool) -> bool:
    """Whether two metric rows agree: bitwise, or within ``TOLERANCE`` for floats."""
    if not tolerant or a.keys() != b.keys():
        return a == b
    for k, x in a.items():
        y = b[k]
        if isinstance(x, float) or isinstance(y, float):
            if not math.isclose(x, y, rel_tol=TOLERANCE, abs_tol=TOLERANCE):
                return False
        elif x != y:
            return False
    return True


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--write", action="store_true", help="record the reference instead")
    ap.add_argument("--only", nargs="*", default=OPTIMIZERS, help="optimizers to run")
    ap.add_argument("--threads", type=int, default=1, help="CPU intra-op threads (default 1)")
    ap.add_argument("--reference", type=Path, default=REFERENCE, help="the reference file")
    args = ap.parse_args()
    if args.threads < 1:
        ap.error(f"--threads must be >= 1, got {args.threads}")
    bad_names = sorted(set(args.only) - set(OPTIMIZERS))
    if bad_names:
        ap.error(f"--only: unknown {bad_names}; allowed: {', '.join(OPTIMIZERS)}")
    ref = json.loads(args.reference.read_text()) if args.reference.exists() else {}
    recorded = ref.pop(META, {}).get("threads")
    if recorded is not None and recorded != args.threads and not args.write:
        ap.error(f"--threads {args.threads}: the reference was recorded at {recorded} threads")
    with tempfile.TemporaryDirectory() as tmp:
        got = {name: run(name, Path(tmp) / name, args.threads) for name in args.only}
    if args.write:
        if recorded is not None and recorded != args.threads:
            ref = {}  # another thread count: the old rows are not comparable, start over
        meta = {META: {"threads": args.threads}}
        args.reference.write_text(json.dumps({**meta, **ref, **got}, indent=0) + "\n")
        print(f"wrote {args.reference} ({', '.join(got)}; {args.threads} threads)")
        return 0
    bad = 0
    for name, rows in got.items():
        if name not in ref:
            bad += 1
            print(f"{name}: no reference recorded (run with --write --only {name} first)")
            continue
        want = ref[name]
        # fields added since the reference was recorded (e.g. nonfinite_skips) are listed,
        # not compared; every recorded field must be identical
        added = sorted({k for r in rows for k in r} - {k for r in want for k in r})
        rows = [{k: v for k, v in r.items() if k not in added} for r in rows]
        if added:
            print(f"{name}: new fields (not compared): {', '.join(added)}")
        tolerant = name in TOLERANT
        diff = [
            i for i, (a, b) in enumerate(zip(rows, want, strict=False)) if not same(a, b, tolerant)
        ]
        if len(rows) != len(want) or diff:
            bad += 1
            first = diff[0] if diff else min(len(rows), len(want))
            print(
                f"{name}: DIFFERS ({len(diff)} of {len(want)} rows; first at row {first}: "
                f"{rows[first] if first < len(rows) else None} vs "
                f"{want[first] if first < len(want) else None})"
            )
        else:
            fields = sorted({k for r in rows for k in r})
            bitwise = rows == want  # a tolerant preset may still be identical: say so
            how = "identical" if bitwise else f"within {TOLERANCE:g}"
            print(f"{name}: {how} ({len(rows)} rows; fields {', '.join(fields)})")
    return 1 if bad else 0


if __name__ == "__main__":
    raise SystemExit(main())
