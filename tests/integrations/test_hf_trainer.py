"""Hugging Face Trainer integration: ``create_optimizer``, ``GaLoreTrainer`` and
``optimizer_cls_and_kwargs`` (CPU, tiny Llama)."""

from __future__ import annotations

import warnings

import pytest
import torch
from torch import nn

import galore2

from ..missing_backends import assert_ok

transformers = pytest.importorskip("transformers")

from galore2.integrations.transformers import (  # noqa: E402
    GaLoreTrainer,
    OptimizerFactory,
    create_optimizer,
    default_rank,
    optimizer_cls_and_kwargs,
    parse_optim_args,
)

from .hf_cases import (  # noqa: E402
    PATHS,
    RANK,
    Motifs,
    losses,
    tiny_llama,
    training_args,
)

LINEARS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def linear_weights(model: nn.Module, names: tuple[str, ...] = LINEARS) -> set[int]:
    return {
        id(m.weight)
        for n, m in model.named_modules()
        if isinstance(m, nn.Linear) and n.rsplit(".", 1)[-1] in names
    }


def projected(opt: torch.optim.Optimizer) -> set[int]:
    return {id(p) for g in opt.param_groups if g["rank"] is not None for p in g["params"]}


def group_table(opt: torch.optim.Optimizer, model: nn.Module) -> dict[str, dict]:
    """Each parameter's name → its group's settings (every key but ``params``)."""
    name = {id(p): n for n, p in model.named_parameters()}
    table = {
        name[id(p)]: {k: v for k, v in g.items() if k != "params"}
        for g in opt.param_groups
        for p in g["params"]
    }
    assert sum(len(g["params"]) for g in opt.param_groups) == len(table)  # each once
    return table


def assert_trained_low_rank(trainer: transformers.Trainer, opt: galore2.GaLoreAdamW) -> None:
    steps = losses(trainer)
    assert sorted(steps) == list(range(1, 31))
    first, last = sum(steps[s] for s in range(1, 6)) / 5, sum(steps[s] for s in range(26, 31)) / 5
    assert last < first - 0.5, (first, last)
    model = trainer.model
    targets = linear_weights(model)
    assert projected(opt) == targets and len(targets) == 14  # lm_head is not projected
    for p in model.parameters():
        moment = opt.state[p]["adam.exp_avg"]
        if id(p) in targets:  # one side r, the other the parameter's own
            assert moment.shape in {(RANK, p.shape[1]), (p.shape[0], RANK)}, (p.shape, moment.shape)
            assert int(opt.state[p]["galore.refreshes"]) == 3  # steps 0, 10, 20
        else:
            assert moment.shape == p.shape


@pytest.mark.parametrize("path", PATHS)
def test_each_path_trains_low_rank(straight_runs, path):
    """30 steps (gradient accumulation 2) through each way in: the loss falls, the linear
    layers are projected at rank 8 and refreshed every 10 steps, the rest is plain AdamW."""
    run = straight_runs[path]
    opt = run.trainer.optimizer.optimizer  # accelerate's wrapper around ours
    assert type(opt) is galore2.GaLoreAdamW
    if path == "optimizers":
        assert opt is run.given  # wrapped by accelerate, not replaced
    assert_trained_low_rank(run.trainer, opt)
    assert opt.state_bytes()["basis"] > 0


