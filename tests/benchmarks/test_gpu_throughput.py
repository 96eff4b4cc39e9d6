"""``benchmarks.run --tasks gpu_throughput`` runs end to end on the CPU (tiny config)."""

from __future__ import annotations

import re

from benchmarks.gpu_throughput import throughput_section
from benchmarks.run import TASKS


def test_gpu_throughput_smoke_table():
    assert TASKS["gpu_throughput"].needs_cuda
    body = throughput_section(quick=True, names=("adamw", "galore_adamw"))
    assert "Smoke run" in body
    rows = re.findall(r"^\| (\w+) \| ([\d,]+) \| ([\d.]+) \|$", body, flags=re.M)
    assert [r[0] for r in rows] == ["adamw", "galore_adamw"]
    assert rows[0][2] == "1.00"  # the baseline's own ratio
    assert all(float(r[1].replace(",", "")) > 0 for r in rows)
