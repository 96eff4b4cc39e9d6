"""The planner is self-contained (issue 29 item 3): ``python -m galore2.plan config.json`` runs
from any folder with only the package importable, never imports ``recipes`` nor edits
``sys.path``, and lists every public preset."""

from __future__ import annotations

import ast
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

import galore2
from galore2.plan import OPTIMIZERS
from galore2.presets import PRESETS

from .conftest import SMALL, write

PACKAGE = Path(galore2.__file__).resolve().parent

CHECK = """
import importlib.util, json, runpy, sys
sys.argv = ["galore2.plan", "config.json", "--json", "--per-layer", "on", "--checkpointing", "on"]
runpy.run_module("galore2.plan", run_name="__main__")
import galore2
print(json.dumps({"file": galore2.__file__, "path": sys.path,
                  "recipes_imported": sorted(m for m in sys.modules if m.split(".")[0] == "recipes"),
                  "recipes_findable": importlib.util.find_spec("recipes") is not None}))
"""


def _outside(tmp_path: Path) -> tuple[Path, dict[str, str]]:
    """A folder outside the checkout holding config.json, and an environment whose only
    path entry is a folder holding galore2 alone (as a wheel's site-packages would)."""
    site = tmp_path / "site"
    site.mkdir()
    (site / "galore2").symlink_to(PACKAGE, target_is_directory=True)
    work = tmp_path / "work"
    write(work, SMALL)
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONHOME")}
    return work, {**env, "PYTHONPATH": str(site), "HF_HUB_OFFLINE": "1"}


# The default suite's check: tests/test_wheel.py::test_installed_wheel_runs_every_optimizer_in_a_
# fresh_venv runs the same planner from a temporary folder with the installed wheel alone
# (one row per preset with its state, recipes neither imported nor findable, the checkout not
# on sys.path); this one, with the source tree linked in, is a second fresh interpreter.
@pytest.mark.slow
def test_the_planner_runs_from_a_temporary_folder_without_the_checkout(tmp_path):
    work, env = _outside(tmp_path)
    done = subprocess.run([sys.executable, "-c", CHECK], cwd=work, env=env, capture_output=True,
                          text=True, timeout=300)  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    *plan, last = done.stdout.strip().splitlines()
    where = json.loads(last)
    assert where["file"].startswith(str(tmp_path / "site"))  # this galore2, not the checkout
    assert not any(str(PACKAGE.parent) == p.rstrip("/") for p in where["path"])
    assert where["recipes_imported"] == [] and not where["recipes_findable"]
    rows = json.loads("\n".join(plan))["rows"]
    assert [r["optimizer"] for r in rows] == list(OPTIMIZERS)  # one per preset and rule
    assert all(r["state"] > 0 for r in rows)


def test_every_public_preset_has_a_row_of_its_own():
    planned = [o.preset for o in OPTIMIZERS.values() if o.preset]
    assert set(planned) == set(PRESETS)
    # Fira, APOLLO, APOLLO-Mini, GaLoreMuon, Ranger21, GaLoreRanger21: each its own class
    assert {"fira", "apollo", "apollo_mini", "galore_muon", "ranger21", "galore_ranger21"} <= {
        o.name for o in OPTIMIZERS.values()
    }


def test_the_command_line_names_a_recipe_config_it_cannot_read(tmp_path):
    work, env = _outside(tmp_path)
    (work / "llama.toml").write_text("[model]\ndim = 64\n")
    for spec in ("llama.toml", "llama_7b"):
        done = subprocess.run([sys.executable, "-m", "galore2.plan", spec], cwd=work, env=env,
                              capture_output=True, text=True, timeout=120)  # fmt: skip
        assert done.returncode == 2 and done.stdout == ""
        assert done.stderr.count("\n") == 1 and f"python -m recipes.plan {spec}" in done.stderr


def test_no_module_of_galore2_imports_recipes_or_edits_sys_path():
    """import-linter (pyproject) forbids the imports; this also catches importlib and
    sys.path by name."""
    for path in PACKAGE.rglob("*.py"):
        tree = ast.parse(path.read_text())
        for node in ast.walk(tree):
            if isinstance(node, ast.Constant) and isinstance(node.value, str):
                assert not node.value.startswith("recipes."), (path, node.value)
            if isinstance(node, ast.Attribute) and node.attr == "path":
                assert not (isinstance(node.value, ast.Name) and node.value.id == "sys"), path
