"""``import galore2`` needs only torch: optional backends are imported lazily."""

from __future__ import annotations

import subprocess
import sys

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
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip().endswith("ok")
