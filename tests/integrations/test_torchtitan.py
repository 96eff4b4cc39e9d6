"""torchtitan's optimizer container with galore2's presets (galore2.integrations.torchtitan).

Built the trainer's way (``config.optimizer.build(model_parts=...)``) over torchtitan's own
Llama-3 debug model (one layer); checked against the galore2 optimizer built directly, through
torchtitan's flat state dicts and its zero-gradient state initialization, and on 2 FSDP2 ranks.
"""

from __future__ import annotations

import copy
import importlib.util
import re

import pytest
import torch

pytest.importorskip(
    "torchtitan.components.optimizer",
    reason="torchtitan not importable: pip install --no-deps torchtitan==0.3.0 "
    "and its container's imports (tyro, spmd_types==0.2.3)",
)

import galore2.integrations.torchtitan as tt  # noqa: E402

if tt.API != "0.3":  # torchtitan 0.2.x: test_torchtitan_02.py
    pytest.skip("torchtitan 0.3.x is not installed", allow_module_level=True)

import torch.distributed.checkpoint as dcp  # noqa: E402
from torchtitan.components.optimizer import (
    LRSchedulersContainer,
    OptimizersContainer,
    ParamGroupConfig,
)
from torchtitan.components.optimizer.utils import init_optim_state

from galore2.integrations.torchtitan import (
    PROJECTED,
    GaLoreOptimizersContainer,
    galore_config,
)
from galore2.presets import PRESETS

from ..dist import spawn
from . import torchtitan_cases as cases

HAS_BNB = importlib.util.find_spec("bitsandbytes") is not None
#: what each preset needs beyond the shared settings (Ranger21's schedule: its length)
EXTRA = {"ranger21": {"num_iterations": 10}, "galore_ranger21": {"num_iterations": 10}}
NAMES = [
    pytest.param(
        n, marks=pytest.mark.skipif(not HAS_BNB and n.endswith("8bit"), reason="bitsandbytes")
    )
    for n in PRESETS
]


def _options(name: str) -> dict:
    options = {**cases.SETTINGS, **EXTRA.get(name, {})}
    if "rank" not in PRESETS[name].all_options():  # ranger21: no projection
        options = {k: v for k, v in options.items() if k in PRESETS[name].all_options()}
    return options


def _container(name: str, model, **kw) -> GaLoreOptimizersContainer:
    config = galore_config(name, plain=cases.PLAIN, **{**_options(name), **kw})
    return config.build(model_parts=[model])


def _direct(name: str, model) -> torch.optim.Optimizer:
    """The same galore2 optimizer built by hand from the same split."""
    cls, options = PRESETS[name], _options(name)
    if "rank" not in cls.all_options():
        return cls([{"params": list(model.parameters()), **options, **cases.PLAIN}])
    projected, plain = cases.split(model)
    galore_keys = {"rank", "update_proj_gap", "scale"}
    plain_options = {k: v for k, v in options.items() if k not in galore_keys}
    return cls(
        [
            {"params": projected, **options},
            {"params": plain, **plain_options, **cases.PLAIN},
        ]
    )


# ---- building ----------------------------------------------------------------------------------


def test_config_builds_the_container_torchtitan_expects():
    """The config's ``build`` (what the trainer calls) makes our container: one GaLoreAdamW,
    attention/MLP weights projected, the rest plain, torchtitan's names on every group and
    torch's ``fused`` not passed on (galore2's own ``fused`` option keeps its default); torchtitan's LR schedulers drive it."""
    model = cases.tiny_llama()
    config = cases.config()
    assert isinstance(config, OptimizersContainer.Config)
    container = config.build(model_parts=[model])
    assert isinstance(container, GaLoreOptimizersContainer)
    (opt,) = container.optimizers
    assert type(opt).__name__ == "GaLoreAdamW"
    projected, plain = opt.param_groups
    assert projected["param_names"] == [
        "layers.0.attention.qkv_linear.wqkv.weight",
        "layers.0.attention.wo.weight",
        "layers.0.feed_forward.w1.weight",
        "layers.0.feed_forward.w2.weight",
        "layers.0.feed_forward.w3.weight",
    ]
    assert plain["param_names"] == [
        "tok_embeddings.weight",
        "layers.0.attention_norm.weight",
        "layers.0.ffn_norm.weight",
        "norm.weight",
        "lm_head.weight",
    ]
    assert (projected["rank"], plain["rank"]) == (8, None)
    assert (projected["weight_decay"], plain["weight_decay"]) == (0.1, 0.0)
    for group in opt.param_groups:
        assert group.get("fused") is None and group["foreach"] is None
        assert all(isinstance(n, str) for n in group["param_names"])

    schedulers = LRSchedulersContainer.Config(warmup_steps=4).build(
        optimizers=container, training_steps=10
    )
    lrs = [g["lr"] for g in opt.param_groups]
    cases.train(model, container, range(1))
    schedulers.step()
    assert all(g["lr"] > lr for g, lr in zip(opt.param_groups, lrs, strict=True))  # warmup


