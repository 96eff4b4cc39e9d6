"""torchtitan 0.2.x (issue 39 item 14): galore2's optimizers from torchtitan's
``[optimizer]`` section (galore2.integrations.torchtitan.legacy / .job_config).

Runs where torchtitan 0.2.x is installed, skipped elsewhere (the default test environment
has 0.3.0); checked with torchtitan 0.2.2 in a separate environment::

    python -m venv /tmp/tt02 && /tmp/tt02/bin/pip install --no-deps torchtitan==0.2.2
    /tmp/tt02/bin/python -m pytest tests/integrations/test_torchtitan_02.py

The documented command line is parsed by torchtitan's own ConfigManager; the train spec's
optimizer builder (what the trainer calls) is run over torchtitan's Llama-3 debug model cut
to one layer and compared, bitwise, with the galore2 optimizer built by hand.
"""

from __future__ import annotations

import copy
import re
import shlex
from pathlib import Path

import pytest
import torch

pytest.importorskip("torchtitan.components.optimizer", reason="torchtitan not installed")

import galore2.integrations.torchtitan as tt  # noqa: E402

if tt.API != "0.2":
    pytest.skip("torchtitan 0.2.x is not installed (see the module docstring)",
                allow_module_level=True)  # fmt: skip

from torchtitan.config import ConfigManager  # noqa: E402

from galore2.presets import PRESETS  # noqa: E402

MODULE = "galore2.integrations.torchtitan.job_config"
GUIDE = Path(__file__).resolve().parents[2] / "docs" / "guides" / "torchtitan.md"


def _parse(*flags: str):
    """torchtitan's config from ``flags`` with galore2's custom config module."""
    return ConfigManager().parse_args(["--job.custom_config_module", MODULE, *flags])


def tiny_llama() -> torch.nn.Module:
    """torchtitan 0.2.x's Llama-3 debug model with one decoder layer, seeded."""
    from torchtitan.models.llama3 import Transformer, llama3_args

    args = copy.deepcopy(llama3_args["debugmodel"])
    args.n_layers = 1
    torch.manual_seed(0)
    model = Transformer(args)
    with torch.no_grad():
        model.init_weights()
    return model


def _build(model, *flags: str):
    """The container the trainer builds: the registered train spec's builder."""
    from torchtitan.protocols.train_spec import get_train_spec

    config = _parse("--model.name", "llama3_galore", *flags)
    return get_train_spec(config.model.name).build_optimizers_fn([model], config.optimizer, None)


def _train(model, opt, steps) -> None:
    for step in steps:
        gen = torch.Generator().manual_seed(1000 + step)
        for p in model.parameters():
            p.grad = torch.randn(p.shape, generator=gen)
        opt.step()
        opt.zero_grad()


FLAGS = ("--optimizer.name", "galore_adamw", "--optimizer.lr", "0.01",
         "--optimizer.galore_options", "rank=8,update_proj_gap=2,scale=0.25",
         "--optimizer.plain_options", "weight_decay=0.0")  # fmt: skip


def test_documented_command_line_parses():
    """The guide's torchtitan 0.2.x command (its TOML file left out: it is in torchtitan's
    repository, not its wheel) parsed by torchtitan's ConfigManager: GaLore's 7B settings."""
    text = GUIDE.read_text()
    found = re.search(r"(torchrun [^\n]*-m torchtitan\.train[^`]*?custom_config_module.*?)\n```",
                      text, re.S)  # fmt: skip
    assert found, "the guide has no torchtitan 0.2.x command"
    argv = shlex.split(found.group(1).replace("\\\n", " "))
    argv = argv[argv.index("torchtitan.train") + 1 :]
    at = argv.index("--job.config_file")
    del argv[at : at + 2]
    config = ConfigManager().parse_args(argv)
    s = tt.settings(config.optimizer)
    assert s.cls is PRESETS["galore_adamw"] and config.model.name == "llama3_galore"
    assert {k: s.projected[k] for k in ("rank", "update_proj_gap", "scale", "lr", "betas")} == {
        "rank": 1024, "update_proj_gap": 500, "scale": 0.25, "lr": 5e-3, "betas": (0.9, 0.999)
    }  # fmt: skip
    assert s.projected["weight_decay"] == s.plain["weight_decay"] == 0.0
    assert "rank" not in s.plain
    assert (config.training.steps, config.lr_scheduler.warmup_steps) == (150000, 15000)


def test_train_spec_builds_the_container():
    """``--model.name llama3_galore``: torchtitan's Llama-3 train spec whose builder makes
    galore2's container: one GaLoreAdamW, attention and MLP weights projected, the rest
    plain; torchtitan's ``implementation`` (fused) → ``foreach=None``."""
    model = tiny_llama()
    container = _build(model, *FLAGS)
    assert isinstance(container, tt.GaLoreOptimizersContainer)
    (opt,) = container.optimizers
    assert type(opt).__name__ == "GaLoreAdamW"
    projected, plain = opt.param_groups
    names = {id(p): n for n, p in model.named_parameters()}
    assert [names[id(p)].split(".")[-2] for p in projected["params"]] == [
        "wq", "wk", "wv", "wo", "w1", "w2", "w3"
    ]  # fmt: skip
    assert len(plain["params"]) == 5  # embeddings, 2 norms, final norm, output
    assert (projected["rank"], plain["rank"]) == (8, None)
    assert (projected["weight_decay"], plain["weight_decay"]) == (0.1, 0.0)
    assert projected["foreach"] is None and plain["foreach"] is None


