"""``import galore2`` needs only torch: optional backends are imported lazily.

Both checks run in one fresh interpreter (its imports are most of the cost), each part in
its own ``try`` so that one failing still lets the other report: every optional backend is
blocked there, triton among them.
"""

from __future__ import annotations

import pytest

from ..helpers import run_python

BLOCKED = (
    "bitsandbytes",
    "triton",
    "transformers",
    "galore_torch",
    "scipy",
    "datasets",
    "accelerate",
)

IMPORT = (
    "import torch, galore2\n"
    "p = torch.nn.Parameter(torch.randn(8, 12))\n"
    "opt = galore2.GaLoreAdamW([{'params': [p], 'rank': 2}])\n"
    "p.grad = torch.randn_like(p)\n"
    "opt.step()\n"
    f"assert not any(sys.modules.get(n) for n in {BLOCKED!r})\n"
)

# Without triton, automatic kernel selection keeps the torch path, and asking for the
# Triton kernels (GALORE2_KERNELS=triton) is a RuntimeError that names the variable.
KERNELS = (
    "import torch, galore2\n"
    "from galore2 import kernels\n"
    "assert not kernels.triton_available()\n"
    "p = torch.nn.Parameter(torch.randn(8, 12))\n"
    "opt = galore2.GaLoreAdamW([{'params': [p], 'rank': 2}])\n"
    "p.grad = torch.randn_like(p)\n"
    "os.environ['GALORE2_KERNELS'] = 'triton'\n"
    "try:\n"
    "    opt.step()\n"
    "except RuntimeError as err:\n"
    "    assert 'GALORE2_KERNELS=triton but triton cannot be imported' in str(err), err\n"
    "else:\n"
    "    raise AssertionError('no error')\n"
    "os.environ['GALORE2_KERNELS'] = 'auto'\n"
    "opt.step()\n"
)


@pytest.fixture(scope="module")
def without_optional_backends() -> str:
    """The interpreter's stdout: ``<name> ok`` per part that passed, else its traceback."""
    code = (
        "import os, sys, traceback\n"
        f"for name in {BLOCKED!r}:\n"
        "    sys.modules[name] = None  # any import of it raises ImportError\n"
        f"for name, part in (('import', {IMPORT!r}), ('kernels', {KERNELS!r})):\n"
        "    try:\n"
        "        exec(part, {'os': os, 'sys': sys})\n"
        "    except BaseException:\n"
        "        print(f'{name} failed:', traceback.format_exc())\n"
        "    else:\n"
        "        print(f'{name} ok')\n"
    )
    return run_python(code)


def test_import_with_optional_backends_missing(without_optional_backends):
    assert "import ok" in without_optional_backends.splitlines(), without_optional_backends


def test_kernels_without_triton_fall_back_or_fail_clearly(without_optional_backends):
    assert "kernels ok" in without_optional_backends.splitlines(), without_optional_backends
