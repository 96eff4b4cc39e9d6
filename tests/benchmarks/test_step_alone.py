"""benchmarks/step_alone.py (issue 38 item 9) on the CPU at tiny shapes: its rows, its named
baseline, and what it says where a row cannot run (numbers not meaningful here)."""

from __future__ import annotations

import re

import pytest

from benchmarks import step_alone
from galore2.presets import PRESETS


def test_rows_the_baseline_first_every_preset_and_capture():
    labels = [r.label for r in step_alone.STEP_ROWS]
    assert labels[0] == "torch AdamW (fused)" and "torch AdamW (foreach)" in labels
    assert set(PRESETS) <= set(labels) and len(set(labels)) == len(labels)
    assert [r.label for r in step_alone.STEP_ROWS if r.captured] == ["galore_adamw + CapturedStep"]
    assert {r.label: r.variant for r in step_alone.STEP_ROWS if r.variant} == {
        "galore_adamw stacked": "stacked",
        "galore_adamw synced": "synced",
        "galore_adamw8bit stacked": "stacked",
    }


def test_step_part_on_the_cpu(capsys):
    step_alone.main(["--part", "step", "--quick", "--rows",
                     "torch AdamW (fused),galore_adamw + CapturedStep"])  # fmt: skip
    out = capsys.readouterr().out
    assert "ratios to torch AdamW (fused)" in out
    assert re.search(r"^\| torch AdamW \(fused\) \| [\d.]+ \| 1\.00 \|$", out, flags=re.M)
    assert "| galore_adamw + CapturedStep | n/a (CUDA graphs need a GPU) |  |" in out
    with pytest.raises(SystemExit):
        step_alone.main(["--rows", "adamw"])
    assert "unknown ['adamw']" in capsys.readouterr().err


def test_profile_part_tables_one_step_by_own_time(capsys):
    out = step_alone.profile_part(True, names=("galore_adamw",))
    table = out["galore_adamw"]
    assert "Self CPU" in table and "aten::" in table  # ops of the step, not an error line
    assert (
        "galore_adamw, one step at tiny on cpu, by self_cpu_time_total" in capsys.readouterr().out
    )
    bad = step_alone.profile_part(True, names=("no_such_optimizer",))
    assert bad["no_such_optimizer"].startswith("error ")  # a row that cannot run says why


def test_variant_rows_turn_one_part_off():
    """``_common.variant``: the rows that measure the path without the grouped kernels take
    it (every batch stacked), those without the deferred flags read them (CUDA off
    ``deferred.DEVICES``), and only while they run; an unknown variant is refused."""
    import torch

    from benchmarks._common import variant
    from galore2.core import deferred
    from galore2.optim import lowrank_batch

    u = torch.empty(64, 64, device="meta")  # a step on meta stands for one on a GPU
    assert lowrank_batch.along_data(u) and deferred.active(torch.device("cuda"))
    with variant("stacked"):
        assert not lowrank_batch.along_data(u) and deferred.active(torch.device("cuda"))
    with variant("synced"):
        assert lowrank_batch.along_data(u) and not deferred.active(torch.device("cuda"))
    with variant(""):
        assert lowrank_batch.along_data(u)
    assert lowrank_batch.along_data(u) and deferred.active(torch.device("cuda"))
    with pytest.raises(ValueError, match="variant 'bmm': one of"):
        variant("bmm")
