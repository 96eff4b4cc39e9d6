"""``galore2.param_groups``: which parameters are projected, and that every one lands once."""

from __future__ import annotations

import re
import warnings

import pytest
import torch
from torch import nn

import galore2

transformers = pytest.importorskip("transformers")

LLAMA_LINEARS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def tiny_llama(tie: bool = True, bias: bool = False) -> nn.Module:
    cfg = transformers.LlamaConfig(
        vocab_size=64,
        hidden_size=16,
        intermediate_size=32,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=1,
        max_position_embeddings=32,
        tie_word_embeddings=tie,
        attention_bias=bias,
    )
    torch.manual_seed(0)
    return transformers.LlamaForCausalLM(cfg)


class Block(nn.Module):
    def __init__(self, d: int) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(d)
        self.attn_qkv = nn.Linear(d, 3 * d)
        self.attn_out = nn.Linear(d, d, bias=False)
        self.ff_in = nn.Linear(d, 2 * d)
        self.ff_out = nn.Linear(2 * d, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        q, k, v = self.attn_qkv(self.norm(x)).chunk(3, dim=-1)
        x = x + self.attn_out(torch.softmax(q @ k.mT, dim=-1) @ v)
        return x + self.ff_out(torch.relu(self.ff_in(x)))


class CustomLM(nn.Module):
    """No ``get_output_embeddings``: the head is recognised by its name."""

    def __init__(self, d: int = 8, vocab: int = 20, tie: bool = False) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, d)
        self.conv = nn.Conv1d(d, d, 3, padding=1)
        self.blocks = nn.ModuleList([Block(d), Block(d)])
        self.final_norm = nn.LayerNorm(d)
        self.lm_head = nn.Linear(d, vocab, bias=False)
        if tie:
            self.lm_head.weight = self.embed.weight

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        x = self.embed(ids)
        x = self.conv(x.mT).mT
        for b in self.blocks:
            x = b(x)
        return self.lm_head(self.final_norm(x))


def names_of(model: nn.Module, params) -> set[str]:
    by_id = {id(p): n for n, p in model.named_parameters()}
    return {by_id[id(p)] for p in params}


def check_partition(model: nn.Module, groups: list[dict]) -> None:
    """Every trainable parameter in exactly one group; nothing frozen; no duplicates."""
    ids = [id(p) for g in groups for p in g["params"]]
    assert len(ids) == len(set(ids)), "a parameter appears twice"
    trainable = {id(p) for p in model.parameters() if p.requires_grad}  # tied counted once
    assert set(ids) == trainable


def split(model: nn.Module, groups: list[dict]) -> tuple[set[str], set[str]]:
    galore = [g for g in groups if g.get("rank") is not None]
    other = [g for g in groups if g.get("rank") is None]
    assert len(galore) <= 1 and len(other) <= 1
    g = names_of(model, galore[0]["params"]) if galore else set()
    o = names_of(model, other[0]["params"]) if other else set()
    return g, o


@pytest.mark.parametrize("tie", [True, False])
def test_all_linear_llama(tie):
    model = tiny_llama(tie=tie, bias=True)
    groups = galore2.param_groups(model, rank=4, update_proj_gap=10, projector="svd")
    check_partition(model, groups)
    galore, other = split(model, groups)
    expected = {
        f"model.layers.{i}.{mod}.{name}.weight"
        for i in range(2)
        for mod, names in (("self_attn", LLAMA_LINEARS[:4]), ("mlp", LLAMA_LINEARS[4:]))
        for name in names
    }
    assert galore == expected
    assert not any("lm_head" in n or "embed" in n for n in galore)
    assert not any(n.endswith(".bias") for n in galore)  # biases of matched Linears go plain
    assert "model.layers.0.self_attn.q_proj.bias" in other
    assert "model.norm.weight" in other
    if tie:  # one tensor, counted once (under the name named_parameters gives it)
        assert model.lm_head.weight is model.model.embed_tokens.weight
        assert "model.embed_tokens.weight" in other
    else:
        assert {"lm_head.weight", "model.embed_tokens.weight"} <= other
    # settings go to the GaLore group only
    g0 = next(g for g in groups if g.get("rank") is not None)
    assert (g0["rank"], g0["update_proj_gap"], g0["projector"]) == (4, 10, "svd")
    other_group = next(g for g in groups if g.get("rank") is None)
    assert "update_proj_gap" not in other_group


