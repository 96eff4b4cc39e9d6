"""benchmarks/torchtitan_wheel.py: the torchtitan a GPU's torch imports (issue 39 item 14),
and the wheel scripts that use it."""

from __future__ import annotations

from pathlib import Path

import pytest

from benchmarks.torchtitan_wheel import main, pick

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize(
    ("torch_version", "torchtitan"),
    [("2.11.0+cu126", "0.2.2"), ("2.10.1", "0.2.2"), ("2.12.0", "0.3.0"),
     ("2.12.0.dev20260101+cu128", "0.3.0"), ("2.13.0+cpu", "0.3.0"), ("3.0.0", "0.3.0")],
)  # fmt: skip
def test_pick_needs_torch_2_12_for_torchtitan_03(torch_version, torchtitan):
    assert pick(torch_version) == torchtitan


def test_pick_refuses_a_version_without_major_minor(capsys):
    with pytest.raises(ValueError, match="major.minor"):
        pick("nightly")
    assert main(["2.11.0"]) == 0 and capsys.readouterr().out == "0.2.2\n"


def test_the_wheel_scripts_use_the_pick():
    wheels = (ROOT / "benchmarks" / "gpu_wheels.sh").read_text()
    session = (ROOT / "benchmarks" / "gpu_session.sh").read_text()
    assert "torchtitan==0.3.0" in wheels and 'torchtitan==$v' in wheels
    assert '"0.3.0 0.2.2"' in wheels and "benchmarks.torchtitan_wheel" in wheels
    assert '.whl/torchtitan-$($PY -m benchmarks.torchtitan_wheel)' in session