@pytest.mark.parametrize(
    ("implementation", "override", "foreach"),
    [
        ("fused", {}, None),
        ("foreach", {}, True),
        ("for-loop", {}, False),
        ("fused", {"foreach": False}, False),  # optimizer_kwargs win
        ("foreach", {"fused": False}, True),  # fused=False is accepted and dropped
    ],
)
def test_implementation_maps_to_foreach(implementation, override, foreach):
    """torchtitan's ``implementation`` becomes galore2's ``foreach``; a torch AdamW beside the
    galore2 optimizer still gets torch's ``fused`` / ``foreach`` from it."""
    model = cases.tiny_llama()
    config = GaLoreOptimizersContainer.Config(
        implementation=implementation,
        param_groups=[
            ParamGroupConfig(pattern="embeddings", optimizer_name="AdamW",
                             optimizer_kwargs={"lr": 1e-3}),
            ParamGroupConfig(pattern=".*", optimizer_name="galore_adamw",
                             optimizer_kwargs={"lr": 1e-3, **override}),
        ],
    )  # fmt: skip
    torch_opt, opt = config.build(model_parts=[model]).optimizers
    assert isinstance(torch_opt, torch.optim.AdamW)
    assert torch_opt.param_groups[0]["foreach"] == (implementation == "foreach")
    assert torch_opt.param_groups[0]["fused"] == (implementation == "fused")
    (group,) = opt.param_groups
    assert group["foreach"] is foreach and group.get("fused") is None


@pytest.mark.parametrize("name", NAMES)
def test_steps_match_the_optimizer_built_directly(name):
    """Three steps (refreshes at 0 and 2) through the container equal, bitwise, the same
    galore2 optimizer built by hand from the same groups."""
    model = cases.tiny_llama()
    twin = copy.deepcopy(model)
    container = _container(name, model)
    direct = _direct(name, twin)
    (opt,) = container.optimizers
    assert type(opt) is type(direct)
    cases.train(model, container, range(3))
    cases.train(twin, direct, range(3))
    for (n, p), q in zip(model.named_parameters(), twin.parameters(), strict=True):
        assert torch.equal(p, q), f"{name}: {n} differs from the directly built optimizer"
    start = cases.tiny_llama()
    assert (
        max(
            (p - q).abs().max() for p, q in zip(model.parameters(), start.parameters(), strict=True)
        )
        > 0
    )


# ---- checkpoints -------------------------------------------------------------------------------


@pytest.mark.parametrize("name", ["galore_adamw", "galore_ranger21", "apollo"])
def test_flat_state_dict_round_trips_through_dcp(name, tmp_path):
    """torchtitan's flat, name-keyed state dict, saved and loaded with DCP (as its
    checkpointer does), restores every state tensor bitwise; both runs then continue alike."""
    model = cases.tiny_llama()
    container = _container(name, model)
    cases.train(model, container, range(3))
    flat = container.state_dict()
    wo = "state.layers.0.attention.wo.weight."
    assert f"{wo}galore.refreshes" in flat and int(flat[f"{wo}galore.refreshes"]) == 2
    assert all(isinstance(v, torch.Tensor) for k, v in flat.items() if k.startswith("state."))
    assert flat["param_groups.layers.0.attention.wo.weight.rank"] == 8
    dcp.save({"optimizer": container}, checkpoint_id=str(tmp_path))

    resumed = copy.deepcopy(model)
    resumed_container = _container(name, resumed)
    dcp.load({"optimizer": resumed_container}, checkpoint_id=str(tmp_path))
    cases.assert_same_state(resumed_container.state_dict(), flat, name)
    cases.train(model, container, range(3, 5))
    cases.train(resumed, resumed_container, range(3, 5))
    for (n, p), q in zip(model.named_parameters(), resumed.parameters(), strict=True):
        assert torch.equal(p, q), f"{name}: {n} differs after resuming"


def test_loading_another_rank_is_refused_before_anything_changes():
    """galore2's load checks run under torchtitan's flat loader: a checkpoint at another
    rank is refused, naming the option, and the optimizer keeps its state."""
    model = cases.tiny_llama()
    container = _container("galore_adamw", model)
    cases.train(model, container, range(1))
    flat = container.state_dict()
    other = _container("galore_adamw", cases.tiny_llama(), rank=4)
    before = other.state_dict()
    with pytest.raises(ValueError, match="rank"):
        other.load_state_dict(flat)
    cases.assert_same_state(other.state_dict(), before, "after a refused load")


