"""``benchmarks.run --tasks gpu_throughput`` runs end to end on the CPU (tiny config), and
its rows are wall clock over whole windows (issue 38)."""

from __future__ import annotations

import re

import pytest

from benchmarks import gpu_throughput
from benchmarks.gpu_throughput import ROWS, throughput_section, window_rate
from benchmarks.run import TASKS


def test_gpu_throughput_smoke_table():
    assert TASKS["gpu_throughput"].needs_cuda
    rows = {r.label: r for r in ROWS}
    chosen = (rows["adamw (fused)"], rows["galore_adamw"], rows["galore_adamw + capture"])
    body = throughput_section(quick=True, rows=chosen)
    assert "Smoke run" in body and "÷ adamw (fused)" in body
    found = re.findall(r"^\| ([\w ()+]+) \| ([\d,]+) \| ([\d.]+) \|$", body, flags=re.M)
    assert [r[0] for r in found] == [r.label for r in chosen]
    assert found[0][2] == "1.00"  # the baseline's own ratio
    assert all(float(r[1].replace(",", "")) > 0 for r in found)


def test_the_baseline_is_fused_adamw_and_every_preset_has_a_row():
    from galore2.presets import PRESETS

    assert ROWS[0].label == "adamw (fused)" and "fused" in ROWS[0].flags
    assert {r.optimizer for r in ROWS} >= set(PRESETS) | {"adamw"}
    assert any("--optim.capture" in r.flags for r in ROWS)


def test_window_rate_is_tokens_over_the_windows_wall_time():
    history = [  # cumulative tokens; each window's tokens / tokens_per_s is its seconds
        {"tokens": 100, "tokens_per_s": 1.0},  # warm-up: left out
        {"tokens": 300, "tokens_per_s": 100.0},  # 200 tokens in 2 s
        {"tokens": 500, "tokens_per_s": 50.0},  # 200 tokens in 4 s
    ]
    assert window_rate(history) == pytest.approx(400 / 6)  # not the mean of rates (75)
    with pytest.raises(ValueError, match="two log windows"):
        window_rate(history[:1])


def test_cli_prints_each_row_and_refuses_unknown_rows(capsys):
    gpu_throughput.main(["--quick", "--rows", "adamw (foreach),galore_adamw"])
    out = capsys.readouterr().out
    assert "ratios to adamw (foreach)" in out
    assert re.search(r"^\| adamw \(foreach\) \| [\d,]+ \| 1\.000 \|$", out, flags=re.M)
    assert re.search(r"^\| galore_adamw \| [\d,]+ \| [\d.]+ \|$", out, flags=re.M)
    with pytest.raises(SystemExit):
        gpu_throughput.main(["--rows", "adamw"])
    assert "unknown ['adamw']" in capsys.readouterr().err
