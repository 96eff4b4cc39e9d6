"""The fit_24gb task (issue 28 item 2): its settings, its comparison, a tiny CPU run.

The task's numbers need a CUDA device (capped allocator, ``max_memory_allocated``); here
its settings are pinned, the planner comparison is checked on given numbers, and the same
code runs the tiny config on the CPU end to end.
"""

from __future__ import annotations

import math

import pytest

from benchmarks import fit_24gb
from recipes.resolve import parse_args


def test_each_setting_runs_the_recipe_as_the_issue_asks():
    job = parse_args(fit_24gb.recipe_argv("llama_7b", 256, 16, 4, "/tmp/unused"))
    assert job.optim.name == "galore_adamw8bit" and job.optim.options["basis_dtype"] == "int8"
    assert job.optim.per_layer and job.model.activation_checkpointing
    assert job.model.dtype == "bf16" and job.model.dim == 4096 and job.model.n_layers == 32
    assert (job.data.dataset, job.data.tokenizer) == ("embedded", "byte")
    assert (job.data.seq_len, job.train.batch_size, job.train.steps) == (256, 16, 4)
    assert job.optim.options["rank"] == 1024  # the 7B config's: the planner reads the same file
    assert [(s, b) for _, s, b in fit_24gb.SETTINGS] == [(2048, 1), (256, 16)]
    assert [(s, b) for _, s, b in fit_24gb.settings("tiny")] == [(128, 1), (16, 16)]


def test_planner_comparison_is_within_five_percent_or_says_not():
    assert fit_24gb.compare(20_040, 19_740) == {"ratio": 20_040 / 19_740, "within": True}
    assert fit_24gb.compare(100, 106)["within"] is False  # 0.943
    assert fit_24gb.compare(100, 95)["within"] is False  # 1.053
    assert fit_24gb.compare(100, None) == {"ratio": None, "within": None}  # CPU: not measured


def test_section_reports_peaks_planner_and_failures(monkeypatch):
    """What a GPU session prints, from given numbers: one row per setting; an OOM is a row."""
    runs = iter([
        {"build_peak_bytes": 13_600_000_000, "train_peak_bytes": 19_740_000_000,
         "tokens_per_s": 2100.0},
        {"error": "exit 1: torch.OutOfMemoryError: CUDA out of memory."},
    ])  # fmt: skip
    monkeypatch.setattr(fit_24gb, "run_child", lambda *a, **k: next(runs))
    monkeypatch.setattr(fit_24gb, "planner_bytes", lambda *a: {"total": 20_040_000_000})
    body = fit_24gb.fit_24gb(False, None, None, 23.5).body
    lines = body.splitlines()
    assert lines[2] == "| seq 2048, batch 1 | 13.60 | 19.74 | 20.04 | 1.015 ✓ | 2100 |"
    assert lines[3].startswith("| GaLore's: seq 256, batch 16 | failed | failed | 20.04 |")
    assert "- GaLore's: seq 256, batch 16: exit 1: torch.OutOfMemoryError" in body


def test_tiny_setting_runs_on_cpu_with_the_planner_beside_it():
    _, seq, batch = fit_24gb.settings("tiny")[1]
    r = fit_24gb.run_child("--config", "tiny", "--seq-len", str(seq), "--batch-size",
                           str(batch), "--steps", "2")  # fmt: skip
    assert "error" not in r, r.get("stderr", r)
    assert r["device"] == "cpu" and r["cap_fraction"] is None
    assert r["build_peak_bytes"] is None and r["train_peak_bytes"] is None  # no CUDA peaks
    assert len(r["losses"]) == 2 and all(math.isfinite(x) for x in r["losses"])
    assert r["tokens_per_s"] > 0
    plan = fit_24gb.planner_bytes("tiny", seq, batch, 23.5)
    assert plan["per_layer"] and plan["checkpointing"] and plan["fits"]
    parts = ("weights", "gradients", "state", "activations")
    assert plan["total"] == sum(plan[k] for k in parts)
    assert plan["weights"] == 2 * 869_760  # bf16 weights of the tiny Llama


def test_one_step_is_refused():
    with pytest.raises(SystemExit):
        fit_24gb.run_one(["--config", "tiny", "--seq-len", "16", "--batch-size", "2",
                          "--steps", "1"])  # fmt: skip
