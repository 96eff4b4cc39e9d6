"""What test_torchtitan.py shares, and its 2-rank FSDP2 worker.

The model is torchtitan's own Llama-3 ``debugmodel`` cut to one decoder layer (its real
parameter names and shapes: fused ``wqkv`` 768×256, ``wo``, ``w1``/``w2``/``w3``, norms,
embeddings 2048×256, ``lm_head``). Gradients are seeded random tensors set on ``.grad``:
the optimizer sees what torchtitan's backward would give it (under FSDP2, the ``Shard(0)``
piece of the full gradient), without running its attention kernels on the CPU.
"""

from __future__ import annotations

import copy
import re

import torch
from torch import nn

from galore2.fsdp.detect import is_dtensor
from galore2.integrations.torchtitan import PROJECTED, galore_config

from .. import dist as shared
from ..helpers import assert_f32_close, f32_bound

#: GaLore settings of the tests: refreshes at steps 0 and 2
SETTINGS = {"lr": 1e-2, "rank": 8, "update_proj_gap": 2, "scale": 0.25, "weight_decay": 0.1}
PLAIN = {"weight_decay": 0.0}


def tiny_llama() -> nn.Module:
    """torchtitan's Llama-3 debug model with one decoder layer, seeded initialization."""
    from torchtitan.models.llama3 import model_registry

    config = model_registry("debugmodel").model
    config.layers = config.layers[:1]
    torch.manual_seed(0)
    model = config.build()
    model.init_states()
    return model


def config(optimizer: str = "galore_adamw", **options):
    """The container config of the tests: attention/MLP weights projected, the rest plain."""
    return galore_config(optimizer, plain=PLAIN, **{**SETTINGS, **options})


def split(model: nn.Module) -> tuple[list[nn.Parameter], list[nn.Parameter]]:
    """(projected, plain) parameters, as torchtitan's first-match-wins patterns split them."""
    projected, plain = [], []
    for name, p in model.named_parameters():
        (projected if re.search(PROJECTED, name) else plain).append(p)
    return projected, plain


def set_grads(model: nn.Module, step: int) -> None:
    """Seeded full gradients; a sharded parameter gets its own piece (``Shard(0)``)."""
    from torch.distributed.tensor import distribute_tensor

    g = torch.Generator().manual_seed(1000 + step)
    for p in model.parameters():
        grad = torch.randn(p.shape, generator=g)
        if is_dtensor(p):
            grad = distribute_tensor(grad, p.device_mesh, p.placements, src_data_rank=None)
        p.grad = grad


def train(model: nn.Module, opt: torch.optim.Optimizer, steps: range) -> None:
    """torchtitan's order per step: zero_grad, gradients, step."""
    for step in steps:
        opt.zero_grad()
        set_grads(model, step)
        opt.step()


def assert_same_state(a: dict, b: dict, what: str) -> None:
    """Two flat state dicts: the same keys, tensors bitwise equal (dtype included)."""
    assert a.keys() == b.keys(), f"{what}: keys differ: {sorted(a.keys() ^ b.keys())}"
    for key, x in a.items():
        y = b[key]
        if isinstance(x, torch.Tensor):
            x, y = shared.full(x), shared.full(y)
            assert x.dtype == y.dtype and torch.equal(x, y), f"{what}: {key} differs"
        else:
            assert x == y, f"{what}: {key}: {x!r} != {y!r}"


# ---- 2 ranks, FSDP2 ---------------------------------------------------------------------------

STEPS = 4  # refreshes at 0 and 2


def parallelize(model: nn.Module, world: int) -> nn.Module:
    """torchtitan's own ``parallelize_llama`` (FSDP2 over all ranks, ``partial_dtensor``
    backend: ``Shard(0)`` DTensor parameters on a 1-D mesh) on gloo CPU ranks. torchtitan
    builds its meshes on its accelerator type, read once at import: set to ``cpu`` here."""
    import torchtitan.distributed.parallel_dims as parallel_dims_module
    from torchtitan.config import CompileConfig, ParallelismConfig, TrainingConfig
    from torchtitan.distributed.parallel_dims import ParallelDims
    from torchtitan.models.llama3 import parallelize_llama

    parallel_dims_module.device_type = "cpu"
    parallelism = ParallelismConfig(spmd_backend="partial_dtensor")
    dims = ParallelDims.from_config(parallelism, world_size=world)
    dims.build_mesh()
    return parallelize_llama(
        model,
        parallel_dims=dims,
        training=TrainingConfig(mixed_precision_param="float32"),
        parallelism=parallelism,
        compile_config=CompileConfig(),
        ac_config=None,
        dump_folder="",
    )


