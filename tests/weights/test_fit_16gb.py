"""The fit_16gb task (issue 40): Llama-7B with INT8 weights under a 15 GiB cap; its settings
and a tiny run on the CPU (the figures need a CUDA device)."""

from __future__ import annotations

import contextlib
import io
import math
import subprocess
import sys

import pytest

from benchmarks import fit_24gb
from recipes.resolve import parse_args


def test_fit_16gb_runs_the_recipe_with_int8_weights_and_an_int4_basis():
    argv = fit_24gb.recipe_argv("llama_7b", 2048, 1, 4, "/tmp/unused", "fit_16gb")
    job = parse_args(argv)
    assert job.model.weight_bits == 8 and job.optim.options["basis_dtype"] == "int4"
    assert job.optim.per_layer and job.model.activation_checkpointing
    assert fit_24gb.FITS["fit_16gb"].card_gib == 15.0
    plain = parse_args(fit_24gb.recipe_argv("llama_7b", 2048, 1, 4, "/tmp/unused"))
    assert plain.model.weight_bits is None  # fit_24gb unchanged


def _planner_here(cmd: list[str], **kwargs) -> subprocess.CompletedProcess:
    """``planner_bytes``' command ``python -m recipes.plan ARGV`` run in this process (its
    imports are warm here): the same ``recipes.plan.main`` on the same ARGV, its stdout."""
    from recipes.plan import main as plan_main

    assert cmd[:3] == [sys.executable, "-m", "recipes.plan"], cmd
    with contextlib.redirect_stdout(io.StringIO()) as out:
        plan_main(cmd[3:])
    return subprocess.CompletedProcess(cmd, 0, out.getvalue(), "")


def test_tiny_fit_16gb_runs_on_cpu_with_the_planner_beside_it(monkeypatch):
    """fit_16gb's own flags on the tiny config: its run (``run_one``, what ``run_child``
    runs in a fresh process; the child path itself: test_fit_24gb.py's tiny test) and its
    planner row (``planner_bytes``' command, run here)."""
    _, seq, batch = fit_24gb.settings("tiny")[1]
    r = fit_24gb.run_one(["--config", "tiny", "--seq-len", str(seq), "--batch-size",
                          str(batch), "--steps", "2", "--fit", "fit_16gb"])  # fmt: skip
    assert len(r["losses"]) == 2 and all(math.isfinite(x) for x in r["losses"])
    monkeypatch.setattr(fit_24gb.subprocess, "run", _planner_here)
    plan = fit_24gb.planner_bytes("tiny", seq, batch, 15.0, "fit_16gb")
    assert plan["per_layer"] and plan["checkpointing"] and plan["fits"]
    # int8 codes + scales + one dequantization, below the bf16 weights (the planner's
    # figure for them: tests/benchmarks/test_fit_24gb.py, one planner run fewer here)
    assert plan["weights"] < 2 * 869_760
    parts = ("weights", "gradients", "state", "activations")
    assert plan["total"] == sum(plan[k] for k in parts)


@pytest.mark.slow  # four recipe runs: 7.7 minutes on the loaded 2-core CPU it was written on
def test_int8_weights_task_reports_both_optimizers(monkeypatch):
    """The convergence comparison (``--tasks int8_weights``) in a tiny mode: 3 steps."""
    from benchmarks import int8_weights

    monkeypatch.setattr(int8_weights, "QUICK_STEPS", 3)
    seen = []
    real = int8_weights.tiny_run

    def counted(name, lr, flags, steps):
        seen.append((name, lr, tuple(flags), steps))
        return real(name, lr, flags, steps)

    monkeypatch.setattr(int8_weights, "tiny_run", counted)
    text = int8_weights.int8_weights(quick=True, jobs=None)
    assert "| GaLoreAdamW |" in text and "| Fira |" in text and "INT8 ÷ dtype" in text
    assert len(seen) == 4 and all(s == 3 and "--optim.per_layer" in f for *_, f, s in seen)
    assert sum("--model.weight_bits" in f for _, _, f, _ in seen) == 2


def test_int8_weights_task_refuses_jobs_below_one_and_never_picks_a_diverged_run():
    from benchmarks import int8_weights

    with pytest.raises(ValueError, match="--jobs must be >= 1, got 0"):
        int8_weights.int8_weights(quick=True, jobs=0)
    nan = float("nan")
    assert int8_weights.best([(nan, "3e-2"), (2.0, "3e-3"), (1.5, "1e-2")]) == (1.5, "1e-2")
    loss, lr = int8_weights.best([(nan, "3e-2")])
    assert loss != loss and lr == "-"
