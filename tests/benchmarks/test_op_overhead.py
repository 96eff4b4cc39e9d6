"""benchmarks/op_overhead.py runs (its figures are timings: measured by the command, never
asserted here)."""

from __future__ import annotations

import re

from benchmarks import op_overhead


def test_op_overhead_prints_three_variants(capsys):
    op_overhead.main(["--weights", "3", "--calls", "2"])
    out = capsys.readouterr().out
    rows = re.findall(r"^\| (.+) \| (\d+) µs \|$", out, flags=re.M)
    assert [r[0] for r in rows] == ["through the op", "direct (galore2's call)",
                                    "implementation alone"]  # fmt: skip
    assert "over 3 weights" in out
