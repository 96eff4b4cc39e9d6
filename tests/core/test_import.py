"""``import galore2`` needs only torch: optional backends are imported lazily."""

from __future__ import annotations

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


def test_import_with_optional_backends_missing():
    code = (
        "import sys\n"
        f"for name in {BLOCKED!r}:\n"
        "    sys.modules[name] = None  # any import of it raises ImportError\n"
        "import torch, galore2\n"
        "p = torch.nn.Parameter(torch.randn(8, 12))\n"
        "opt = galore2.GaLoreAdamW([{'params': [p], 'rank': 2}])\n"
        "p.grad = torch.randn_like(p)\n"
        "opt.step()\n"
        f"assert not any(sys.modules.get(n) for n in {BLOCKED!r})\n"
        "print('ok')\n"
    )
    assert run_python(code).strip().endswith("ok")


def test_kernels_without_triton_fall_back_or_fail_clearly():
    """Without triton, automatic kernel selection keeps the torch path, and asking for the
    Triton kernels (GALORE2_KERNELS=triton) is a RuntimeError that names the variable."""
    code = (
        "import os, sys\n"
        "sys.modules['triton'] = None\n"
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
        "print('ok')\n"
    )
    assert run_python(code).strip().endswith("ok")
