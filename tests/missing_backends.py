"""One fresh interpreter where every optional package is missing, shared by the tests that
check what galore2 does without them (tests/core/test_import.py, tests/optim/test_adam8bit.py,
tests/integrations/test_hf_trainer.py, tests/plan/test_inputs.py): starting it (torch's
import) is most of each check's cost, so it starts once per test process.

Each check is a part run on its own (``exec``), its stdout captured; a part that raises is
reported with its traceback and the others still run. :func:`parts` returns, per part,
``"ok\\n"`` plus what it printed, or ``"failed\\n"`` plus the traceback.
"""

from __future__ import annotations

import functools
import json

from .helpers import run_python

#: every optional package: ``sys.modules[name] = None`` makes any import of it raise
BLOCKED = (
    "bitsandbytes",
    "triton",
    "transformers",
    "galore_torch",
    "scipy",
    "datasets",
    "accelerate",
    "matplotlib",
)

# name → code; run in this order (the kernels part sets GALORE2_KERNELS: it goes last)
PARTS = {
    # galore2 imports and steps with torch alone, and imports none of them
    "import": (
        "import torch, galore2\n"
        "p = torch.nn.Parameter(torch.randn(8, 12))\n"
        "opt = galore2.GaLoreAdamW([{'params': [p], 'rank': 2}])\n"
        "p.grad = torch.randn_like(p)\n"
        "opt.step()\n"
        f"assert not any(sys.modules.get(n) for n in {BLOCKED!r})\n"
    ),
    # GaLoreAdamW8bit without bitsandbytes: an ImportError that says how to install it
    "adam8bit": (
        "import torch, galore2\n"
        "p = torch.nn.Parameter(torch.randn(8, 12))\n"
        "try:\n"
        "    galore2.GaLoreAdamW8bit([p])\n"
        "except ImportError as e:\n"
        "    assert 'pip install bitsandbytes' in str(e), e\n"
        "else:\n"
        "    raise AssertionError('no ImportError')\n"
    ),
    # galore2.integrations imports without transformers; its transformers module does not
    "integrations": (
        "import galore2, galore2.integrations\n"
        "try:\n"
        "    import galore2.integrations.transformers\n"
        "except ImportError:\n"
        "    pass\n"
        "else:\n"
        "    raise AssertionError('galore2.integrations.transformers imported')\n"
    ),
    # the planner imports; an optimizer that needs bitsandbytes says so and lists the others
    "planner": (
        "import galore2.plan, galore2.plan.cli, galore2.plan.plot\n"
        "from galore2.plan import OPTIMIZERS, state_pieces\n"
        "from tests.helpers import TinyNet\n"
        "try:\n"
        "    state_pieces(OPTIMIZERS['galore_adamw8bit_int4'], TinyNet(), 'all-linear',\n"
        "                 {'rank': 2})\n"
        "except ImportError as e:\n"
        "    print(e)\n"
    ),
    # without triton, automatic kernel selection keeps the torch path; asking for the Triton
    # kernels (GALORE2_KERNELS=triton) is a RuntimeError that names the variable
    "kernels": (
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
    ),
}

_CHILD = f"""
import contextlib, io, json, os, sys, traceback
for name in {BLOCKED!r}:
    sys.modules[name] = None
report = {{}}
for name, code in {PARTS!r}.items():
    out = io.StringIO()
    try:
        with contextlib.redirect_stdout(out):
            exec(code, {{"os": os, "sys": sys}})
    except BaseException:
        report[name] = "failed\\n" + out.getvalue() + traceback.format_exc()
    else:
        report[name] = "ok\\n" + out.getvalue()
print(json.dumps(report))
"""


@functools.cache
def parts() -> dict[str, str]:
    """Each part's report, from one ``python -c`` run (from the repository root, so that
    ``tests`` is importable), once per process."""
    return json.loads(run_python(_CHILD).strip().splitlines()[-1])


def assert_ok(name: str) -> str:
    """Part ``name`` passed; what it printed."""
    status, _, rest = parts()[name].partition("\n")
    assert status == "ok", f"{name}: {rest}"
    return rest