@pytest.mark.parametrize(
    ("name", "extra"),
    [("galore_adamw", ""), ("fira", ""), ("galore_adafactor", ""),
     ("ranger21", "num_iterations=10")],
)  # fmt: skip
def test_steps_match_the_optimizer_built_directly(name, extra):
    """Three steps (refreshes at 0 and 2) through the container equal, bitwise, the preset
    built by hand with the options the section describes (GaLoreAdafactor: torchtitan's
    eps is not its pair eps, so its default; Ranger21: one group)."""
    model, twin = tiny_llama(), tiny_llama()
    projects = name != "ranger21"
    options = "rank=8,update_proj_gap=2,scale=0.25" if projects else extra
    flags = ("--optimizer.name", name, "--optimizer.lr", "0.01",
             "--optimizer.galore_options", options)  # fmt: skip
    container = _build(model, *flags)
    cls = PRESETS[name]
    shared = {"lr": 0.01, "weight_decay": 0.1, "foreach": None}
    if "betas" in cls.all_options():
        shared.update(betas=(0.9, 0.95), eps=1e-8)
    if projects:
        projected = [p for n, p in twin.named_parameters() if re.search(tt.PROJECTED, n)]
        plain = [p for n, p in twin.named_parameters() if not re.search(tt.PROJECTED, n)]
        groups = [{"params": projected, **shared, "rank": 8, "update_proj_gap": 2,
                   "scale": 0.25}, {"params": plain, **shared}]  # fmt: skip
        direct = cls(groups)
    else:
        direct = cls([{"params": list(twin.parameters()), **shared}], num_iterations=10)
    _train(model, container, range(3))
    _train(twin, direct, range(3))
    for (n, p), q in zip(model.named_parameters(), twin.parameters(), strict=True):
        assert torch.equal(p, q), f"{name}: {n}"


def test_state_dict_round_trip_and_a_seed_checkpoint_change_nothing():
    """torchtitan's flat state dict before the first step (state made by ``init_state()``:
    weights unchanged, no step counted), then after three steps, loaded into a fresh
    container: both continue bitwise alike."""
    model, twin = tiny_llama(), tiny_llama()
    container = _build(model, *FLAGS)
    seed = container.state_dict()
    assert all(int(v) == 0 for k, v in seed.items() if k.endswith((".refreshes", ".step")))
    for p, q in zip(model.parameters(), twin.parameters(), strict=True):
        assert torch.equal(p, q)
    _train(model, container, range(3))
    flat = container.state_dict()
    assert int(flat["state.layers.0.attention.wo.weight.galore.refreshes"]) == 2
    twin.load_state_dict(model.state_dict())
    resumed = _build(twin, *FLAGS)
    resumed.load_state_dict(flat)
    _train(model, container, range(3, 5))
    _train(twin, resumed, range(3, 5))
    for (n, p), q in zip(model.named_parameters(), twin.parameters(), strict=True):
        assert torch.equal(p, q), n


def test_another_name_is_torchtitans_optimizer():
    (opt,) = _build(tiny_llama(), "--optimizer.name", "AdamW").optimizers
    assert type(opt) is torch.optim.AdamW


BAD = [
    (("--optimizer.galore_options", "rnak=8"), r"unknown option\(s\) \['rnak'\].*'rank'"),
    (("--optimizer.galore_options", "rank=0"), r"galore_options.*rank must be"),
    (("--optimizer.galore_options", "rank=8 scale=0.5"), "key=value"),
    (("--optimizer.galore_options", "rank=8,betas=(0.9,0.99)"), "beta1"),
    (("--optimizer.galore_options", "rank=8,rank=4"), "set twice"),
    (("--optimizer.galore_options", "update_proj_gap=5"), "needs rank"),
    (("--optimizer.galore_options", "rank=8", "--optimizer.projected", "("), "valid regex"),
    (("--optimizer.galore_options", "rank=8", "--optimizer.early_step_in_backward"),
     "early_step_in_backward"),
    (("--optimizer.galore_options", "rank=8", "--optimizer.lr", "-1"), r"--optimizer.lr"),
]  # fmt: skip


@pytest.mark.parametrize(("flags", "message"), BAD)
def test_bad_sections_are_refused_naming_the_field(flags, message):
    config = _parse("--optimizer.name", "galore_adamw", *flags)
    with pytest.raises(ValueError, match=message):
        tt.settings(config.optimizer)


def test_galore_config_says_it_needs_torchtitan_03():
    with pytest.raises(ImportError, match=r"needs torchtitan 0\.3\.x .*custom_config_module"):
        tt.galore_config("galore_adamw", rank=8)