def fsdp_matches_single(rank: int, world: int) -> None:
    """The container on a model sharded by torchtitan's ``parallelize_llama`` (built the
    trainer's way, after sharding) trains as in one process; its flat state dict holds the
    same values; loading it into a fresh sharded container continues identically."""
    reference = tiny_llama()
    ref_opt = config().build(model_parts=[reference])
    train(reference, ref_opt, range(STEPS))

    def build() -> tuple[nn.Module, torch.optim.Optimizer]:
        model = parallelize(tiny_llama(), world)
        return model, config().build(model_parts=[model])

    model, opt = build()
    for p in model.parameters():
        assert is_dtensor(p) and p.device_mesh.ndim == 1 and p.placements[0].is_shard(0)
    train(model, opt, range(STEPS))
    # Sharded vs one process: the same arithmetic, reductions split across the ranks (PᵀG's
    # sum over a matrix's rows is two partial sums and an all-reduce; the refresh's sketch
    # and Gram matrices likewise), so float32 bounds derived from the computation
    # (tests.helpers.f32_bound), not one CPU's rounding. A reordered sum of n random-sign
    # terms moves by about √n ulps of its result (Σ|terms| ≈ √n·|Σ terms|); a projected
    # gradient is such a sum over a basis that is itself one: n ulps, 2n for a squared
    # moment, per step; n is the longest sum, the largest projected dimension (768). Measured
    # on an AVX2 CPU: ≤ 38 ulps of the state's magnitude; reported on an AVX-512 CPU: 1.81e-5
    # on moments of magnitude ≤ 0.91 (≈ 170 ulps); the bound: 2n·4 steps ≈ 6100 ulps, i.e.
    # 7e-4 of the moments' magnitude, where a wrong coefficient moves them by > 1e-2.
    n = max(max(p.shape) for p in split(reference)[0])
    ulps = 2 * n
    # The weights: 2 ulps of their magnitude per step, plus the updates' own rounding, the
    # same ulps of the total change (measured: 8.6e-8 on a weight of magnitude 0.06, whose
    # change is ≈ 1e-3).
    start = tiny_llama()
    for (name, p), q, q0 in zip(model.named_parameters(), reference.parameters(),
                                start.parameters(), strict=True):  # fmt: skip
        change = f32_bound(q.detach() - q0.detach(), STEPS, ulps)
        assert_f32_close(shared.full(p), shared.full(q), steps=STEPS, extra=change,
                         what=f"FSDP2 vs one process: {name}")  # fmt: skip
    assert shared.refresh_counts(opt.optimizers[0]) == [2] * 5

    # The optimizer state holds what those sums produced (bases, moments of projected
    # gradients): the same ulps of its magnitude on every step.
    flat, ref_flat = opt.state_dict(), ref_opt.state_dict()
    assert flat.keys() == ref_flat.keys()
    for key, value in flat.items():
        if isinstance(value, torch.Tensor):
            got, want = shared.full(value), ref_flat[key]
            if not want.is_floating_point():
                assert torch.equal(got, want), f"{key}: sharded state differs from one process"
                continue
            assert_f32_close(got, want, steps=STEPS, ulps=ulps,
                             what=f"{key}: sharded state vs one process")  # fmt: skip

    resumed, resumed_opt = build()
    with torch.no_grad():
        for p, q in zip(resumed.parameters(), model.parameters(), strict=True):
            p.copy_(q)
    resumed_opt.load_state_dict(copy.deepcopy(flat))
    assert_same_state(resumed_opt.state_dict(), flat, "after load (FSDP2)")
    train(model, opt, range(STEPS, STEPS + 1))
    train(resumed, resumed_opt, range(STEPS, STEPS + 1))
    # bitwise: both runs are sharded alike, the same kernels in the same order
    for p, q in zip(resumed.parameters(), model.parameters(), strict=True):
        assert torch.equal(shared.full(p), shared.full(q)), "resumed run differs"
