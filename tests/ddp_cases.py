"""Workers for test_ddp.py: galore2 under DistributedDataParallel vs a single-process run."""

from __future__ import annotations

import copy

import torch
import torch.distributed as dist

from .fsdp_cases import make_model, optimizer, train

CONFIGS = [{"projector": "svd"}, {"projector": "randomized"}]


def _same_on_every_rank(t: torch.Tensor, what: str) -> None:
    t = t.detach().contiguous()
    parts = [torch.empty_like(t) for _ in range(dist.get_world_size())]
    dist.all_gather(parts, t)
    for r, part in enumerate(parts):
        assert torch.equal(part, parts[0]), f"{what}: rank {r} differs from rank 0"


def ddp_matches_single_process(rank: int, world: int) -> None:
    from torch.nn.parallel import DistributedDataParallel

    for settings in CONFIGS:
        reference = make_model()
        model = copy.deepcopy(reference)
        train(reference, optimizer(reference, settings))
        ddp = DistributedDataParallel(model)
        opt = optimizer(model, settings)
        train(ddp, opt, rank, world)  # rank r trains on its 1/world of each batch

        for (name, p), q in zip(model.named_parameters(), reference.parameters(), strict=True):
            diff = (p - q).abs().max().item()
            assert diff <= 1e-5, f"{settings} rank {rank}/{world}: {name} differs by {diff:.2e}"
            _same_on_every_rank(p, f"{settings} {name}")
        moved = max(
            (p - q).abs().max().item()
            for p, q in zip(model.parameters(), make_model().parameters(), strict=True)
        )
        assert moved > 1e-3, moved

        sides = set()
        for name, p in model.named_parameters():
            state = opt.state[p]
            if "galore.refreshes" in state:
                assert int(state["galore.refreshes"]) == 3, (name, int(state["galore.refreshes"]))
            for key, value in state.items():  # bases, moments and counters alike
                if key.startswith("proj."):
                    sides.add(key)
                _same_on_every_rank(value, f"{settings} {name} {key}")
        assert sides == {"proj.left", "proj.right"}, sides