def test_the_three_paths_are_one_optimizer(straight_runs):
    """Same settings, same groups (per parameter, every key: rank, weight decay by the
    Trainer's rule, lr from args...), bitwise the same losses, weights and optimizer state."""
    ref = straight_runs[PATHS[0]].trainer
    decayed = set(transformers.Trainer.get_decay_parameter_names(None, ref.model))

    def groups(trainer):
        return group_table(trainer.optimizer, trainer.model)

    ref_groups = groups(ref)
    assert set(ref_groups) == {n for n, _ in ref.model.named_parameters()}
    assert any(n not in decayed for n in ref_groups)  # the norm weights
    for name, g in ref_groups.items():
        assert g["weight_decay"] == (0.1 if name in decayed else 0.0), name
        assert g["initial_lr"] == ref.args.learning_rate == 3e-3
        assert g["rank"] == (RANK if name.endswith("_proj.weight") else None), name
    ref_state = ref.optimizer.state_dict()["state"]
    for path in PATHS[1:]:
        trainer = straight_runs[path].trainer
        assert groups(trainer) == ref_groups, path
        assert losses(trainer) == losses(ref), path
        for (n, p), (_, q) in zip(
            trainer.model.named_parameters(), ref.model.named_parameters(), strict=True
        ):
            assert torch.equal(p, q), (path, n)
        state = trainer.optimizer.state_dict()["state"]
        assert state.keys() == ref_state.keys()
        for i, s in state.items():
            assert s.keys() == ref_state[i].keys()
            assert all(torch.equal(s[k], ref_state[i][k]) for k in s), (path, i)


def test_optimizer_cls_and_kwargs_pair(tmp_path):
    """A factory and plain kwargs (no ``params``: nothing for the Trainer to pop), built when
    the Trainer asks, on its model; the pair serves several Trainers, and ``model_init``."""
    args = training_args(tmp_path, weight_decay=0.05, learning_rate=2e-3)
    model = tiny_llama(bias=True)
    factory, kwargs = optimizer_cls_and_kwargs(
        model, args, optimizer_cls="galore_adamw8bit", rank=4
    )
    assert factory is OptimizerFactory and "params" not in kwargs
    assert kwargs["args"] is args and kwargs["optimizer_cls"] is galore2.GaLoreAdamW8bit
    assert kwargs["rank"] == 4
    before = dict(kwargs)
    reference = create_optimizer(model, args, optimizer_cls=galore2.GaLoreAdamW8bit, rank=4)
    for m in (model, tiny_llama(bias=True)):
        trainer = transformers.Trainer(m, args, optimizer_cls_and_kwargs=(factory, kwargs))
        opt = trainer.create_optimizer()
        assert type(opt) is galore2.GaLoreAdamW8bit
        assert group_table(opt, m) == group_table(reference, model)
    assert kwargs == before  # not consumed
    # model_init: no model yet; the settings are checked now, the optimizer built later.
    pair = optimizer_cls_and_kwargs(None, args, rank=4)
    trainer = transformers.Trainer(
        model_init=lambda: tiny_llama(), args=args, optimizer_cls_and_kwargs=pair
    )
    opt = trainer.create_optimizer()
    assert projected(opt) == linear_weights(trainer.model) and len(projected(opt)) == 14


def test_optimizer_cls_and_kwargs_checks_before_the_trainer(tmp_path):
    model, args = tiny_llama(), training_args(tmp_path)
    with pytest.raises(ValueError, match=r"galore_settings: unknown .*\['rnak'\]"):
        optimizer_cls_and_kwargs(model, args, rnak=4)
    with pytest.raises(ValueError, match=r"galore_settings: unknown .*\['rnak'\]"):
        optimizer_cls_and_kwargs(None, args, rnak=4)
    with pytest.raises(ValueError, match=r"galore_settings: rank must be .*got 0"):
        optimizer_cls_and_kwargs(None, args, rank=0)
    with pytest.raises(ValueError, match=r"rank must be .*got 0"):
        optimizer_cls_and_kwargs(model, args, rank=0)
    with pytest.raises(ValueError, match=r"no linear module .*matches \['nothing'\]"):
        optimizer_cls_and_kwargs(model, args, rank=4, target_modules=["nothing"])
    with pytest.raises(TypeError, match="optimizer_cls must be a galore2 optimizer"):
        optimizer_cls_and_kwargs(None, args, optimizer_cls="adamw_torch")
    pair = optimizer_cls_and_kwargs(model, args, rank=4)
    with pytest.raises(TypeError, match=r"pass optimizer_cls_and_kwargs to transformers\.Trainer"):
        GaLoreTrainer(model, args, optimizer_cls_and_kwargs=pair)


def test_galore_trainer_keeps_a_given_optimizer(tmp_path):
    model = tiny_llama()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    trainer = GaLoreTrainer(model, training_args(tmp_path), optimizers=(opt, None))
    assert trainer.create_optimizer() is opt


