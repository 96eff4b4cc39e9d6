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
    shared.assert_params_match(model, reference, atol=1e-6, what="FSDP2 vs one process")
    assert shared.refresh_counts(opt.optimizers[0]) == [2] * 5

    flat, ref_flat = opt.state_dict(), ref_opt.state_dict()
    assert flat.keys() == ref_flat.keys()
    for key, value in flat.items():
        if isinstance(value, torch.Tensor):
            diff = (shared.full(value).float() - ref_flat[key].float()).abs().max().item()
            assert diff <= 1e-5, f"{key}: sharded state differs from one process by {diff:.2e}"

    resumed, resumed_opt = build()
    with torch.no_grad():
        for p, q in zip(resumed.parameters(), model.parameters(), strict=True):
            p.copy_(q)
    resumed_opt.load_state_dict(copy.deepcopy(flat))
    assert_same_state(resumed_opt.state_dict(), flat, "after load (FSDP2)")
    train(model, opt, range(STEPS, STEPS + 1))
    train(resumed, resumed_opt, range(STEPS, STEPS + 1))
    for p, q in zip(resumed.parameters(), model.parameters(), strict=True):
        assert torch.equal(shared.full(p), shared.full(q)), "resumed run differs"
