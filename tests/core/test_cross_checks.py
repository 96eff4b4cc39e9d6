"""Checks across keys declare every key they read and see only those (``CrossCheck``)."""

from __future__ import annotations

import ast
import importlib
import inspect
import pkgutil
import textwrap
from collections.abc import Callable

import pytest
import torch
from torch import nn

import galore2
from galore2.core.module import Module
from galore2.core.modules import DecoupledWeightDecay
from galore2.core.nonfinite import NonFinitePolicy
from galore2.core.options import CrossCheck, Int, Option, Seen, resolve
from galore2.core.transform import Transform
from galore2.optim.adam import ScaleByAdam
from galore2.optim.schedules import WarmupWarmdown


def test_a_view_refuses_every_key_its_check_does_not_declare():
    group = {"rank": 4, "proj_type": "std", "lr": 0.1}
    view = Seen(group, ("rank", "proj_type", "scale"), "my_check")
    assert view["rank"] == 4 and view.get("proj_type") == "std"
    assert view.get("scale", 1.0) == 1.0 and "scale" not in view  # declared, absent
    assert dict(view) == {"rank": 4, "proj_type": "std"} and len(view) == 2
    for read in (lambda: view["lr"], lambda: view.get("lr", 0.0), lambda: "lr" in view):
        with pytest.raises(
            KeyError, match=r"my_check reads 'lr'.*\['proj_type', 'rank', 'scale'\]"
        ):
            read()


def test_checks_run_on_the_resolved_group_through_their_views():
    a, b = Option("a", 1, Int(low=0), "a"), Option("b", 2, Int(low=0), "b")
    seen: list[dict] = []

    def a_below_b(group):
        seen.append(dict(group))
        if group["a"] >= group["b"]:
            raise ValueError(f"a must be < b ({group['b']}), got {group['a']}")

    checks = (CrossCheck(("a", "b"), a_below_b),)
    out = resolve({"a": a, "b": b}, {"a": 0, "params": []}, passthrough=("params",), checks=checks)
    assert out == {"a": 0, "b": 2, "params": []} and seen == [{"a": 0, "b": 2}]
    with pytest.raises(ValueError, match="a must be < b"):
        resolve({"a": a, "b": b}, {"a": 5}, checks=checks)
    with pytest.raises(ValueError, match="a must be"):  # the single-key check came first
        resolve({"a": a, "b": b}, {"a": -1}, checks=checks)

    def reads_b_too(group):
        return group["b"]

    with pytest.raises(KeyError, match="reads_b_too reads 'b'"):
        resolve({"a": a, "b": b}, {}, checks=(CrossCheck(("a",), reads_b_too),))


def _modules() -> list[object]:
    """Every module kind of the package (classes; the schedule whose checks are its
    instance's, built), the non-finite policy and the decay."""
    for info in pkgutil.walk_packages(galore2.__path__, "galore2."):
        if ".kernels." not in info.name and ".integrations." not in info.name:
            importlib.import_module(info.name)
    found, todo = set(), [Module]
    while todo:
        for sub in todo.pop().__subclasses__():
            if sub.__module__.startswith("galore2.") and sub not in found:
                found.add(sub)
                todo.append(sub)
    return [*sorted(found, key=lambda c: c.__qualname__), WarmupWarmdown(), NonFinitePolicy,
            DecoupledWeightDecay]  # fmt: skip


def _group_name(fn: Callable) -> tuple[ast.FunctionDef, str]:
    tree = ast.parse(textwrap.dedent(inspect.getsource(fn)))
    node = tree.body[0]
    assert isinstance(node, ast.FunctionDef)
    names = [a.arg for a in node.args.args]
    return node, names[1] if names[0] == "self" else names[0]


def _reads(fn: Callable, depth: int = 0) -> set[str]:
    """The constant keys ``fn`` reads of its group argument (``g["k"]``, ``g.get("k")``),
    and of the functions of its module it hands the group to."""
    node, group = _group_name(fn)
    keys: set[str] = set()
    for n in ast.walk(node):
        if isinstance(n, ast.Subscript) and isinstance(n.value, ast.Name) and n.value.id == group:
            assert isinstance(n.slice, ast.Constant), f"{fn.__qualname__}: a computed key"
            keys.add(n.slice.value)
        if not isinstance(n, ast.Call):
            continue
        f = n.func
        if isinstance(f, ast.Attribute) and isinstance(f.value, ast.Name) and f.value.id == group:
            assert f.attr == "get" and isinstance(n.args[0], ast.Constant), fn.__qualname__
            keys.add(n.args[0].value)
        elif isinstance(f, ast.Name) and any(
            isinstance(a, ast.Name) and a.id == group for a in n.args
        ):
            callee = getattr(fn, "__globals__", {}).get(f.id)
            if inspect.isfunction(callee) and depth < 3:
                keys |= _reads(callee, depth + 1)
    return keys


def test_every_check_declares_every_key_it_reads():
    checks = [c for m in _modules() for c in m.checks]
    assert len({c.fn for c in checks}) >= 6  # projector, basis, residual, schedule, ...
    for check in checks:
        fn = getattr(check.fn, "__func__", check.fn)
        undeclared = _reads(fn) - set(check.keys)
        assert not undeclared, f"{fn.__qualname__} reads {undeclared} without declaring them"


def test_an_overridden_validate_is_refused_when_the_optimizer_is_built():
    class OldStyle(Transform):
        name = "old_style"

        def validate(self, group):
            raise AssertionError("never called")

    with pytest.raises(TypeError, match=r"OldStyle overrides validate.*CrossCheck"):
        galore2.ChainOptimizer([nn.Parameter(torch.zeros(2, 2))], [OldStyle()], {})


def test_complex_problems_are_asked_only_of_groups_with_complex_parameters(monkeypatch):
    asked: list[str] = []
    monkeypatch.setattr(ScaleByAdam, "complex_problem", lambda self, g: asked.append("adam"))
    galore2.GaLoreAdamW([nn.Parameter(torch.zeros(4, 4))], rank=2)
    assert asked == []
    galore2.GaLoreAdamW([nn.Parameter(torch.zeros(4, 4, dtype=torch.complex64))])
    assert asked == ["adam"]