def test_hyperparameters_come_from_training_arguments(tmp_path):
    model = tiny_llama(bias=True)
    args = training_args(
        tmp_path,
        learning_rate=2e-3,
        weight_decay=0.05,
        adam_beta1=0.8,
        adam_beta2=0.95,
        adam_epsilon=1e-6,
    )
    opt = create_optimizer(model, args, rank=4, update_proj_gap=7, scale=0.5, projector="svd")
    # Projected (all decayed), plain decayed (embedding, head), plain not decayed: 3 groups.
    assert len(opt.param_groups) == 3
    for g in opt.param_groups:
        assert g["lr"] == 2e-3 and g["betas"] == (0.8, 0.95) and g["eps"] == 1e-6
    galore = [g for g in opt.param_groups if g["rank"] is not None]
    assert len(galore) == 1
    assert (galore[0]["rank"], galore[0]["update_proj_gap"]) == (4, 7)
    assert (galore[0]["scale"], galore[0]["projector"]) == (0.5, "svd")
    # Weight decay as the Trainer's: none for biases and norm weights, 0.05 for the rest.
    decay_of = {id(p): g["weight_decay"] for g in opt.param_groups for p in g["params"]}
    names = dict(model.named_parameters())
    assert set(decay_of) == {id(p) for p in names.values()}  # every parameter exactly once
    for name, p in names.items():
        no_decay = name.endswith(".bias") or "norm" in name
        assert decay_of[id(p)] == (0.0 if no_decay else 0.05), name
    assert any(n.endswith("q_proj.bias") for n in names)