def test_all_linear_llama_trains():
    """The groups feed GaLoreAdamW directly; projected weights get a basis, the head does not."""
    model = tiny_llama(tie=False)
    opt = galore2.GaLoreAdamW(galore2.param_groups(model, rank=4), lr=1e-3)
    ids = torch.randint(0, 64, (2, 8))
    loss = model(input_ids=ids, labels=ids).loss
    loss.backward()
    opt.step()
    q = model.model.layers[0].self_attn.q_proj.weight
    assert int(opt.state[q]["galore.side"]) != 0
    assert opt.state[q]["adam.exp_avg"].shape != q.shape
    head = model.lm_head.weight
    assert int(opt.state[head]["galore.side"]) == 0
    assert opt.state[head]["adam.exp_avg"].shape == head.shape


@pytest.mark.parametrize("tie", [True, False])
def test_all_linear_custom_module_skips_lm_head(tie):
    model = CustomLM(tie=tie)
    groups = galore2.param_groups(model, rank=2)
    check_partition(model, groups)
    galore, other = split(model, groups)
    assert galore == {
        f"blocks.{i}.{name}.weight"
        for i in range(2)
        for name in ("attn_qkv", "attn_out", "ff_in", "ff_out")
    }
    assert "lm_head.weight" not in galore
    assert "conv.weight" in other  # not a Linear
    assert "blocks.0.ff_in.bias" in other
    if tie:
        assert "lm_head.weight" not in other  # the tied tensor is listed once, as embed.weight
        assert "embed.weight" in other


