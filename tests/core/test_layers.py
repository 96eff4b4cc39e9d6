"""The import layers of galore2 (pyproject's ``[tool.importlinter]``), checked by import-linter.

``lint-imports`` is also part of README's test command; these tests keep the contract
honest from inside pytest: it holds, it covers every top-level module of the package
(a new subpackage cannot sit outside it), and it actually fails on an upward import.
"""

from __future__ import annotations

import os
import pkgutil
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from ..helpers import run_python

if sys.version_info >= (3, 11):
    import tomllib
else:  # the test extra installs tomli there (through the recipe extra)
    import tomli as tomllib

ROOT = Path(__file__).resolve().parents[2]
PACKAGE = "galore2"


def _lint_imports(cwd: Path) -> subprocess.CompletedProcess[str]:
    """``lint-imports`` of the venv running the tests, on the galore2 found in ``cwd``."""
    exe = Path(sys.executable).parent / ("lint-imports.exe" if os.name == "nt" else "lint-imports")
    if not exe.exists():
        pytest.fail(f"{exe} not found: install the test extra (import-linter)", pytrace=False)
    env = {**os.environ, "PYTHONPATH": str(cwd)}  # this tree's galore2, not an installed one
    return subprocess.run(
        [str(exe), "--no-cache"], cwd=cwd, env=env, capture_output=True, text=True, timeout=120
    )


def _layers_contract() -> dict:
    config = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["importlinter"]
    assert config["root_packages"] == [PACKAGE, "recipes", "benchmarks"]
    (contract,) = [c for c in config["contracts"] if c["id"] == "layers"]
    return contract


def _copy_checkout(dest: Path) -> None:
    """The contracts' root packages (galore2, recipes, benchmarks) and pyproject in ``dest``."""
    for package in (PACKAGE, "recipes", "benchmarks"):
        ignore = shutil.ignore_patterns("*.pyc", "results", "figures")
        shutil.copytree(ROOT / package, dest / package, ignore=ignore)
    shutil.copy(ROOT / "pyproject.toml", dest / "pyproject.toml")


def test_import_contracts_hold():
    out = _lint_imports(ROOT)
    assert out.returncode == 0, out.stdout + out.stderr
    assert "0 broken" in out.stdout


def test_layers_contract_lists_every_top_level_module():
    contract = _layers_contract()
    assert contract["containers"] == [PACKAGE]
    assert contract["exhaustive"] is True  # lint-imports itself refuses an unlisted module
    listed = [
        name.strip().strip("()")  # "(x)" marks an optional layer
        for layer in contract["layers"]
        for name in re.split(r"[|:]", layer)
    ]
    assert len(listed) == len(set(listed))
    present = {m.name for m in pkgutil.iter_modules([str(ROOT / PACKAGE)])}
    assert sorted(listed) == sorted(present)


def test_an_upward_import_breaks_the_contract(tmp_path):
    """A copy of the package whose bottom layer imports a preset: lint-imports must fail."""
    _copy_checkout(tmp_path)
    assert _lint_imports(tmp_path).returncode == 0  # the copy passes as it is
    blocks = tmp_path / PACKAGE / "kernels" / "blocks.py"
    blocks.write_text(blocks.read_text() + "\nfrom ..presets import GaLoreAdamW  # noqa\n")
    out = _lint_imports(tmp_path)
    assert out.returncode != 0
    assert "galore2.kernels is not allowed to import galore2.presets" in out.stdout, out.stdout


def test_an_import_of_the_recipe_breaks_the_contract(tmp_path):
    """The installed package never reaches into a checkout's recipes/ (the wheel has none):
    even a lazy import inside a function fails lint-imports."""
    out = _lint_with_appended(
        tmp_path, f"{PACKAGE}/plan/report.py", "\n\ndef _f():\n    import recipes.config  # noqa\n"
    )
    assert "galore2 is not allowed to import recipes" in out, out


def test_a_lazy_import_cycle_in_the_recipe_breaks_the_contracts(tmp_path):
    """recipes.config (the schema) importing the optimizer factory inside a function, the
    cycle the recipe once had, fails both the acyclic and the recipes layers contracts."""
    out = _lint_with_appended(
        tmp_path, "recipes/config.py", "\n\ndef _f():\n    from .optimizers import NAMES  # noqa\n"
    )
    assert "No cycles are allowed in recipes" in out, out
    assert "recipes.config is not allowed to import recipes.optimizers" in out, out


def _lint_with_appended(tmp_path, path: str, code: str) -> str:
    """lint-imports' report on a copy of the checkout with ``code`` appended to ``path``;
    fails unless lint-imports fails."""
    _copy_checkout(tmp_path)
    target = tmp_path / path
    target.write_text(target.read_text() + code)
    out = _lint_imports(tmp_path)
    assert out.returncode != 0
    return out.stdout


def test_fsdp_placements_are_imported_only_when_needed():
    """galore2 detects DTensors (galore2.fsdp.detect) without importing the FSDP placements
    (galore2.fsdp.placement, which imports torch.distributed): a plain run never loads them;
    the names galore2.fsdp exports load them on first use."""
    code = (
        "import sys, torch, galore2\n"
        "p = torch.nn.Parameter(torch.randn(8, 12))\n"
        "opt = galore2.GaLoreAdamW([{'params': [p], 'rank': 2}])\n"
        "p.grad = torch.randn_like(p)\n"
        "opt.step()\n"
        "assert 'galore2.fsdp.placement' not in sys.modules\n"
        "from galore2.fsdp import is_dtensor, placement_for\n"
        "assert 'galore2.fsdp.placement' in sys.modules and not is_dtensor(p)\n"
        "print('ok')\n"
    )
    assert run_python(code).strip().endswith("ok")