@pytest.mark.parametrize("name", ["galore_adamw", "galore_ranger21", "apollo_mini"])
def test_saving_before_the_first_step_changes_nothing(name):
    """``state_dict()`` before any step (a seed checkpoint) creates the state without a step:
    weights unchanged, no basis yet, and training then equals training without it."""
    model, twin = cases.tiny_llama(), cases.tiny_llama()
    container, twin_container = _container(name, model), _container(name, twin)
    flat = container.state_dict()
    assert any(k.endswith("galore.refreshes") for k in flat)
    assert all(int(v) == 0 for k, v in flat.items() if k.endswith(("refreshes", ".step")))
    for p, q in zip(model.parameters(), twin.parameters(), strict=True):
        assert torch.equal(p, q)
    cases.train(model, container, range(3))
    cases.train(twin, twin_container, range(3))
    for (n, p), q in zip(model.named_parameters(), twin.parameters(), strict=True):
        assert torch.equal(p, q), f"{name}: {n} differs after an early state_dict()"


@pytest.mark.parametrize("name", ["galore_adamw", "fira", "apollo", "galore_muon"])
def test_torchtitan_zero_gradient_init_step(name):
    """torchtitan's own ``init_optim_state`` (a zero-gradient, lr=0 step) run on a galore2
    optimizer: weights bitwise unchanged, no basis taken from the zero gradient (no refresh
    counted), and the first real step's basis equals a fresh optimizer's."""
    model, twin = cases.tiny_llama(), cases.tiny_llama()
    (opt,) = _container(name, model).optimizers
    (fresh,) = _container(name, twin).optimizers
    init_optim_state(opt)
    assert opt.state, "init_optim_state created no state"
    for p, q in zip(model.parameters(), twin.parameters(), strict=True):
        assert torch.equal(p, q), "the zero-gradient step changed a weight"
    projected, _ = cases.split(model)
    assert all(int(opt.state[p]["galore.refreshes"]) == 0 for p in projected)
    assert [g["lr"] for g in opt.param_groups] == [1e-2, 1e-2]  # restored
    cases.train(model, opt, range(1))
    cases.train(twin, fresh, range(1))
    for p, q in zip(projected, cases.split(twin)[0], strict=True):
        assert int(opt.state[p]["galore.refreshes"]) == 1
        bases = [k for k in fresh.state[q] if k.startswith("proj.")]
        assert bases
        for key in bases:
            assert torch.equal(opt.state[p][key], fresh.state[q][key]), f"{name}: {key}"


# ---- errors ------------------------------------------------------------------------------------


def _group(pattern=".*", name="galore_adamw", **kwargs) -> ParamGroupConfig:
    return ParamGroupConfig(pattern=pattern, optimizer_name=name, optimizer_kwargs=kwargs)


BAD = [
    ({"param_groups": [_group(rnak=8)]}, r"unknown option\(s\) \['rnak'\].*did you mean 'rank'"),
    ({"param_groups": [_group(rank=0)]}, r"'\.\*' \(galore_adamw\): rank must be"),
    ({"param_groups": [_group(rank=8, projector="random", basis_dtype="int8")]}, "needs a stored"),
    ({"param_groups": [_group(betas=(0.9, 0.99), name="galore_adafactor")]}, "betas"),
    ({"param_groups": [_group(fused=True)]}, "no fused implementation"),
    ({"param_groups": [_group()], "implementation": "fused_opt_states_bf16"}, "state_dtype"),
    ({"param_groups": [_group(name="galore_adamx")]}, "neither a galore2 preset"),
    (
        {
            "param_groups": [_group()],
            "optimizer_factory_kwargs_by_name": {"galore_adamw": {"x": 1}},
        },
        r"optimizer_factory_kwargs_by_name\['galore_adamw'\]: unknown option",
    ),
    (
        {
            "param_groups": [
                _group("w", "galore_adafactor", moments_8bit=False),
                _group(".*", "galore_adafactor", moments_8bit=True),
            ]
        },
        "constructor switches",
    ),
    ({"param_groups": [_group("(", rank=8)]}, "not a valid regex"),
]


@pytest.mark.parametrize(("fields", "message"), BAD)
def test_bad_configs_are_refused_when_made(fields, message):
    """Unknown keys, bad values and combinations, ``fused=True``, torch-only
    implementations, mismatched switches: ``ValueError`` naming the problem when the config
    is made (before a model is built), and again if ``build`` gets such a config."""
    with pytest.raises(ValueError, match=message):
        GaLoreOptimizersContainer.Config(**fields)