class NormGated(nn.Module):
    """A projected Linear the Trainer does not decay (its name ends in ``_norm``)."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(10, 16)
        self.proj = nn.Linear(16, 16)
        self.gate_norm = nn.Linear(16, 16, bias=False)
        self.lm_head = nn.Linear(16, 10)


def test_four_groups_and_empty_groups_dropped(tmp_path):
    model = NormGated()
    opt = create_optimizer(model, training_args(tmp_path), rank=2)
    groups = {(g["rank"] is not None, g["weight_decay"]): g["params"] for g in opt.param_groups}
    assert len(opt.param_groups) == 4
    assert groups[(True, 0.1)] == [model.proj.weight]
    assert groups[(True, 0.0)] == [model.gate_norm.weight]
    assert groups[(False, 0.1)] == [model.embed.weight, model.lm_head.weight]
    assert groups[(False, 0.0)] == [model.proj.bias, model.lm_head.bias]
    model.embed.requires_grad_(False)
    model.lm_head.requires_grad_(False)
    opt = create_optimizer(model, training_args(tmp_path), rank=2)
    assert len(opt.param_groups) == 3  # frozen parameters are left out; no empty group


@pytest.mark.parametrize(
    ("target", "expected"),
    [
        (None, LINEARS),  # galore2's default: every Linear but the head
        ("all-linear", (*LINEARS, "lm_head")),  # HF's: the head too
        ("all_linear", (*LINEARS, "lm_head")),
        (r".*\.self_attn\.[qv]_proj", ("q_proj", "v_proj")),  # a str is fullmatched
        (["q_proj", r"model\.layers\.\d+\.mlp\.down_proj"], ("q_proj", "down_proj")),
        (["lm_head"], ("lm_head",)),  # the head, when named
    ],
)
def test_optim_target_modules(tmp_path, target, expected):
    model = tiny_llama()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        opt = create_optimizer(model, training_args(tmp_path, optim_target_modules=target), rank=4)
    assert projected(opt) == linear_weights(model, expected)


def test_optim_target_modules_edge_cases(tmp_path):
    model = tiny_llama()
    # A str is fullmatched, not searched: "q_proj" names no module.
    with pytest.raises(ValueError, match=r"no linear module .*matches 'q_proj'"):
        create_optimizer(model, training_args(tmp_path, optim_target_modules="q_proj"), rank=4)
    # A list entry matches as a substring; a non-Linear module matched by name is skipped,
    # with a warning (one matched by regex is not reported).
    args = training_args(tmp_path, optim_target_modules=["mlp"])
    with pytest.warns(UserWarning, match=r"model\.layers\.0\.mlp'.* not linear"):
        opt = create_optimizer(model, args, rank=4)
    assert projected(opt) == linear_weights(model, ("gate_proj", "up_proj", "down_proj"))
    args = training_args(tmp_path, optim_target_modules=[r"model\.layers\.1\.mlp.*"])
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        opt = create_optimizer(model, args, rank=4)
    assert projected(opt) == {id(model.model.layers[1].mlp.up_proj.weight)} | {
        id(model.model.layers[1].mlp.gate_proj.weight),
        id(model.model.layers[1].mlp.down_proj.weight),
    }
    # galore_settings override args.
    opt = create_optimizer(model, args, rank=4, target_modules=["o_proj"])
    assert projected(opt) == linear_weights(model, ("o_proj",))
    with pytest.raises(TypeError, match="optim_target_modules must be"):
        create_optimizer(model, training_args(tmp_path), rank=4, target_modules=3)


def test_unknown_settings_raise(tmp_path):
    model, args = tiny_llama(), training_args(tmp_path)
    with pytest.raises(
        ValueError, match=r"galore_settings: unknown .*\['rnak'\].*allowed: .*'rank'"
    ):
        create_optimizer(model, args, rnak=4)
    with pytest.raises(ValueError, match=r"\['lrr'\]"):
        GaLoreTrainer(model, args, galore_settings={"rank": 4, "lrr": 1e-3})
    with pytest.raises(ValueError, match=r"optim_args='rank=4,foo=1': unknown .*\['foo'\]"):
        create_optimizer(model, training_args(tmp_path, optim_args="rank=4,foo=1"))
    with pytest.raises(ValueError, match=r"rank must be .*an int >= 1"):  # checked by galore2
        create_optimizer(model, args, rank=0)


def test_empty_target_modules_are_refused_not_all_linear(tmp_path):
    """Issue 16 item 16: ``optim_target_modules=[]`` silently meant every linear layer."""
    model = tiny_llama()
    with pytest.raises(ValueError, match=r"matches \[\].*empty list selects nothing"):
        create_optimizer(model, training_args(tmp_path, optim_target_modules=[]), rank=4)
    with pytest.raises(ValueError, match=r"empty list"):
        create_optimizer(model, training_args(tmp_path), rank=4, target_modules=[])


@pytest.mark.parametrize("cls", [torch.optim.AdamW, "GaLoreAdamW"])
def test_non_galore_optimizer_class_is_refused(tmp_path, cls):
    """Issue 16 item 16: ``optimizer_cls=torch.optim.AdamW`` with ``rank=`` must not drop rank."""
    model = tiny_llama()
    with pytest.raises(TypeError, match=r"optimizer_cls must be a galore2 optimizer class") as e:
        create_optimizer(model, training_args(tmp_path), optimizer_cls=cls, rank=4)
    listed = str(e.value).split("(", 1)[1].split(")", 1)[0].split(", ")  # from PRESETS
    assert {"GaLoreAdamW", "GaLoreRanger21", "Fira", "APOLLO", "APOLLOMini", "GaLoreMuon"} <= set(
        listed
    ), listed


@pytest.mark.parametrize(
    "cls",
    [galore2.GaLoreAdamW, galore2.GaLoreAdamW8bit, galore2.GaLoreAdafactor, galore2.GaLoreRanger21,
     galore2.Fira, galore2.APOLLO, galore2.APOLLOMini, galore2.GaLoreMuon],
)  # fmt: skip
def test_every_listed_key_parses_from_its_string_form(cls):
    """Issue 16 item 15: each key ``allowed_settings`` lists must be settable through
    ``optim_args``, i.e. parse from the text a user writes (``true``, ``0.5``, ``none``...)."""
    from galore2.integrations.transformers import allowed_settings

    for name, option in allowed_settings(cls).items():
        value = option.example()
        if isinstance(value, bool):
            forms = [str(value).lower(), str(value)]  # true / True
        elif isinstance(value, tuple):
            forms = [f"({value[0]},{value[1]})"]
        elif value is None:
            forms = ["none"]
        else:
            forms = [str(value)]
        for text in forms:
            parsed = parse_optim_args(f"{name}={text}", cls)
            assert parsed == {name: option.validate(value)}, (name, text, parsed)


def test_issue_16_keys_parse(tmp_path):
    """The keys the issue found unsettable, in the form it used."""
    text = (
        "adaptive_refresh=true,basis_hadamard=True,basis_group_size=64,refresh_threshold=0.5,"
        "refresh_patience=2,max_update_proj_gap=400,rank=4,basis_dtype=int8"
    )
    assert parse_optim_args(text) == {
        "adaptive_refresh": True,
        "basis_hadamard": True,
        "basis_group_size": 64,
        "refresh_threshold": 0.5,
        "refresh_patience": 2,
        "max_update_proj_gap": 400,
        "rank": 4,
        "basis_dtype": "int8",
    }
    opt = create_optimizer(tiny_llama(), training_args(tmp_path, optim_args=text))
    (galore,) = [g for g in opt.param_groups if g["rank"] is not None]
    assert galore["adaptive_refresh"] is True and galore["max_update_proj_gap"] == 400


def test_optim_args(tmp_path):
    model = tiny_llama()
    args = training_args(
        tmp_path,
        optim_args="rank=4, update_proj_gap=50,scale=0.5,projector=svd,state_dtype=bfloat16",
    )
    assert parse_optim_args(args.optim_args) == {
        "rank": 4,
        "update_proj_gap": 50,
        "scale": 0.5,
        "projector": "svd",
        "state_dtype": "bfloat16",
    }
    opt = create_optimizer(model, args, rank=6)  # keyword settings win
    (galore,) = [g for g in opt.param_groups if g["rank"] is not None]
    assert (galore["rank"], galore["update_proj_gap"], galore["scale"]) == (6, 50, 0.5)
    assert galore["projector"] == "svd"
    assert all(g["state_dtype"] == "bfloat16" for g in opt.param_groups)  # optimizer-wide
    assert parse_optim_args(None) == {} and parse_optim_args("") == {}
    with pytest.raises(ValueError, match="key=value"):
        parse_optim_args("rank")
    with pytest.raises(ValueError, match=r"rank must be .*got 'four'"):
        parse_optim_args("rank=four")
    # Nothing set anywhere: the Trainer's own GaLore default rank.
    (galore,) = [
        g for g in create_optimizer(model, training_args(tmp_path)).param_groups if g["rank"]
    ]
    assert galore["rank"] == 128


def test_package_import_does_not_import_transformers():
    assert_ok("integrations")  # without transformers (tests/missing_backends.py)
    # Inside the package the module named ``transformers`` imports the real library.
    assert issubclass(GaLoreTrainer, transformers.Trainer)


def test_trainer_with_galore_ranger21(tmp_path):
    model = tiny_llama()
    args = training_args(tmp_path, learning_rate=1e-2)
    opt = create_optimizer(model, args, optimizer_cls=galore2.GaLoreRanger21, rank=RANK)
    assert isinstance(opt, galore2.GaLoreRanger21)
    assert opt.param_groups[0]["num_iterations"] == args.max_steps
    trainer = transformers.Trainer(model, args, train_dataset=Motifs(), optimizers=(opt, None))
    trainer.train()
    losses = [h["loss"] for h in trainer.state.log_history if "loss" in h]
    assert sum(losses[-5:]) / 5 < sum(losses[:5]) / 5 - 0.3, losses
    for p in model.parameters():
        if id(p) in linear_weights(model):
            assert RANK in opt.state[p]["pnm.exp_avg"].shape


@pytest.mark.parametrize(
    "cls", [galore2.Fira, galore2.APOLLO, galore2.APOLLOMini, galore2.GaLoreMuon]
)
def test_galore_trainer_with_low_rank_presets(tmp_path, cls):
    """Fira, APOLLO, APOLLO-Mini and GaLoreMuon through the integration: a few steps with
    finite losses, the preset's own defaults on the projected groups, low-rank state (the
    rank of APOLLO-Mini's groups is its own 1 when none is given)."""
    settings = {} if cls is galore2.APOLLOMini else {"rank": RANK}
    trainer = GaLoreTrainer(
        tiny_llama(),
        training_args(tmp_path, max_steps=3),
        train_dataset=Motifs(),
        optimizer_cls=cls,
        galore_settings={"update_proj_gap": 10, **settings},
    )
    before = {id(p): p.detach().clone() for p in trainer.model.parameters()}
    trainer.train()
    opt = trainer.optimizer.optimizer
    assert type(opt) is cls
    losses = [h["loss"] for h in trainer.state.log_history if "loss" in h]
    assert len(losses) == 3 and all(torch.isfinite(torch.tensor(losses))), losses
    rank = settings.get("rank", default_rank(cls))
    assert (cls is galore2.APOLLOMini) == (rank == 1)
    targets = linear_weights(trainer.model)
    assert projected(opt) == targets
    for g in opt.param_groups:
        if g["rank"] is not None:
            assert g["rank"] == rank
            assert {k: g[k] for k in cls.preset_defaults} == cls.preset_defaults
    key = "muon.momentum" if cls is galore2.GaLoreMuon else "adam.exp_avg"
    for p in trainer.model.parameters():
        assert not torch.equal(p.detach(), before[id(p)])  # every parameter trained
        if id(p) in targets:
            shape = opt.state[p][key].shape
            assert shape in {(rank, p.shape[1]), (p.shape[0], rank)}, (p.shape, shape)


