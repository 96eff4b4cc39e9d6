"""benchmarks/gpu_session.sh: the one script a GPU session runs (issue 28 item 5). Its parts
need a GPU; here its syntax, its plan (dry run) and its time boxes are checked."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

from benchmarks import run

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "benchmarks" / "gpu_session.sh"


def test_script_parses_and_its_dry_run_lists_every_part(tmp_path):
    subprocess.run(["bash", "-n", str(SCRIPT)], check=True)
    env = {**os.environ, "OUT": str(tmp_path), "GPU_SESSION_DRY": "1", "PYTHON": sys.executable}
    done = subprocess.run(["bash", str(SCRIPT)], cwd=ROOT, env=env, capture_output=True,
                          text=True, check=True)  # fmt: skip
    plan = (tmp_path / "summary.txt").read_text()
    assert plan == done.stdout
    assert f"part fit_24gb 330s: {sys.executable} -m benchmarks.run --tasks fit_24gb" in plan
    assert f"part torchtitan 200s: {sys.executable} -m benchmarks.torchtitan_gpu" in plan
    assert "fit_24gb" in run.TASKS  # the task it runs is registered


def test_time_boxes_fit_twelve_minutes():
    text = SCRIPT.read_text()
    boxes = [int(n) for n in re.findall(r"^\s*(?:part \w+|optional_task \w+) (\d+)", text, re.M)]
    budget = int(re.search(r"GPU_SESSION_BUDGET:-(\d+)", text)[1])
    assert len(boxes) >= 3 and budget <= 12 * 60
    assert sum(boxes) <= budget + 60  # the budget trims the last part, never more than 12 min
