"""The recipe's configuration in two steps: the schema reads (recipes.config, no optimizer
knowledge), then one optimizer-aware step (recipes.resolve) routes, parses and validates
[optim] once."""

from __future__ import annotations

import pytest

from recipes import config, optimizers, resolve
from recipes import resume as resuming
from recipes.model import build_model
from recipes.resume import compare


def test_the_schema_keeps_optim_settings_as_given():
    """config.parse_args applies [model]/[train] and keeps [optim] raw: TOML first, then the
    command line (a later value replaces an earlier one), with the keys the command line gave."""
    args = config.parse_args(["--config", "tiny", "--optim.rank", "8", "--optim.projector",
                              "random", "--model.dim", "64"])  # fmt: skip
    assert args.job.model.dim == 64 and args.job.optim == config.OptimConfig()  # untouched
    assert args.optim["rank"] == "8" and args.optim["name"] == "galore_adamw"  # raw strings
    assert args.optim["projector"] == "random" and args.optim["lr"] == 0.01  # TOML's value
    assert args.cli_optim == {"rank", "projector"}


def test_routing_follows_the_chosen_optimizer():
    """``--optim.eps``/``--optim.beta1`` are Adam's fields for galore_adamw, GaLoreAdafactor's
    own options (an eps pair) for galore_adafactor."""
    adam = resolve.parse_args(["--optimizer", "galore_adamw", "--optim.eps", "1e-6"]).optim
    assert adam.eps == 1e-6 and adam.options == {}
    argv = ["--optimizer", "galore_adafactor", "--optim.eps", "1e-30,1e-3", "--optim.beta1", "0.9"]
    ada = resolve.parse_args(argv).optim
    assert ada.eps == config.OptimConfig().eps  # the field is not Adafactor's eps
    assert ada.options == {"eps": (1e-30, 1e-3), "beta1": 0.9}


#: GaLore's settings in recipes/configs/tiny.toml's [optim]
TINY_GALORE = {"rank": 32, "update_proj_gap": 50, "scale": 0.25}


def test_galore2_options_are_declared_by_galore2_only():
    """No [optim] field shares a name with an option of a galore2 optimizer but torch.optim's
    lr and weight_decay and Adam's beta1/beta2/eps fields (every contender takes them): rank,
    update_proj_gap, scale, proj_type... are GaLore's declarations, reached as options."""
    fields = set(config.field_names(config.OptimConfig()))
    options = {k for cls in optimizers.PRESETS.values() for k in cls.all_options()}
    assert fields & options == {"lr", "weight_decay", "beta1", "eps"}  # beta1, eps: Adafactor's
    assert not fields & {o.name for o in optimizers.GaLore.options}


def test_rank_reaches_the_projected_group_as_given():
    """``--optim.rank`` is parsed by GaLore's option and lands on the projected group (built
    by the recipe, not found by its keys) and nowhere else; without it, the recipe's default."""
    job = resolve.parse_args(["--config", "tiny", "--optim.rank", "6"])
    assert job.optim.options["rank"] == 6
    opt = optimizers.build_optimizer(build_model(job.model), job.optim, 10)
    assert [g["rank"] for g in opt.param_groups] == [6, None, None]
    job = resolve.parse_args(["--optimizer", "galore_adamw"])
    assert job.optim.options == {} and optimizers.galore_settings(job.optim) == {"rank": 128}
    with pytest.raises(ValueError, match=r"rank must be None .* or an int >= 1, got 0"):
        resolve.parse_args(["--optim.rank", "0"])
    with pytest.raises(ValueError, match="optim.rank must be an int >= 1"):
        optimizers.build_optimizer(build_model(job.model), resolve.optim_config({"rank": None}), 1)


def test_options_are_parsed_once(monkeypatch):
    """From the command line to a built optimizer, its resume comparison and the planner's
    settings, ``optim.options`` are parsed and validated exactly once."""
    calls = []
    real = resolve.parse_options

    def counted(name, raw):
        calls.append(dict(raw))
        return real(name, raw)

    monkeypatch.setattr(resolve, "parse_options", counted)
    monkeypatch.setattr(resuming, "parse_options", counted)
    job = resolve.parse_args(["--config", "tiny", "--optim.projector", "power",
                              "--optim.basis_dtype", "bf16"])  # fmt: skip
    given = {**TINY_GALORE, "projector": "power", "basis_dtype": "bf16"}
    assert calls == [given]
    assert job.optim.options == given
    opt = optimizers.build_optimizer(build_model(job.model), job.optim, 10)
    (group,) = [g for g in opt.param_groups if g.get("rank")]
    assert (group["projector"], group["basis_dtype"]) == ("power", "bf16")
    optimizers.galore_settings(job.optim)
    optimizers.galore2_options(job.optim)
    assert len(calls) == 1
    assert compare(job.to_dict(), job) == ({}, {})  # reads a recorded config: its own parse
    assert len(calls) == 2 and calls[1] == given


def test_optim_errors_come_from_the_one_step(tmp_path):
    bad = tmp_path / "bad.toml"
    bad.write_text("[optim]\nrnak = 4\n")
    args = config.parse_args(["--config", str(bad)])  # the schema cannot tell: kept as given
    assert args.optim == {"rnak": 4}
    with pytest.raises(
        ValueError, match=r"unknown setting 'optim.rnak' for optimizer galore_adamw"
    ):
        resolve.resolve(args)
    with pytest.raises(ValueError, match=r"unknown setting 'model.rnak'"):
        config.parse_args(["--model.rnak", "4"])  # other sections: the schema's own error