# ---- issue 30: optim_args errors quote what was typed; weight decay settings reach groups ----


def test_optim_args_errors_quote_the_text_as_given():
    with pytest.raises(
        ValueError,
        match=r"optim_args='rank=8 scale=0\.25': 'rank=8 scale=0\.25' is not one key=value; "
        r"entries are separated by commas",
    ):
        parse_optim_args("rank=8 scale=0.25")
    with pytest.raises(ValueError, match=r"optim_args='rank=8,rank=16': 'rank' is set twice"):
        parse_optim_args("rank=8,rank=16")
    spaced = parse_optim_args(" rank = 8 , betas=(0.9, 0.95) ")  # spaces around entries are fine
    assert spaced == {"rank": 8, "betas": (0.9, 0.95)}


def test_ranger21_gives_its_galore_hint_once(tmp_path):
    with pytest.raises(ValueError, match=r"\['rank', 'update_proj_gap'\] for Ranger21") as e:
        parse_optim_args("rank=8,update_proj_gap=5", galore2.Ranger21)
    assert str(e.value).count("need GaLoreRanger21") == 1
    with pytest.raises(ValueError, match=r"galore_settings: unknown") as e:
        create_optimizer(
            tiny_llama(), training_args(tmp_path), optimizer_cls=galore2.Ranger21,
            rank=8, update_proj_gap=5,
        )  # fmt: skip
    assert str(e.value).count("need GaLoreRanger21") == 1


@pytest.mark.parametrize("how", ["keyword", "optim_args"])
def test_weight_decay_setting_reaches_the_decayed_groups_only(tmp_path, how):
    """TrainingArguments.weight_decay is 0; the galore2 setting 0.1 decays the decayed groups
    and bias / norm weights stay at 0."""
    model = NormGated()
    if how == "keyword":
        args = training_args(tmp_path, weight_decay=0.0)
        opt = create_optimizer(model, args, rank=2, weight_decay=0.1)
    else:
        args = training_args(tmp_path, weight_decay=0.0, optim_args="rank=2,weight_decay=0.1")
        opt = create_optimizer(model, args)
    groups = {(g["rank"] is not None, g["weight_decay"]): g["params"] for g in opt.param_groups}
    assert groups == {
        (True, 0.1): [model.proj.weight],
        (True, 0.0): [model.gate_norm.weight],
        (False, 0.1): [model.embed.weight, model.lm_head.weight],
        (False, 0.0): [model.proj.bias, model.lm_head.bias],
    }
