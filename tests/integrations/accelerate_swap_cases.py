"""Workers for test_accelerate_swap.py: accelerate's FSDP2 parameter swap under a galore2 optimizer.

The Trainer builds the optimizer on the *unsharded* model when FSDP2 is on; accelerate's
``Accelerator._prepare_fsdp2`` then puts a ``torch.empty(1)`` placeholder (carrying the old
``data_ptr``) in place of every optimizer parameter, shards the model and calls
``fsdp2_switch_optimizer_parameters`` to put the sharded DTensor parameters in. galore2
creates its state (and its per-parameter placements) lazily on the first step, so training
after the swap must equal training with an optimizer built on the sharded model.
"""

from __future__ import annotations

import copy

import torch
import transformers
from torch import nn

from galore2.integrations.transformers import create_optimizer

from .. import dist as shared

STEPS, RANK, GAP = 6, 4, 3  # refreshes at steps 0 and 3
SETTINGS = {"rank": RANK, "update_proj_gap": GAP}


def make_model() -> nn.Module:
    cfg = transformers.LlamaConfig(
        vocab_size=64,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=32,
        attention_bias=True,  # biases: a plain group without weight decay
        tie_word_embeddings=False,
    )
    torch.manual_seed(0)
    return transformers.LlamaForCausalLM(cfg)


def make_args(out: str) -> transformers.TrainingArguments:
    return transformers.TrainingArguments(
        output_dir=out,
        learning_rate=1e-2,
        weight_decay=0.1,
        adam_beta2=0.99,
        report_to=[],
        use_cpu=True,
    )


def shard(model: nn.Module, mesh) -> nn.Module:
    return shared.shard(model, mesh, units=model.model.layers)


def train(model: nn.Module, opt: torch.optim.Optimizer, rank: int) -> None:
    for step in range(STEPS):
        g = torch.Generator().manual_seed(1000 * step + rank)  # each rank its own batch
        ids = torch.randint(0, 64, (4, 16), generator=g)
        model(input_ids=ids, labels=ids).loss.backward()
        opt.step()
        opt.zero_grad()


def mimic_prepare_fsdp2(model: nn.Module, opt: torch.optim.Optimizer, mesh) -> None:
    """accelerate's ``_prepare_fsdp2`` swap, step by step, with its own helpers."""
    from accelerate.utils.fsdp_utils import (
        fsdp2_canonicalize_names,
        fsdp2_switch_optimizer_parameters,
    )

    old = fsdp2_canonicalize_names({n: p.data_ptr() for n, p in model.named_parameters()})
    for group in opt.param_groups:
        for i, p in enumerate(group["params"]):
            placeholder = torch.empty(1, dtype=p.dtype, device=p.device)
            placeholder.data_ptr = p.data_ptr()  # accelerate keys the mapping on this attribute
            group["params"][i] = placeholder
    shard(model, mesh)
    new = fsdp2_canonicalize_names(dict(model.named_parameters()))
    fsdp2_switch_optimizer_parameters(opt, {ptr: new[n] for n, ptr in old.items()})


def accelerate_prepare(model: nn.Module, opt: torch.optim.Optimizer):
    """The real ``Accelerator.prepare`` (its ``_prepare_fsdp2``) on CPU/gloo.

    accelerate only selects ``DistributedType.FSDP`` on accelerator devices (on CPU it picks
    MULTI_CPU/NO and would wrap in DDP), so the state is switched to FSDP after construction;
    everything from ``prepare`` on is accelerate's own code.
    """
    from accelerate import Accelerator, FullyShardedDataParallelPlugin
    from accelerate.utils import DistributedType

    plugin = FullyShardedDataParallelPlugin(
        fsdp_version=2,
        auto_wrap_policy="transformer_based_wrap",
        transformer_cls_names_to_wrap=["LlamaDecoderLayer"],
        reshard_after_forward=True,
        cpu_ram_efficient_loading=False,
    )
    acc = Accelerator(cpu=True, fsdp_plugin=plugin)
    acc.state.distributed_type = DistributedType.FSDP
    acc.state.fsdp_plugin = plugin
    assert acc.is_fsdp2
    return acc.prepare(model, opt)


def _check_state(opt: torch.optim.Optimizer) -> None:
    from torch.distributed.tensor import DTensor

    params = [p for g in opt.param_groups for p in g["params"]]
    assert all(isinstance(p, DTensor) for p in params)
    assert {id(p) for p in opt.state} == {id(p) for p in params}  # no state of old params
    assert sum("galore.refreshes" in s for s in opt.state.values()) == 14  # 7 Linear × 2 layers
    for p in params:
        state = opt.state[p]
        if "galore.refreshes" in state:
            assert int(state["galore.refreshes"]) == 2
            assert RANK in state["adam.exp_avg"].shape


def swap_matches_optimizer_built_after_sharding(rank: int, world: int, out: str) -> None:
    mesh = shared.cpu_mesh(world)
    args = make_args(out)
    base = make_model()

    reference = shard(copy.deepcopy(base), mesh)
    ref_opt = create_optimizer(reference, args, **SETTINGS)
    assert len(ref_opt.param_groups) == 3  # projected, plain decayed, plain not decayed
    train(reference, ref_opt, rank)

    runs = {}
    mimic = copy.deepcopy(base)
    mimic_opt = create_optimizer(mimic, args, **SETTINGS)
    mimic_prepare_fsdp2(mimic, mimic_opt, mesh)
    runs["mimic"] = (mimic, mimic_opt)
    if not torch.cuda.is_available():  # accelerate's default FSDP2 mesh is on the accelerator
        real = copy.deepcopy(base)
        real, real_opt = accelerate_prepare(real, create_optimizer(real, args, **SETTINGS))
        runs["accelerate"] = (real, real_opt.optimizer)

    for how, (model, opt) in runs.items():
        for ga, gb in zip(opt.param_groups, ref_opt.param_groups, strict=True):
            diff = {k for k in ga.keys() | gb.keys() if k != "params" and ga.get(k) != gb.get(k)}
            assert not diff, {k: (ga.get(k), gb.get(k)) for k in diff}
        train(model, opt, rank)
        _check_state(opt)
        shared.assert_params_match(model, reference, 1e-6, f"{how} rank {rank}")
        assert opt.state_bytes() == ref_opt.state_bytes()
    assert shared.max_change(reference, base) > 1e-3  # the runs trained
