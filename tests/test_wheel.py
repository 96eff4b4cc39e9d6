"""The package as users get it: ``python -m build`` makes an sdist and, from it, a wheel.

The build runs without isolation and without network, with ``import torch`` made to fail
(the version is read from ``galore2/__init__.py`` without importing it). The wheel holds
``galore2/`` and its metadata only; installed (not editable, ``--no-deps``) into a fresh venv
that finds torch through a ``.pth`` file, it imports galore2 from that venv's site-packages
and every public optimizer takes two steps there, and the memory planner plans a config.json
in a temporary folder (tests/wheel_smoke.py, run from outside the repository).
"""

from __future__ import annotations

import email
import json
import os
import shutil
import subprocess
import sys
import tarfile
import zipfile
from pathlib import Path

import pytest
import torch

import galore2

from .wheel_smoke import public_optimizers

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10
    import tomli as tomllib

ROOT = Path(__file__).resolve().parents[1]
PYPROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())
NAME = f"galore2-{galore2.__version__}"
OUTSIDE_THE_PACKAGE = ("tests/", "benchmarks/", "recipes/", "tools/", "examples/")


def _run(cmd: list[str], **kwargs) -> str:
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=300, **kwargs)
    assert done.returncode == 0, f"{' '.join(cmd)}\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}"
    return done.stdout


@pytest.fixture(scope="module")
def dists(tmp_path_factory) -> dict[str, Path]:
    """``python -m build --no-isolation``: the sdist, then the wheel built from it; a torch
    that cannot be imported is first on the path."""
    tmp = tmp_path_factory.mktemp("dist")
    stub = tmp / "stub" / "torch"
    stub.mkdir(parents=True)
    (stub / "__init__.py").write_text("raise ImportError('the build imported torch')\n")
    out = tmp / "out"
    env = {**os.environ, "PYTHONPATH": str(stub.parent)}
    _run(
        [sys.executable, "-m", "build", "--no-isolation", "--outdir", str(out), str(ROOT)], env=env
    )
    return {"wheel": out / f"{NAME}-py3-none-any.whl", "sdist": out / f"{NAME}.tar.gz"}


def test_wheel_holds_the_package_and_nothing_else(dists):
    with zipfile.ZipFile(dists["wheel"]) as whl:
        names = whl.namelist()
        meta = email.message_from_bytes(whl.read(f"{NAME}.dist-info/METADATA"))
    package = {n for n in names if not n.startswith(f"{NAME}.dist-info/")}
    source = {
        p.relative_to(ROOT).as_posix()
        for p in (ROOT / "galore2").rglob("*")
        if p.is_file() and (p.suffix == ".py" or p.name == "py.typed")
    }
    assert "galore2/py.typed" in package
    assert package == source  # every module, and no tests, benchmarks, recipes, tools
    assert not [n for n in names if n.startswith(OUTSIDE_THE_PACKAGE)]
    assert meta["Name"] == "galore2" and meta["Version"] == galore2.__version__
    requires = meta.get_all("Requires-Dist")
    assert [r for r in requires if "extra ==" not in r] == PYPROJECT["project"]["dependencies"]
    assert set(meta.get_all("Provides-Extra")) == set(PYPROJECT["project"]["optional-dependencies"])
    assert meta["Requires-Python"] == PYPROJECT["project"]["requires-python"]


def test_sdist_holds_what_the_build_needs(dists):
    """The wheel above was built from this sdist; it carries the docs but no other folder."""
    with tarfile.open(dists["sdist"]) as tar:
        names = {n.removeprefix(f"{NAME}/") for n in tar.getnames()}
    needed = {"pyproject.toml", "README.md", "CHANGELOG.md", "PKG-INFO", "galore2/py.typed"}
    needed |= {p.name for p in ROOT.glob("LICEN[CS]E*")}
    assert needed <= names, needed - names
    assert "galore2/__init__.py" in names
    assert not [n for n in names if n.startswith(OUTSIDE_THE_PACKAGE)]


def test_installed_wheel_runs_every_optimizer_in_a_fresh_venv(dists, tmp_path):
    # no PYTHONPATH: a checkout on it (with its galore2.egg-info) would look installed to pip
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONHOME")}
    venv = tmp_path / "venv"
    _run([sys.executable, "-m", "venv", "--without-pip", str(venv)], env=env, cwd=tmp_path)
    python = str(venv / "bin" / "python")
    pip = [sys.executable, "-m", "pip", "--python", python, "--disable-pip-version-check"]
    install = [*pip, "install", "--no-deps", "--no-index", "--no-cache-dir", str(dists["wheel"])]
    assert f"Successfully installed {NAME}" in _run(install, env=env, cwd=tmp_path)
    where = "import sysconfig; print(sysconfig.get_path('purelib'))"
    purelib = Path(_run([python, "-I", "-c", where], cwd=tmp_path).strip())
    # torch (and what it imports) from this interpreter's site-packages; .pth files there,
    # such as an editable galore2's, are not run: only the venv's own site-packages is a site dir
    (purelib / "outer_site_packages.pth").write_text(f"{Path(torch.__file__).parents[1]}\n")
    script = shutil.copy(Path(__file__).with_name("wheel_smoke.py"), tmp_path)
    # -I: no PYTHONPATH, no user site, not even the script's folder on sys.path
    env = {**env, "OMP_NUM_THREADS": "1"}
    report = json.loads(_run([python, "-I", str(script)], cwd=tmp_path, env=env).splitlines()[-1])

    installed = (purelib / "galore2" / "__init__.py").resolve()
    assert Path(report["file"]).resolve() == installed
    assert Path(report["metadata_init"]).resolve() == installed
    assert report["version"] == report["metadata_version"] == galore2.__version__
    names = public_optimizers()
    assert {"GaLoreAdamW", "GaLoreAdamW8bit", "GaLoreAdafactor", "Ranger21"} <= set(names)
    assert sorted(report["optimizers"]) == sorted(names)
    for name, result in report["optimizers"].items():
        assert result["finite"] and result["moved"], (name, result)
    assert "torch.uint8" in report["optimizers"]["GaLoreAdamW8bit"]["state_dtypes"]
    # python -m galore2.plan config.json with the wheel alone, from a temporary folder: every
    # preset's row, no recipe imported nor importable, the checkout not on sys.path
    # (tests/plan/test_self_contained.py's fresh-process check, which is marked slow)
    from galore2.plan import OPTIMIZERS

    planner = report["planner"]
    assert planner["optimizers"] == list(OPTIMIZERS) and all(b > 0 for b in planner["states"])
    assert planner["recipes_imported"] == [] and planner["recipes_findable"] is False
    assert not any(str(ROOT) == p.rstrip("/") for p in planner["path"])  # not the checkout
