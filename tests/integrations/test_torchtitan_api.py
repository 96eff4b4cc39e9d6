"""Which torchtitan API galore2's integration uses (issue 39 item 14): decided by what
``torchtitan.components.optimizer`` provides, checked on fake modules (any torchtitan
installed, or none: the dispatch itself is plain Python), and torchtitan 0.3.x on a torch
without ``DataParallelMeshDims`` reported as such."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

pytest.importorskip("torchtitan.components.optimizer", reason="torchtitan not installed")

import galore2.integrations.torchtitan as tt  # noqa: E402


def test_the_api_is_read_from_the_optimizer_module():
    assert tt.api_of(SimpleNamespace(ParamGroupConfig=object, OptimizersContainer=object)) == "0.3"
    legacy = SimpleNamespace(build_optimizers=lambda *a: None, OptimizersContainer=object)
    assert tt.api_of(legacy) == "0.2"
    with pytest.raises(ImportError, match="supports torchtitan 0.2.x and 0.3.x"):
        tt.api_of(SimpleNamespace(OptimizersContainer=object))


def test_the_installed_torchtitan_gets_its_api():
    import torchtitan.components.optimizer as optimizer

    assert tt.API == tt.api_of(optimizer)
    exported = {"0.3": "check_config", "0.2": "build_optimizers"}[tt.API]
    assert exported in tt.__all__


def test_torchtitan_03_on_an_older_torch_says_which_to_install(monkeypatch):
    def fail(name):
        raise ImportError("cannot import name 'DataParallelMeshDims' from "
                          "'torch.distributed.fsdp'")  # fmt: skip

    monkeypatch.setattr(tt, "import_module", fail)
    with pytest.raises(ImportError, match=r"needs torch >= 2\.12 .*install torchtitan 0\.2\.2"):
        tt._import_optimizer_module()
