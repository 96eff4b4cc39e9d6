"""Workers for test_basis_quant.py: FSDP2 with int4 + Hadamard bases equals one process."""

from __future__ import annotations

import copy

import torch
from torch import nn

import galore2

from . import fsdp_cases

# fsdp_cases' model: 7×10 (left: P 7×r row-sharded 4/3), 13×7 (right: Q 7×r replicated),
# 5×13 (left: P 5×r sharded 3/2). Rank 3 with Hadamard blocks of 2: one full block and a
# tail of 1 (odd length: a padding nibble); blocks of 4: the tail of 3 padded to 4.
CONFIGS = [
    {"projector": "randomized", "basis_group_size": 2},
    {"projector": "svd", "basis_group_size": 4, "moments_on_refresh": "project"},
    {"projector": "power", "basis_group_size": 2},
]


def optimizer(model: nn.Module, settings: dict) -> galore2.GaLoreAdamW:
    groups = galore2.param_groups(
        model,
        rank=fsdp_cases.RANK,
        update_proj_gap=fsdp_cases.GAP,
        basis_dtype="int4",
        basis_hadamard=True,
        **settings,
    )
    return galore2.GaLoreAdamW(groups, lr=1e-2, weight_decay=0.05)


def int4_hadamard_matches_single_process(rank: int, world: int) -> None:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor

    mesh = init_device_mesh("cpu", (world,))
    for settings in CONFIGS:
        reference = fsdp_cases.make_model()
        sharded = copy.deepcopy(reference)
        ref_opt = optimizer(reference, settings)
        fsdp_cases.train(reference, ref_opt)
        fsdp_cases.shard(sharded, mesh)
        opt = optimizer(sharded, settings)
        fsdp_cases.train(sharded, opt, rank, world)
        for (name, p), q in zip(sharded.named_parameters(), reference.parameters(), strict=True):
            diff = (p.full_tensor() - q).abs().max().item()
            assert diff <= 1e-5, f"{settings} rank {rank}/{world}: {name} differs by {diff:.2e}"
        moved = max(
            (p.full_tensor() - q).abs().max().item()
            for p, q in zip(sharded.parameters(), fsdp_cases.make_model().parameters(), strict=True)
        )
        assert moved > 1e-3, moved  # it did train
        # The stored codes and scales are DTensors laid out like the basis and hold, shard
        # for shard, what the single process stores.
        for p, q in zip(sharded.parameters(), reference.parameters(), strict=True):
            state, ref_state = opt.state[p], ref_opt.state[q]
            keys = sorted(k for k in state if k.startswith("proj."))
            if not keys:
                continue
            assert keys == sorted(k for k in ref_state if k.startswith("proj.")), keys
            assert int(state["galore.refreshes"]) == 3
            for key in keys:
                t = state[key]
                assert isinstance(t, DTensor), key
                assert "proj.left" not in key or t.placements[0].is_shard(0), (key, t.placements)
                assert "proj.right" not in key or t.placements[0].is_replicate(), key
                full = t.full_tensor()
                assert full.dtype == ref_state[key].dtype and full.shape == ref_state[key].shape
                if key.endswith(".q"):  # the same codes (the bases agree to ~1e-7)
                    assert torch.equal(full, ref_state[key]), key
                else:
                    torch.testing.assert_close(full, ref_state[key], rtol=1e-5, atol=1e-6)
    torch.distributed.barrier()
