"""galore2.kernels.direct: a custom op's implementation called directly in plain eager calls
(no torch.library wrapper), the op itself everywhere else, and the mutated arguments marked
written either way."""

from __future__ import annotations

import sys

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from galore2.kernels import dispatch, ops
from galore2.kernels.direct import direct, plain_eager


class _Calls:
    def __init__(self) -> None:
        self.op, self.impl = [], []

    def make(self):
        def op(*args):
            self.op.append(args)

        def impl(*args):
            self.impl.append(args)
            return "done"

        return direct(op, impl, mutated=(0,))


class _Mode(TorchDispatchMode):
    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        return func(*args, **(kwargs or {}))


def test_plain_eager_calls_the_implementation_and_anything_else_the_op():
    calls = _Calls()
    f = calls.make()
    a, b = [torch.zeros(3)], torch.ones(2)
    with torch.no_grad():
        assert f(a, b) == "done"
    assert len(calls.impl) == 1 and not calls.op
    f(a, b)  # grad mode on: the op
    with torch.no_grad(), _Mode():  # a dispatch mode (the roofline's counters): the op
        f(a, b)
    with torch.no_grad():
        f([torch.zeros(3, device="meta")], b)  # meta tensors: the op (its fake)
        f([torch.nn.Parameter(torch.zeros(3))], b)  # a Parameter is plain
    assert len(calls.op) == 3 and len(calls.impl) == 2


def test_a_tensor_subclass_goes_through_the_op():
    class Sub(torch.Tensor):
        pass

    t = torch.zeros(2).as_subclass(Sub)
    with torch.no_grad():
        assert not plain_eager(([t],))
        assert plain_eager(([torch.zeros(2)], 3, 0.5))


def test_a_list_of_numbers_is_no_obstacle():
    """A deferred step's flag positions (a list of ints) and other number lists hold no
    tensor: the call stays direct (a list of tensors is still walked)."""
    with torch.no_grad():
        assert plain_eager(([torch.zeros(2)], torch.ones(1, dtype=torch.bool), [0, 3, 1]))
        assert plain_eager(([torch.zeros(2)], [0.5, 1.0], [], None))
        assert not plain_eager(([torch.zeros(2)], [0, 1], [torch.zeros(1, device="meta")]))


def test_mutated_arguments_are_marked_written():
    calls = _Calls()
    f = calls.make()
    a, b = [torch.zeros(3), torch.zeros(2)], torch.ones(2)
    before = [t._version for t in a], b._version
    with torch.no_grad():
        f(a, b)
    assert [t._version for t in a] == [v + 1 for v in before[0]]
    assert b._version == before[1]  # not mutated: untouched


@pytest.mark.skipif(sys.platform != "linux", reason="triton is installed on Linux only")
def test_adamw_direct_equals_the_op_and_bumps_what_the_kernel_writes(monkeypatch):
    """galore2::adamw_ called directly (the Triton kernel, which writes through pointers and
    bumps no version itself) and through the op: the same bits, and the weights' and
    moments' version counters moved (the gradients' not) either way."""
    if not (dispatch.interpreter_enabled() or torch.cuda.is_available()):
        pytest.skip("the kernel runs under Triton's interpreter or on a GPU")
    device = "cpu" if dispatch.interpreter_enabled() else "cuda"
    monkeypatch.setenv(dispatch.ENV_VAR, "triton")
    gen = torch.Generator().manual_seed(3)
    lists = [
        [torch.randn(5, 7, generator=gen).to(torch.bfloat16) for _ in range(3)],
        [torch.randn(5, 7, generator=gen).to(torch.bfloat16) for _ in range(3)],
        [torch.rand(5, 7, generator=gen) for _ in range(3)],
        [torch.rand(5, 7, generator=gen) for _ in range(3)],
    ]
    a = [[t.clone().to(device) for t in ts] for ts in lists]
    b = [[t.clone().to(device) for t in ts] for ts in lists]
    args = (2, 1e-2, 0.9, 0.999, 1e-8, 0.999)
    versions = [[t._version for t in ts] for ts in a]
    with torch.no_grad():
        ops.adamw_(*a, *args)
        ops.adamw_op(*b, *args)
    for x, y in zip(a, b, strict=True):
        assert all(torch.equal(s, t) for s, t in zip(x, y, strict=True))
    for k, (ts, vs) in enumerate(zip(a, versions, strict=True)):
        moved = [t._version > v for t, v in zip(ts, vs, strict=True)]
        assert all(moved) if k != 1 else not any(moved)
