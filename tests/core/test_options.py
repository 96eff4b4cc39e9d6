"""Options are declared once, by the modules that read them; everything else derives.

Enumerates every option of every public optimizer and sets it through each way in:
the optimizer itself, the recipe's ``--optim.KEY`` flag and Hugging Face's ``optim_args``.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch
from torch import nn

import galore2
from galore2.core.optimizer import PASSTHROUGH_KEYS
from galore2.core.options import Option
from galore2.presets import PRESETS
from recipes.optimizers import build_optimizer, preset_fields
from recipes.resolve import parse_args
from tools import options_table

ROOT = Path(__file__).resolve().parents[2]

# Values whose derived example would break a check involving another key, with the
# companions that make them valid.
COMPANIONS: dict[str, dict[str, object]] = {
    # a stored basis (APOLLO's presets default to projector="random", which stores none)
    "basis_dtype": {"projector": "randomized"},
    "basis_hadamard": {"basis_dtype": "int8", "projector": "randomized"},
    # Fira and APOLLO are alternatives (Fira needs an orthonormal basis)
    "residual": {"scale_type": None, "projector": "randomized"},
    "scale_type": {"residual": "none"},
    "use_pnm": {"softplus": False},
    "max_update_proj_gap": {},
}
EXAMPLES: dict[str, object] = {"max_update_proj_gap": 4096, "basis_dtype": "int8"}


def _example(option: Option) -> object:
    return EXAMPLES.get(option.name, option.example())


def _text(value: object) -> str:
    """The command-line / optim_args spelling of a value."""
    if isinstance(value, bool):
        return "true" if value else "false"
    if value is None:
        return "none"
    if isinstance(value, tuple):
        return ",".join(_text(v) for v in value)
    return str(value)


def _cases() -> list[tuple[str, str]]:
    return [(name, key) for name, cls in PRESETS.items() for key in cls.all_options()]


class Tiny(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.attn = nn.Linear(16, 16)
        self.mlp = nn.Linear(16, 24)
        self.norm = nn.LayerNorm(16)


def _value_in(opt: torch.optim.Optimizer, key: str) -> list[object]:
    """Where ``key`` ended up: every group's value, or the preset's constructor switch."""
    if key in getattr(opt, "switches", {}):
        return [opt.switches[key]]
    return [g[key] for g in opt.param_groups if "rank" not in g or g["rank"] is not None
            or key not in {o.name for o in galore2.optim.GaLore.options}]  # fmt: skip


@pytest.mark.parametrize("page", options_table.pages(), ids=lambda p: p.name)
def test_options_tables_are_generated_from_the_declarations(page):
    # docs/guides/galore-options.md always holds the block; README.md while it has one
    text = page.read_text()
    assert options_table.BEGIN in text, f"{page} lost its generated options tables"
    assert options_table.current(text) == options_table.render(), (
        f"{page.relative_to(ROOT)}'s options tables are stale: run python -m tools.options_table"
    )


def test_the_options_guide_holds_the_generated_tables():
    assert options_table.pages()[0] == ROOT / "docs" / "guides" / "galore-options.md"
    assert options_table.BEGIN in options_table.GUIDE.read_text()


def test_every_group_key_read_in_the_package_is_declared():
    declared = {k for cls in PRESETS.values() for k in cls.all_options()}
    read = set()
    for path in (ROOT / "galore2").rglob("*.py"):
        for a, b in re.findall(r"group\[\"(\w+)\"\]|group\.get\(\"(\w+)\"", path.read_text()):
            read.add(a or b)
    assert read - declared - PASSTHROUGH_KEYS == set()  # params, param_names...: torch's


@pytest.mark.parametrize(("name", "key"), _cases())
def test_every_option_is_settable_on_the_optimizer(name, key):
    cls = PRESETS[name]
    option = cls.all_options()[key]
    value = _example(option)
    assert value != option.default
    kwargs = {"num_iterations": 10} if "num_iterations" in cls.all_options() else {}
    kwargs.update(COMPANIONS.get(key, {}))
    kwargs[key] = value
    if key in {o.name for o in galore2.optim.GaLore.options} and "rank" in cls.all_options():
        kwargs.setdefault("rank", 4)
    model = Tiny()
    opt = cls(model.parameters(), **kwargs)
    assert all(v == option.validate(value) for v in _value_in(opt, key))


@pytest.mark.parametrize(("name", "key"), _cases())
def test_every_option_is_settable_from_the_recipe_cli(name, key):
    option = PRESETS[name].all_options()[key]
    value = _example(option)
    if key in preset_fields(name):  # the preset fixes it (APOLLO-Mini's rank): refused
        with pytest.raises(ValueError, match=f"--optim.{key}"):
            parse_args(["--optimizer", name, f"--optim.{key}", _text(value)])
        return
    argv = ["--optimizer", name, f"--optim.{key}", _text(value)]
    for k, v in COMPANIONS.get(key, {}).items():
        argv += [f"--optim.{k}", _text(v)]
    cfg = parse_args(argv).optim
    opt = build_optimizer(Tiny(), cfg, total_steps=10)
    got = _value_in(opt, key)
    # (plain groups keep their defaults; a field the preset fixes, e.g. APOLLO-Mini's rank 1,
    # keeps the preset's value: recipes.optimizers.preset_fields)
    expected = preset_fields(name).get(key, option.validate(value))
    assert expected in got, (key, got)


@pytest.mark.parametrize(("name", "key"), _cases())
def test_every_option_parses_from_hf_optim_args(name, key):
    pytest.importorskip("transformers")
    from galore2.integrations.transformers import parse_optim_args

    option = PRESETS[name].all_options()[key]
    value = _example(option)
    text = _text(value)
    if isinstance(value, tuple):
        text = f"({text})"
    assert parse_optim_args(f"{key}={text}", PRESETS[name]) == {key: option.validate(value)}


def test_unknown_keys_are_errors_everywhere():
    model = Tiny()
    with pytest.raises(TypeError, match="bogus"):
        galore2.GaLoreAdamW(model.parameters(), bogus=1)
    with pytest.raises(ValueError, match="bogus"):
        galore2.GaLoreAdamW([{"params": list(model.parameters()), "bogus": 1}])
    with pytest.raises(ValueError, match="bogus"):
        galore2.param_groups(model, rank=4, bogus=1)
    with pytest.raises(ValueError, match="bogus"):
        parse_args(["--optimizer", "galore_adamw", "--optim.bogus", "1"])
    with pytest.raises(ValueError, match="projector"):  # a peer takes no galore2 options
        parse_args(["--optimizer", "adamw", "--optim.projector", "svd"])
    with pytest.raises(ValueError, match="power_iters"):  # parsed and checked by the option
        parse_args(["--optimizer", "galore_adamw", "--optim.power_iters", "-1"])


def test_unknown_optim_args_key_is_an_error():
    pytest.importorskip("transformers")
    from galore2.integrations.transformers import parse_optim_args

    with pytest.raises(ValueError, match="bogus"):
        parse_optim_args("rank=4,bogus=1")
    with pytest.raises(ValueError, match="oversample"):
        parse_optim_args("oversample=-3")


def test_one_name_one_declaration_per_optimizer():
    for cls in PRESETS.values():
        options = cls.all_options()  # raises if a name had two declarations
        assert all(isinstance(o, Option) for o in options.values())
