"""What one optimizer step costs an accelerator, counted on the CPU.

``python -m benchmarks.run --tasks step_counts`` (about a minute): for every contender of
the suite (``benchmarks.contenders``: torch AdamW, bitsandbytes, galore-torch, apollo-torch,
fira, pytorch-optimizer, every galore2 optimizer) and galore2's batched path
(``foreach=True``), one non-refresh ``step()`` on the tiny recipe's model (a 4-layer Llama:
hidden 128, 39 parameters, the 28 attention/MLP matrices projected at rank 16,
``update_proj_gap`` 10**9), after two warm-up steps, with fixed seeded gradients. Counted
with a ``TorchDispatchMode`` (:class:`StepCounter`):

* **launches** — aten ops that would be kernel launches on a GPU: every dispatched op except
  views and other metadata-only ops (``view``, ``transpose``, ``unbind``, ``empty``…, and
  ``prim`` ops such as a fake tensor's ``device``),
  profiler markers, host reads, and arithmetic on host-resident scalars (the optimizers'
  step counters: CPU tensors on a GPU too);
* **matmuls** — the launches that are matrix products (``mm``, ``addmm``, ``bmm``…): the
  projections and back-projections, outside the op budget;
* **syncs** — device→host synchronizations: reads of a tensor's value (``.item()``,
  ``float()``, ``int()``, ``bool()``: ``aten._local_scalar_dense``) except of host-resident
  counters, plus galore2's one batched read (``galore2._numerics.host_list``, whose
  ``tolist`` dispatches no op);
* **counter reads** — reads of host-resident step counters (free on a GPU);
* **graph breaks** — ``torch._dynamo.explain(opt.step)()``'s count (no compilation).

Host-resident: 0-d CPU tensors of integer dtype (galore2 keeps every counter so, on any
device) and torch.optim's 0-d ``step`` tensors (CPU unless ``capturable``).
The test suite asserts the budgets from this module (``tests/core/test_step_budget.py``).
"""

from __future__ import annotations

import contextlib
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any
from unittest import mock

import torch
from torch._subclasses.fake_tensor import FakeTensor
from torch.utils._python_dispatch import TorchDispatchMode

import galore2._numerics as numerics
from recipes import optimizers
from recipes.config import ModelConfig
from recipes.model import build_model
from recipes.resolve import parse_args

from ._common import render, table
from .contenders import CONTENDERS, why_not
from .peers import PEERS, quiet_peers
from .timing import llama

MATMULS = frozenset(
    {"mm", "addmm", "addmm_", "bmm", "baddbmm", "baddbmm_", "matmul", "_grouped_mm",
     "mm_each_", "addmm_each_", "addmm_scaled_each_", "residual_norms_each",
     "project_norms_each"}
)  # fmt: skip
NOT_LAUNCHES = frozenset(
    {
        "_local_scalar_dense",
        "_record_function_enter_new",
        "_record_function_exit",
        "empty",
        "empty_like",
        "empty_strided",
        "new_empty",
        "new_empty_strided",
        "lift_fresh",
        "_to_copy_noop",
    }
)


@dataclass
class Counts:
    launches: int = 0
    matmuls: int = 0
    host_ops: int = 0  # arithmetic on host-resident counters
    views: int = 0
    syncs: int = 0
    counter_reads: int = 0
    ops: Counter[str] | None = None

    @property
    def dispatched(self) -> int:
        return sum((self.ops or Counter()).values())


def _host_resident(t: Any, steps: set[int]) -> bool:
    if not isinstance(t, torch.Tensor) or t.device.type != "cpu":
        return False
    if t.dim() != 0:  # a batch's counters packed in one int64 tensor (galore2.core.counters)
        return t.dtype == torch.int64 and t.untyped_storage().data_ptr() in steps
    return not t.is_floating_point() or t.data_ptr() in steps


