"""benchmarks/gpu_session.sh: the one script a GPU session runs (issues 28, 38 item 9): one
call of at most 9 minutes. Its parts need a GPU; here its syntax, its plan (dry run), its
time boxes, and every part end to end at tiny shapes on the CPU (tiny mode) are checked."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from benchmarks import run

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "benchmarks" / "gpu_session.sh"
PARTS = ("throughput", "step_alone", "refresh_schedule", "fit_24gb")


def _run(tmp_path: Path, **env: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "OUT": str(tmp_path), "PYTHON": sys.executable, **env}
    return subprocess.run(["bash", str(SCRIPT)], cwd=ROOT, env=env, capture_output=True,
                          text=True, check=True)  # fmt: skip


def test_script_parses_and_its_dry_run_lists_every_part(tmp_path):
    subprocess.run(["bash", "-n", str(SCRIPT)], check=True)
    done = _run(tmp_path, GPU_SESSION_DRY="1")
    plan = (tmp_path / "summary.txt").read_text()
    assert plan == done.stdout
    py = sys.executable
    assert f"part throughput 230s: {py} -m benchmarks.gpu_throughput\n" in plan
    assert f"part step_alone 80s: {py} -m benchmarks.step_alone --part step\n" in plan
    assert f"part refresh_schedule 60s: {py} -m benchmarks.step_alone --part schedule\n" in plan
    assert f"part fit_24gb 160s: {py} -m benchmarks.run --tasks fit_24gb --no-write\n" in plan
    assert re.findall(r"^part (\w+)", plan, flags=re.M) == list(PARTS)
    assert "fit_24gb" in run.TASKS  # the task it runs is registered


def test_time_boxes_fit_one_call_of_nine_minutes():
    text = SCRIPT.read_text()
    boxes = [int(n) for n in re.findall(r"^part \w+ (\d+)", text, re.M)]
    budget = int(re.search(r"GPU_SESSION_BUDGET:-(\d+)", text)[1])
    assert len(boxes) == len(PARTS) and budget <= 9 * 60
    assert sum(boxes) <= budget  # no part is cut by the budget unless one overruns


def test_tiny_mode_plan_runs_every_part_at_tiny_shapes(tmp_path):
    plan = _run(tmp_path, GPU_SESSION_DRY="1", GPU_SESSION_TINY="1").stdout
    py = sys.executable
    assert re.findall(r"^part (\w+)", plan, flags=re.M) == list(PARTS)
    assert (f"part throughput 2300s: {py} -m benchmarks.gpu_throughput --quick --rows "
            "adamw (fused),galore_adamw + capture\n") in plan  # fmt: skip
    assert "-m benchmarks.step_alone --part schedule --quick\n" in plan
    assert "-m benchmarks.run --tasks fit_24gb --config tiny --steps 2 --no-write\n" in plan


@pytest.mark.slow  # every part in its own process: 5-20 minutes on a loaded 2-core CPU
def test_tiny_mode_runs_every_part_on_the_cpu(tmp_path):
    _run(tmp_path, GPU_SESSION_TINY="1", CUDA_VISIBLE_DEVICES="")
    summary = (tmp_path / "summary.txt").read_text()
    for name in PARTS:
        assert re.search(rf"^{name}: exit 0, \d+ s$", summary, flags=re.M), summary
    logs = {name: (tmp_path / f"{name}.log").read_text() for name in PARTS}
    assert re.search(r"^\| adamw \(fused\) \| [\d,]+ \| 1\.000 \|$", logs["throughput"], re.M)
    assert re.search(r"^\| galore_adamw \+ capture \| [\d,]+ \|", logs["throughput"], re.M)
    assert "ratios to torch AdamW (fused)" in logs["step_alone"]
    assert "| galore_adamw + CapturedStep | n/a (CUDA graphs need a GPU) |" in logs["step_alone"]
    for schedule in ("together", "staggered"):
        assert re.search(rf"^\| {schedule} \| [\d.]+ \| [\d.]+ \| [\d.]+ \|$",
                         logs["refresh_schedule"], re.M)  # fmt: skip
    assert "fit_24gb" in logs["fit_24gb"] and "failed" not in logs["fit_24gb"]
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(
        ["summary.txt", *(f"{n}.log" for n in PARTS)]
    )
