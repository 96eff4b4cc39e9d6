"""Truthful time windows (issue 38 item 1) and the summary's AdamW baseline (issue 39 item 7).

A window ends after the device is done (the host read of its losses, then the clock) and
the next starts at that instant. The clock here is fake: it advances only where the test
says (a "device read" costs 40 ms, a step 10 ms), so the checks count, never time."""

from __future__ import annotations

import json
import types

import pytest
import torch

from recipes import metrics as metrics_module
from recipes.metrics import Metrics, adamw_state_bytes
from tests.recipes.test_recipe import run

READ_S, STEP_S = 0.040, 0.010


class FakeClock:
    """``time.perf_counter`` for recipes.metrics: advances only by :meth:`advance`."""

    def __init__(self) -> None:
        self.now = 0.0
        self.active = True

    def __call__(self) -> float:
        return self.now

    def advance(self, seconds: float) -> None:
        if self.active:
            self.now += seconds


@pytest.fixture
def clock(monkeypatch):
    """A fake clock for recipes.metrics, and device reads (``tolist``, ``item``) that cost
    ``READ_S`` on it: the work queued on the device finishes during the read."""
    fake = FakeClock()
    monkeypatch.setattr(metrics_module, "time", types.SimpleNamespace(perf_counter=fake))
    real_tolist, real_item = torch.Tensor.tolist, torch.Tensor.item

    def slow_tolist(self):
        fake.advance(READ_S)
        return real_tolist(self)

    def slow_item(self):
        fake.advance(READ_S)
        return real_item(self)

    monkeypatch.setattr(torch.Tensor, "tolist", slow_tolist)
    monkeypatch.setattr(torch.Tensor, "item", slow_item)
    return fake


def test_a_slow_device_read_is_charged_to_its_window(tmp_path, clock):
    m = Metrics(tmp_path, rank=0, total_steps=4, start_step=0, flops_per_token=1.0,
                device=torch.device("cpu"), progress=False)  # fmt: skip
    m.add(torch.tensor(2.0), 1000)
    clock.advance(0.1)  # the host's part of the window
    first = m.log(1, 1e-3)
    # 1000 tokens over 0.1 s of host work and the 40 ms read that waited for the device
    assert first["tokens_per_s"] == pytest.approx(1000 / (0.1 + READ_S), rel=1e-9)
    m.add(torch.tensor(2.0), 1000)
    clock.advance(0.2)
    second = m.log(2, 1e-3)  # starts where the first ended: no gap, the read charged again
    assert second["tokens_per_s"] == pytest.approx(1000 / (0.2 + READ_S), rel=1e-9)
    assert first["loss"] == second["loss"] == 2.0


def test_the_recipe_time_agrees_with_the_wall_clock(tmp_path, clock, monkeypatch):
    """The sum over windows of tokens / tokens_per_s is the training loop's time on the
    (fake) clock: every step and every device read charged, once."""
    from recipes import pretrain

    real_step, real_log = pretrain.train_step, Metrics.log
    counts = {"steps": 0, "end": None}
    clock.active = False  # setup is not the loop's

    def step(*args, **kwargs):
        clock.active = True
        out = real_step(*args, **kwargs)
        clock.advance(STEP_S)
        counts["steps"] += 1
        return out

    def log(self, *args, **kwargs):
        rec = real_log(self, *args, **kwargs)
        counts["end"] = clock.now  # the loop's time so far ends with its last log
        return rec

    monkeypatch.setattr(pretrain, "train_step", step)
    monkeypatch.setattr(Metrics, "log", log)
    hist = run(tmp_path, "--steps", "12", "--train.checkpoint_every", "-1")
    tokens = [r["tokens"] for r in hist]
    windows = [t - prev for t, prev in zip(tokens, [0, *tokens[:-1]], strict=True)]
    charged = sum(n / r["tokens_per_s"] for n, r in zip(windows, hist, strict=True))
    wall = counts["end"]
    assert counts["steps"] == 12 and len(hist) == 6
    # every step and at least one device read per log window is in the wall time
    assert wall >= 12 * STEP_S + 6 * READ_S - 1e-9
    assert charged == pytest.approx(wall, rel=0.02)


def test_summary_compares_with_the_adamw_the_run_would_use(tmp_path, capsys):
    """bf16 weights: torch AdamW keeps bf16 moments, so AdamW's own state is 1.000× the
    baseline (was 0.500×: the baseline counted fp32 moments)."""
    run(tmp_path, "--steps", "2", "--optimizer", "adamw", "--model.dtype", "bf16")
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["opt_state_bytes"] == summary["adamw_state_bytes"]
    assert summary["state_ratio"] == 1.0
    assert summary["adamw_baseline"] == "torch AdamW with bf16 moments"
    assert "for torch AdamW with bf16 moments (1.000×)" in capsys.readouterr().out


def test_adamw_state_bytes_counts_each_parameter_in_its_dtype():
    from recipes.metrics import adamw_baseline

    model = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.Linear(3, 2))
    model[1].to(torch.bfloat16)
    expected = 2 * (4 * 3 + 3) * 4 + 2 * (3 * 2 + 2) * 2 + 4 * 4  # moments + step scalars
    assert adamw_state_bytes(model) == expected
    assert adamw_state_bytes(model, torch.float32) == 2 * (15 + 8) * 4 + 16
    assert adamw_baseline(model) == "torch AdamW with bf16/fp32 moments"
