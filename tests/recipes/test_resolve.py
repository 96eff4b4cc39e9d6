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
    """``--optim.eps``/``--optim.beta1`` are Adam's ``eps`` and half of its ``betas`` for
    galore_adamw, GaLoreAdafactor's own options (an eps pair) for galore_adafactor."""
    adam = resolve.parse_args(["--optimizer", "galore_adamw", "--optim.eps", "1e-6",
                               "--optim.beta1", "0.8"]).optim  # fmt: skip
    assert adam.options == {"eps": 1e-6, "betas": (0.8, 0.999)}
    argv = ["--optimizer", "galore_adafactor", "--optim.eps", "1e-30,1e-3", "--optim.beta1", "0.9"]
    ada = resolve.parse_args(argv).optim
    assert ada.options == {"eps": (1e-30, 1e-3), "beta1": 0.9}
    assert optimizers.setting(ada, "betas") == (0.9, 0.999)  # Adam's, which Adafactor ignores


def test_lr_weight_decay_betas_eps_are_galore2_options_for_every_optimizer():
    """One declaration each: galore2's ``lr``, ``weight_decay``, ``betas``, ``eps`` parse and
    check ``--optim.KEY`` for every recipe optimizer (torch's AdamW too); unset, each is at
    the recipe's default (weight decay 0) or the declared one."""
    from galore2.core.modules import WEIGHT_DECAY
    from galore2.core.step import LR
    from galore2.optim.adam import BETAS, EPS

    for name in optimizers.NAMES:
        declared = optimizers.declarations(name)
        assert declared["lr"] is LR and declared["weight_decay"] is WEIGHT_DECAY, name
        assert declared["betas"] is BETAS, name  # GaLoreAdafactor ignores it, as a peer's
        assert declared["eps"] is EPS or name == "galore_adafactor"  # its own pair
        unset = config.OptimConfig(name=name)
        assert optimizers.setting(unset, "weight_decay") == 0.0  # RECIPE_DEFAULTS
        assert optimizers.setting(unset, "lr") == LR.default
    job = resolve.parse_args(["--optimizer", "adamw", "--optim.betas", "0.9,0.95",
                              "--optim.weight_decay", "0.1", "--optim.lr", "3e-4"])  # fmt: skip
    assert job.optim.options == {"betas": (0.9, 0.95), "weight_decay": 0.1, "lr": 3e-4}
    with pytest.raises(ValueError, match=r"weight_decay must be a finite float >= 0, got -1.0"):
        resolve.parse_args(["--optimizer", "adamw", "--optim.weight_decay", "-1"])
    with pytest.raises(ValueError, match=r"optim.beta2 must be a finite float in \[0, 1\)"):
        resolve.parse_args(["--optim.beta2", "1.5"])
    with pytest.raises(ValueError, match="optim.betas and optim.beta1 set the same option"):
        resolve.parse_args(["--optim.betas", "0.9,0.95", "--optim.beta1", "0.8"])


def test_every_optimizer_gets_the_settings_main_gave_it():
    """``--config tiny --optimizer X`` builds X with the values main's [optim] fields gave
    it (tiny.toml's lr 0.01 and weight decay 0; betas (0.9, 0.999), eps 1e-8), every other
    key of its groups at galore2's default, GaLoreAdafactor's eps its own; given, each
    setting reaches every group (weight decay: the ≥2-D weights')."""
    for name in optimizers.NAMES:
        if not optimizers.available(name):
            continue
        for given in ([], ["--optim.lr", "0.02", "--optim.weight_decay", "0.1",
                           "--optim.beta2", "0.95", "--optim.eps", "1e-7"]):  # fmt: skip
            if name == "galore_adafactor":
                given = given[:-2]  # its eps is its own pair
            job = resolve.parse_args(["--config", "tiny", "--optimizer", name, *given])
            opt = optimizers.build_optimizer(build_model(job.model), job.optim, 10)
            want = {"lr": 0.02, "wd": 0.1, "betas": (0.9, 0.95), "eps": 1e-7} if given else {
                "lr": 0.01, "wd": 0.0, "betas": (0.9, 0.999), "eps": 1e-8}  # fmt: skip
            for g in opt.param_groups:
                assert g["lr"] == want["lr"] and g["weight_decay"] in (want["wd"], 0.0), name
                if name == "galore_adafactor":
                    assert g["eps"] == (None, 1e-3) and "betas" not in g
                else:
                    assert (g["betas"], g["eps"]) == (want["betas"], want["eps"]), name
                if "rank" in g and g is opt.param_groups[0]:
                    assert g["rank"] == (1 if name == "apollo_mini" else 32), name
            assert max(g["weight_decay"] for g in opt.param_groups) == want["wd"], name


#: the options in recipes/configs/tiny.toml's [optim]
TINY_OPTIONS = {"lr": 0.01, "weight_decay": 0.0, "rank": 32, "update_proj_gap": 50, "scale": 0.25}


def test_galore2_options_are_declared_by_galore2_only():
    """No [optim] field shares a name with an option of a recipe optimizer: lr,
    weight_decay, betas, eps, rank, update_proj_gap, scale, proj_type... are galore2's
    declarations, reached as options."""
    fields = set(config.field_names(config.OptimConfig()))
    options = {k for name in optimizers.NAMES for k in optimizers.declarations(name)}
    assert not fields & options
    assert not fields & set(resolve.BETA_HALVES)


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
    given = {**TINY_OPTIONS, "projector": "power", "basis_dtype": "bf16"}
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