def test_build_checks_a_config_changed_after_it_was_made():
    config = cases.config()
    config.param_groups[0].optimizer_kwargs["rank"] = -1  # e.g. edited in a config function
    with pytest.raises(ValueError, match=re.escape(f"{PROJECTED!r} (galore_adamw): rank")):
        config.build(model_parts=[cases.tiny_llama()])


def test_galore_config_needs_a_rank_and_a_preset():
    with pytest.raises(ValueError, match="needs rank"):
        galore_config("galore_adamw", lr=1e-3)
    with pytest.raises(ValueError, match="optimizer must be one of"):
        galore_config("adamw", rank=8)
    (group,) = galore_config("ranger21", num_iterations=9).param_groups  # no projection: one group
    assert group.pattern == ".*"
    mini = galore_config("apollo_mini", lr=1e-3).param_groups[0]  # rank 1 by definition
    assert mini.optimizer_kwargs["rank"] == 1


def test_galore_config_names_a_misspelled_key():
    """Issue 30 item 7: ``rnak`` was reported as a missing rank, never named."""
    with pytest.raises(ValueError, match=r"unknown option\(s\) \['rnak'\].*did you mean 'rank'"):
        galore_config(rnak=16)
    with pytest.raises(ValueError, match=r"\['lrr'\].*did you mean 'lr'"):
        galore_config(rank=8, plain={"lrr": 0.0})
    with pytest.raises(ValueError, match=r"\['rank', 'update_proj_gap'\]") as e:  # hint once
        galore_config("ranger21", num_iterations=9, rank=8, update_proj_gap=5)
    assert str(e.value).count("need GaLoreRanger21") == 1


# ---- FSDP2 -------------------------------------------------------------------------------------


def test_fsdp2_two_ranks_match_one_process():
    """On 2 gloo ranks, sharded by torchtitan's own ``parallelize_llama`` (FSDP2: parameters
    and gradients ``Shard(0)`` DTensors), the container trains as in one process, and its
    flat state dict round-trips."""
    spawn(cases.fsdp_matches_single, 2, timeout=240)


# ---- torchtitan's command line ------------------------------------------------------------------


def test_config_registry_through_torchtitans_config_manager():
    """``--module galore2.integrations.torchtitan --config llama3_debugmodel_galore`` with a
    command-line override, parsed by torchtitan's own ConfigManager (needs torchtitan's
    trainer dependencies: torchdata, tensorboard...)."""
    try:
        from torchtitan.config import ConfigManager
        from torchtitan.models.llama3 import config_registry  # noqa: F401
    except ImportError as e:
        pytest.skip(f"torchtitan's trainer dependencies are not installed ({e})")
    args = ["--module", "galore2.integrations.torchtitan", "--config", "llama3_debugmodel_galore"]
    rank = "--optimizer.param-groups.0.optimizer-kwargs.rank"
    config = ConfigManager().parse_args([*args, rank, "32"])
    assert isinstance(config.optimizer, GaLoreOptimizersContainer.Config)
    assert config.optimizer.param_groups[0].optimizer_kwargs["rank"] == 32
    with pytest.raises(SystemExit):  # tyro reports the ValueError and exits
        ConfigManager().parse_args([*args, rank, "0"])


def test_documented_llama3_8b_command_line_parses():
    """The Llama-3 8B command line of docs/guides/torchtitan.md, parsed by torchtitan's own
    ConfigManager: every flag exists and the optimizer carries GaLore's 7B settings."""
    import re
    import shlex
    from pathlib import Path

    from torchtitan.config import ConfigManager

    guide = Path(__file__).resolve().parents[2] / "docs" / "guides" / "torchtitan.md"
    found = re.search(r"(torchrun [^\n]*-m torchtitan\.train.*?)\n```", guide.read_text(), re.S)
    assert found, "the guide has no torchrun ... -m torchtitan.train command"
    argv = shlex.split(found.group(1).replace("\\\n", " "))
    config = ConfigManager().parse_args(argv[argv.index("torchtitan.train") + 1 :])
    assert isinstance(config.optimizer, GaLoreOptimizersContainer.Config)
    projected = config.optimizer.param_groups[0]
    assert projected.optimizer_name == "galore_adamw"
    assert {k: projected.optimizer_kwargs[k] for k in ("rank", "update_proj_gap", "scale")} == {
        "rank": 1024, "update_proj_gap": 500, "scale": 0.25
    }  # fmt: skip
    assert (config.training.steps, config.lr_scheduler.warmup_steps) == (150000, 15000)