class StepCounter(TorchDispatchMode):
    """Counts what a step dispatches (see the module docstring). ``steps``: data pointers
    of 0-d float ``step`` tensors that live on the host (torch.optim's)."""

    def __init__(self, steps: set[int] | None = None) -> None:
        super().__init__()
        self.steps = steps or set()
        self.counts = Counts(ops=Counter())

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func.overloadpacket.__name__
        c = self.counts
        assert c.ops is not None
        c.ops[name] += 1
        tensors = [
            a
            for a in torch.utils._pytree.tree_leaves((args, kwargs))
            if isinstance(a, torch.Tensor)
        ]
        if name == "_local_scalar_dense":
            if _host_resident(args[0], self.steps):
                c.counter_reads += 1
            else:
                c.syncs += 1
        elif func.is_view or name in NOT_LAUNCHES or func.namespace == "prim":
            c.views += 1
        elif tensors and all(_host_resident(t, self.steps) for t in tensors):
            c.host_ops += 1
        else:
            c.launches += 1
            if name in MATMULS:
                c.matmuls += 1
            out = func(*args, **(kwargs or {}))
            self.launched(func, args, kwargs or {}, out)
            return out
        return func(*args, **(kwargs or {}))

    def launched(self, func: Any, args: tuple, kwargs: dict, out: Any) -> None:
        """Called after each launch ran (default: nothing): a subclass measures it
        (``benchmarks.roofline``: bytes and FLOPs)."""


@contextlib.contextmanager
def counting(
    opt: torch.optim.Optimizer, mode: type[StepCounter] = StepCounter
) -> Iterator[Counts]:
    """Count what ``opt`` dispatches inside the block (galore2's batched reads included);
    ``mode``: the counter (a subclass measures more, see :meth:`StepCounter.launched`)."""
    items = [(k, v) for s in opt.state.values() for k, v in s.items()]
    tensors = [v for _, v in items if isinstance(v, torch.Tensor)]
    steps = {  # torch.optim's float step counters (fake tensors: on the device, none)
        v.data_ptr()
        for k, v in items
        if k == "step" and isinstance(v, torch.Tensor) and v.dim() == 0
        and not isinstance(v, FakeTensor)
    }
    # the storages of packed host counters (0-d int64 views of one tensor per batch)
    steps |= {
        v.untyped_storage().data_ptr()
        for v in tensors
        if v.dim() == 0 and v.dtype == torch.int64 and v.device.type == "cpu"
    }
    counter = mode(steps)
    real = numerics.host_list

    def host_list(t: torch.Tensor) -> list:
        counter.counts.syncs += 1
        return real(t)

    with mock.patch.object(numerics, "host_list", host_list), counter:
        yield counter.counts


def tiny_model() -> torch.nn.Module:
    """The tiny recipe's model (:func:`benchmarks.timing.llama`, seed 0)."""
    return llama(parse_args(["--config", "tiny"]).model)


def count_step(
    make: Callable[[torch.nn.Module], torch.optim.Optimizer],
    model: torch.nn.Module | None = None,
    warmup: int = 2,
    mode: type[StepCounter] = StepCounter,
) -> Counts:
    """Counts of one ``step()`` of ``make(model)`` after ``warmup`` steps (fixed gradients),
    by ``mode`` (see :func:`counting`)."""
    model = model if model is not None else tiny_model()
    opt = make(model)
    params = [p for p in model.parameters() if p.requires_grad]
    gen = torch.Generator().manual_seed(1)
    grads = [  # meta and fake tensors hold no values
        torch.empty_like(p)
        if p.is_meta or isinstance(p, FakeTensor)
        else torch.randn(p.shape, generator=gen).to(p)
        for p in params
    ]
    for i in range(warmup + 1):
        for p, g in zip(params, grads, strict=True):
            p.grad = g.clone()
        if i < warmup:
            opt.step()
            continue
        with counting(opt, mode) as counts:
            opt.step()
    return counts


def graph_breaks(make: Callable[[torch.nn.Module], torch.optim.Optimizer]) -> int:
    """``torch._dynamo.explain(opt.step)()``'s graph break count after two eager steps."""
    model = tiny_model()
    opt = make(model)
    for _ in range(2):
        for p in model.parameters():
            p.grad = torch.ones_like(p) * 1e-3
        opt.step()
    torch._dynamo.reset()
    return int(torch._dynamo.explain(opt.step)().graph_break_count)


def contender_maker(key: str, **options: Any) -> Callable[[torch.nn.Module], torch.optim.Optimizer]:
    """A contender of the suite at the tiny model's sizes (rank 16, no refresh after the first);
    ``options``: extra galore2 options (``foreach=True``)."""
    contender = next(c for c in CONTENDERS if c.key == key)

    def make(model: torch.nn.Module) -> torch.optim.Optimizer:
        cfg = contender.optim_config(rank=16, update_proj_gap=10**9)
        cfg.options.update(options)
        return optimizers.build_optimizer(model, cfg, 1000, PEERS)

    return make