def test_all_linear_uses_get_output_embeddings():
    """A head that is not named like one is still skipped when the model declares it."""

    class Declared(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.body = nn.Linear(8, 8)
            self.proj_out = nn.Linear(8, 30)

        def get_output_embeddings(self) -> nn.Module:
            return self.proj_out

    model = Declared()
    galore, other = split(model, galore2.param_groups(model, rank=2))
    assert galore == {"body.weight"}
    assert {"proj_out.weight", "proj_out.bias", "body.bias"} == other


def test_all_linear_keeps_inner_linears_named_like_heads():
    """Only the output head is skipped: a hidden Linear inside a block that happens to be
    called ``output`` / ``head`` is an ordinary weight matrix and must be projected."""

    class Inner(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.dense = nn.Linear(8, 8)
            self.output = nn.Linear(8, 8)

    class Net(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.layers = nn.ModuleList([Inner(), Inner()])
            self.lm_head = nn.Linear(8, 30)

    model = Net()
    galore, _ = split(model, galore2.param_groups(model, rank=2))
    assert galore == {f"layers.{i}.{n}.weight" for i in range(2) for n in ("dense", "output")}


def test_regex_targets():
    model = tiny_llama(tie=False)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # a regex that matches must not warn
        groups = galore2.param_groups(model, r"layers\.1\.self_attn\.(q|v)_proj", rank=2)
    check_partition(model, groups)
    galore, _ = split(model, groups)
    assert galore == {
        "model.layers.1.self_attn.q_proj.weight",
        "model.layers.1.self_attn.v_proj.weight",
    }

    # a regex is searched in module names: "mlp" selects every ≥2-D weight under any mlp
    galore, _ = split(model, galore2.param_groups(model, "mlp", rank=2))
    assert galore == {
        f"model.layers.{i}.mlp.{n}.weight" for i in range(2) for n in LLAMA_LINEARS[4:]
    }


def test_list_of_substrings_targets():
    model = tiny_llama(tie=False, bias=True)
    groups = galore2.param_groups(model, ["q_proj", "down_proj"], rank=2)
    check_partition(model, groups)
    galore, other = split(model, groups)
    assert galore == {
        f"model.layers.{i}.{n}.weight"
        for i in range(2)
        for n in ("self_attn.q_proj", "mlp.down_proj")
    }
    assert "model.layers.0.self_attn.q_proj.bias" in other


def test_matched_module_with_only_1d_params_and_non_linear_modules():
    """Targets may name any module; only its ≥2-D weights are projected (conv included)."""
    model = CustomLM()
    with pytest.warns(UserWarning, match="no parameter was selected"):
        groups = galore2.param_groups(model, ["norm"], rank=2)
    assert len(groups) == 1 and groups[0].get("rank") is None  # empty GaLore group dropped
    check_partition(model, groups)

    galore, other = split(model, galore2.param_groups(model, ["conv", "ff_in"], rank=2))
    assert galore == {"conv.weight", "blocks.0.ff_in.weight", "blocks.1.ff_in.weight"}
    assert {"conv.bias", "blocks.0.ff_in.bias"} <= other


def test_frozen_parameters_excluded():
    model = tiny_llama(tie=False)
    frozen = [model.model.layers[0].self_attn.q_proj.weight, model.model.embed_tokens.weight]
    for p in frozen:
        p.requires_grad_(False)
    groups = galore2.param_groups(model, rank=2)
    check_partition(model, groups)
    ids = {id(p) for g in groups for p in g["params"]}
    assert not any(id(p) in ids for p in frozen)


@pytest.mark.filterwarnings("ignore:galore2.param_groups. no parameter was selected")
def test_warning_names_targets_that_matched_nothing():
    model = tiny_llama()
    with pytest.warns(UserWarning, match="matched no module") as rec:
        groups = galore2.param_groups(model, ["q_proj", "no_such_layer"], rank=2)
    messages = " ".join(str(w.message) for w in rec)
    assert "no_such_layer" in messages
    assert "'q_proj'" not in messages
    galore, _ = split(model, groups)
    assert len(galore) == 2  # q_proj still selected

    with pytest.warns(UserWarning, match=re.escape("nothing_here")):
        galore2.param_groups(model, r"nothing_here\d", rank=2)


def test_no_galore_settings_go_to_plain_group():
    model = CustomLM()
    groups = galore2.param_groups(model, rank=2, scale=0.5, no_galore={"weight_decay": 0.0})
    g0 = next(g for g in groups if g.get("rank") is not None)
    g1 = next(g for g in groups if g.get("rank") is None)
    assert g0["scale"] == 0.5 and "weight_decay" not in g0
    assert g1["weight_decay"] == 0.0 and "scale" not in g1
    opt = galore2.GaLoreAdamW(groups, weight_decay=0.1)
    assert [g["weight_decay"] for g in opt.param_groups] == [0.1, 0.0]


@pytest.mark.parametrize(
    ("target", "match"),
    [
        ([], "target_modules"),
        ([""], "target_modules"),
        (["q_proj", 3], "target_modules"),
        ("(unclosed", "target_modules"),
    ],
)
def test_bad_target_modules(target, match):
    with pytest.raises(ValueError, match=match):
        galore2.param_groups(CustomLM(), target, rank=2)


@pytest.mark.parametrize("settings", [{}, {"rank": None}, {"update_proj_gap": 5}])
def test_missing_rank(settings):
    with pytest.raises(ValueError, match="rank"):
        galore2.param_groups(CustomLM(), **settings)


def test_unknown_setting():
    with pytest.raises(ValueError, match="rnak"):
        galore2.param_groups(CustomLM(), rank=2, rnak=3)
