"""benchmarks/gpu_session.sh: the one script a GPU session runs (issues 28, 38 item 9, 40): one
call of at most 8 minutes. Its parts need a GPU; here its syntax, its plan (dry run), its
time boxes, and every part end to end at tiny shapes on the CPU (tiny mode) are checked."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from benchmarks import run, step_alone

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "benchmarks" / "gpu_session.sh"
PARTS = ("step_alone", "profile", "throughput", "gpu_tests", "fit_16gb")
OPTIONAL = ("refresh_schedule", "fit_24gb")  # GPU_SESSION_SCHEDULE=1, GPU_SESSION_FIT24=1


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
    assert f"part step_alone 60s: {py} -m benchmarks.step_alone --part step\n" in plan
    assert f"part profile 40s: {py} -m benchmarks.step_alone --part profile\n" in plan
    assert f"part throughput 140s: {py} -m benchmarks.gpu_throughput\n" in plan
    assert (f"part gpu_tests 110s: {py} -m pytest -q -p no:cacheprovider -o addopts= -m not slow "
            "tests/kernels/test_triton_kernels.py tests/kernels/test_lowrank_list.py "
            "tests/kernels/test_keep_flags.py tests/core/test_deferred.py "
            "tests/kernels/test_scaled_list.py tests/kernels/test_fira_kernels.py "
            "tests/kernels/test_project_norms_list.py tests/kernels/test_adam8bit_fused.py "
            "tests/core/test_capture.py "
            "tests/core/test_gpu_step.py tests/recipes/test_recipe_gpu.py\n") in plan  # fmt: skip
    assert f"part fit_16gb 200s: {py} -m benchmarks.run --tasks fit_16gb --no-write\n" in plan
    assert re.findall(r"^part (\w+)", plan, flags=re.M) == list(PARTS)
    assert {"fit_16gb", "fit_24gb"} <= set(run.TASKS)  # the tasks it runs are registered
    plan = _run(
        tmp_path, GPU_SESSION_DRY="1", GPU_SESSION_FIT24="1", GPU_SESSION_SCHEDULE="1"
    ).stdout
    assert re.findall(r"^part (\w+)", plan, flags=re.M) == [*PARTS, *OPTIONAL]
    assert f"part fit_24gb 160s: {py} -m benchmarks.run --tasks fit_24gb --no-write\n" in plan
    assert f"part refresh_schedule 40s: {py} -m benchmarks.step_alone --part schedule\n" in plan


def test_time_boxes_fit_one_call_of_eight_minutes():
    """15 minutes of device time per task, the machine's start included: one call of at most
    8 minutes leaves room for a slow start. gpu_tests runs beside fit_16gb (`beside`), so
    its box does not add up."""
    text = SCRIPT.read_text()
    boxes = dict(re.findall(r"^(?:part|beside) (\w+) (\d+)", text, re.M))
    budget = int(re.search(r"GPU_SESSION_BUDGET:-(\d+)", text)[1])
    assert list(boxes) == list(PARTS) and budget <= 8 * 60
    assert re.search(r"^beside gpu_tests \d+ .*\npart fit_16gb \d+ .*\nwait$", text, re.M)
    in_turn = sum(int(n) for name, n in boxes.items() if name != "gpu_tests")
    assert in_turn <= budget and int(boxes["gpu_tests"]) <= int(boxes["fit_16gb"])


def test_tiny_mode_plan_runs_every_part_at_tiny_shapes(tmp_path):
    plan = _run(
        tmp_path, GPU_SESSION_DRY="1", GPU_SESSION_TINY="1", GPU_SESSION_SCHEDULE="1"
    ).stdout
    py = sys.executable
    assert re.findall(r"^part (\w+)", plan, flags=re.M) == [*PARTS, "refresh_schedule"]
    assert (f"part throughput 1400s: {py} -m benchmarks.gpu_throughput --quick --rows "
            "adamw (fused),galore_adamw + capture\n") in plan  # fmt: skip
    assert "-m benchmarks.step_alone --part schedule --quick\n" in plan
    assert "-m benchmarks.run --tasks fit_16gb --config tiny --steps 2 --no-write\n" in plan
    assert (
        "-m pytest -q -p no:cacheprovider -o addopts= -m gpu tests/recipes/test_recipe_gpu.py\n"
        in plan
    )


@pytest.mark.slow  # every part in its own process: 5-20 minutes on a loaded 2-core CPU
def test_tiny_mode_runs_every_part_on_the_cpu(tmp_path):
    _run(tmp_path, GPU_SESSION_TINY="1", GPU_SESSION_SCHEDULE="1", CUDA_VISIBLE_DEVICES="")
    summary = (tmp_path / "summary.txt").read_text()
    parts = (*PARTS, "refresh_schedule")
    for name in parts:
        assert re.search(rf"^{name}: exit 0, \d+ s$", summary, flags=re.M), summary
    logs = {name: (tmp_path / f"{name}.log").read_text() for name in parts}
    assert re.search(r"^\| adamw \(fused\) \| [\d,]+ \| 1\.000 \|$", logs["throughput"], re.M)
    assert re.search(r"^\| galore_adamw \+ capture \| [\d,]+ \|", logs["throughput"], re.M)
    assert "ratios to torch AdamW (fused)" in logs["step_alone"]
    assert "| galore_adamw + CapturedStep | n/a (CUDA graphs need a GPU) |" in logs["step_alone"]
    for name in step_alone.PROFILED:
        assert f"profile: {name}, one step at tiny on cpu" in logs["profile"]
    assert "error" not in logs["profile"]
    assert re.search(r"^2 skipped", logs["gpu_tests"], re.M)  # no CUDA here
    for schedule in ("together", "staggered"):
        assert re.search(rf"^\| {schedule} \| [\d.]+ \| [\d.]+ \| [\d.]+ \|$",
                         logs["refresh_schedule"], re.M)  # fmt: skip
    assert "fit_16gb" in logs["fit_16gb"] and "failed" not in logs["fit_16gb"]
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(
        ["summary.txt", *(f"{n}.log" for n in parts)]
    )