def same_groups_adamw(opt: torch.optim.Optimizer) -> torch.optim.Optimizer:
    """torch AdamW (foreach) over ``opt``'s parameter groups: the op budget's reference
    (foreach kernels run once per group, in torch's optimizers as in galore2's)."""
    return torch.optim.AdamW([{"params": g["params"]} for g in opt.param_groups], foreach=True)


BIG = {"vocab_size": 32000, "dim": 4096, "n_layers": 2, "n_heads": 32, "ffn_dim": 11008}
BIG_ROWS = ("galore_adamw", "galore_adafactor", "galore2_fira", "galore2_apollo")


def big_model() -> torch.nn.Module:
    """Two decoder layers of Llama-7B's shapes (and its embeddings and head), on the meta
    device: every op dispatches, nothing is allocated or computed."""
    return build_model(ModelConfig(**BIG, max_seq_len=16), device="meta")


class _MetaValues(TorchDispatchMode):
    """Reads of meta tensors (which hold no values) answer 1: norms are positive and finite,
    certificates true."""

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func.overloadpacket.__name__ == "_local_scalar_dense" and args[0].is_meta:
            return True if args[0].dtype == torch.bool else 1
        return func(*args, **(kwargs or {}))


@contextlib.contextmanager
def meta_reads() -> Iterator[None]:
    """Meta tensors hold no values: the batched flag read answers "all usable", other reads
    1 (see :class:`_MetaValues`), so a step runs through on meta tensors."""
    with mock.patch.object(numerics, "host_list", lambda t: [True] * t.numel()), _MetaValues():
        yield


def big_table() -> str:
    """Launches and syncs at Llama-7B layer shapes (meta tensors): the counts of the tiny
    model's table do not depend on shapes."""
    body = []
    with meta_reads():
        ref = count_step(
            lambda m: same_groups_adamw(contender_maker("galore_adamw")(m)), big_model()
        )
        body.append(
            ["torch AdamW (foreach), same groups", ref.dispatched, ref.launches, 0, ref.syncs]
        )
        for key in BIG_ROWS:
            label = next(c.label for c in CONTENDERS if c.key == key)
            c = count_step(contender_maker(key, projector="svd"), big_model())
            body.append([f"{label} (batched: the default off the CPU)", c.dispatched, c.launches,
                         c.matmuls, c.syncs])  # fmt: skip
    head = ["optimizer", "aten ops", "launches", "of them matmuls", "syncs"]
    lead = (
        "**Llama-7B layer shapes** (2 decoder layers: 4096×4096 attention, 11008×4096 / "
        "4096×11008 MLP, 32000×4096 embeddings and head; meta tensors, rank 16, exact-SVD projector: a meta tensor has no random generator, and a non-refresh step does not depend on the projector):\n\n"
    )
    return lead + table(head, body)


def rows(quick: bool = False) -> list[tuple[str, Callable, bool]]:
    """(label, maker, galore2's batched path) of every row."""
    out: list[tuple[str, Callable, bool]] = [
        ("torch AdamW, foreach", lambda m: torch.optim.AdamW(m.parameters(), foreach=True), False),
        (
            "torch AdamW, single-tensor",
            lambda m: torch.optim.AdamW(m.parameters(), foreach=False),
            False,
        ),
    ]
    for c in CONTENDERS:
        if c.key == "adamw":
            continue
        if quick and c.key not in ("galore_adamw", "gt_galore_adamw"):
            continue
        if why_not(c.key) is not None:
            continue
        out.append((c.label, contender_maker(c.key), False))
        if c.package == "galore2":
            out.append((f"{c.label}, foreach=True", contender_maker(c.key, foreach=True), True))
        if c.key in ("galore_adamw", "galore2_fira"):
            out.append(
                (f"{c.label}, capturable=True", contender_maker(c.key, capturable=True), False)
            )
    return out


def step_counts(quick: bool = False) -> str:
    body = []
    with quiet_peers():
        for label, make, _ in rows(quick):
            c = count_step(make)
            gb = graph_breaks(make)
            body.append(
                [label, c.dispatched, c.launches, c.matmuls, c.syncs, c.counter_reads,
                 gb]
            )  # fmt: skip
    head = ["optimizer", "aten ops", "launches", "of them matmuls", "syncs", "counter reads",
            "graph breaks"]  # fmt: skip
    tiny = "**Tiny recipe model** (4-layer Llama, hidden 128, 39 parameters, 28 projected at rank 16):\n\n"
    return render("step_counts", tiny=tiny + table(head, body), big=big_table())
