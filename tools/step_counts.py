"""What one optimizer step costs an accelerator, counted on the CPU.

    python -m tools.step_counts

For a 4-layer Llama (the tiny recipe's model: hidden 128, 39 parameters, the 28 linear
weights projected at rank 16) one non-refresh ``step()`` of each optimizer below, after
two warm-up steps, counted with a ``TorchDispatchMode``: aten ops dispatched (each a kernel
launch on a GPU) and host reads of tensor values (``aten._local_scalar_dense``: ``.item()``,
``float()``, ``int()``, ``bool()`` — a device→host synchronization on a GPU).
"""

from __future__ import annotations

from collections import Counter

import torch
from torch.utils._python_dispatch import TorchDispatchMode

import galore2
from recipes.config import parse_args
from recipes.model import build_model


class Count(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.ops: Counter[str] = Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops[str(func.overloadpacket.__name__)] += 1
        return func(*args, **(kwargs or {}))


def count(make) -> tuple[int, int]:
    torch.manual_seed(0)
    model = build_model(parse_args(["--config", "tiny"]).model)
    opt = make(model)
    grads = [torch.randn_like(p) for p in model.parameters()]
    for _ in range(3):  # two warm-up steps, then the counted one
        for p, g in zip(model.parameters(), grads, strict=True):
            p.grad = g.clone()
        if _ == 2:
            with Count() as c:
                opt.step()
        else:
            opt.step()
    return sum(c.ops.values()), c.ops["_local_scalar_dense"]


def galore(model, **kw):
    groups = galore2.param_groups(model, rank=16, update_proj_gap=10**9)
    return galore2.GaLoreAdamW(groups, lr=1e-3, **kw)


ROWS = {
    "torch AdamW, foreach": lambda m: torch.optim.AdamW(m.parameters(), foreach=True),
    "torch AdamW, single-tensor": lambda m: torch.optim.AdamW(m.parameters(), foreach=False),
    "galore2 GaLoreAdamW (nonfinite='skip')": galore,
    "galore2 GaLoreAdamW, nonfinite='ignore'": lambda m: galore(m, nonfinite="ignore"),
}


def main() -> None:
    print("| optimizer | aten ops dispatched | host reads (_local_scalar_dense) |")
    print("|---|---|---|")
    for name, make in ROWS.items():
        ops, reads = count(make)
        print(f"| {name} | {ops} | {reads} |")


if __name__ == "__main__":
    main()
