"""GPT-2's linear layers are ``transformers``' ``Conv1D`` (weight stored transposed, in × out):
``param_groups``' ``"all-linear"``, the Hugging Face integration and the planner project
them like ``nn.Linear`` (issue 30 item 5: the planner claimed GaLore on every linear layer
while nothing was projected); other ≥2-D weights left out are named."""

from __future__ import annotations

import copy
import warnings

import pytest
import torch
from torch import nn

import galore2
from galore2.groups import is_linear
from galore2.plan import cli

transformers = pytest.importorskip("transformers")
from transformers.pytorch_utils import Conv1D  # noqa: E402

from galore2.integrations.transformers import create_optimizer  # noqa: E402

LAYERS = 2
#: the weights GaLore must project: per block, attention's c_attn / c_proj and the MLP's
PROJECTED = {
    f"transformer.h.{i}.{m}.weight"
    for i in range(LAYERS)
    for m in ("attn.c_attn", "attn.c_proj", "mlp.c_fc", "mlp.c_proj")
}


def gpt2() -> nn.Module:
    torch.manual_seed(0)
    config = transformers.GPT2Config(vocab_size=64, n_positions=32, n_embd=32, n_layer=LAYERS,
                                     n_head=4)  # fmt: skip
    return transformers.GPT2LMHeadModel(config)


def _projected(model: nn.Module, groups) -> set[str]:
    name = {id(p): n for n, p in model.named_parameters()}
    return {name[id(p)] for g in groups if g.get("rank") for p in g["params"]}


def test_all_linear_projects_gpt2s_conv1d_weights_and_not_embeddings_or_head():
    model = gpt2()
    assert all(is_linear(m) for n, m in model.named_modules() if isinstance(m, Conv1D))
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # nothing ≥2-D is left out but embeddings / head
        groups = galore2.param_groups(model, rank=4)
    assert _projected(model, groups) == PROJECTED


def test_the_hf_integration_projects_the_same_weights(tmp_path):
    model = gpt2()
    args = transformers.TrainingArguments(output_dir=str(tmp_path), use_cpu=True, report_to=[])
    opt = create_optimizer(model, args, rank=4)  # raised "no nn.Linear module matches" before
    assert _projected(model, opt.param_groups) == PROJECTED
    by_list = create_optimizer(model, args, rank=4, target_modules=["c_attn", "c_fc"])
    assert _projected(model, by_list.param_groups) == {
        n for n in PROJECTED if ".c_attn." in n or ".c_fc." in n
    }


class _Twin(nn.Module):
    def __init__(self, layer: nn.Module) -> None:
        super().__init__()
        self.layer = layer

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.layer(x)


@pytest.mark.parametrize(("n_in", "n_out"), [(12, 20), (20, 12)])
def test_a_conv1d_is_projected_exactly_as_its_nn_linear_twin(n_in, n_out):
    """Conv1D's in×out weight gets the transposed GaLore update of an nn.Linear holding the
    same matrix as out×in (exact SVD basis: the side rule picks the mirrored side)."""
    torch.manual_seed(0)
    conv = Conv1D(n_out, n_in)
    linear = nn.Linear(n_in, n_out)
    with torch.no_grad():
        linear.weight.copy_(conv.weight.T)
        linear.bias.copy_(conv.bias)
    models = [_Twin(conv), _Twin(copy.deepcopy(linear))]
    opts = [
        galore2.GaLoreAdamW(
            galore2.param_groups(
                m, rank=3, update_proj_gap=2, projector="svd", moments_on_refresh="project"
            ),
            lr=1e-2,
        )
        for m in models
    ]
    assert all(len(o.param_groups[0]["params"]) == 1 and o.param_groups[0]["rank"] for o in opts)
    for step in range(5):
        x = torch.randn(8, n_in, generator=torch.Generator().manual_seed(step))
        for model, opt in zip(models, opts, strict=True):
            opt.zero_grad()
            model(x).square().mean().backward()
            opt.step()
    assert (conv.weight.T - models[1].layer.weight).abs().max().item() < 1e-5
    assert (conv.weight.T - linear.weight).abs().max().item() > 1e-3  # it moved


def test_other_matrices_left_out_by_all_linear_are_named():
    model = nn.Sequential(nn.Embedding(10, 8), nn.Linear(8, 8), nn.Conv2d(2, 4, 3))
    model.register_parameter("mix", nn.Parameter(torch.zeros(8, 8)))
    with pytest.warns(UserWarning, match=r"stay full rank: \['mix', '2.weight'\]"):
        groups = galore2.param_groups(model, rank=2)
    assert _projected(model, groups) == {"1.weight"}


def test_the_planner_counts_what_it_projects_on_gpt2(tmp_path, capsys):
    """The header names the projected matrices, and the measured GaLoreAdamW state is that
    of the same model with every Conv1D swapped for an nn.Linear (same matrices, transposed)."""
    config = transformers.GPT2Config(vocab_size=512, n_positions=64, n_embd=64, n_layer=LAYERS,
                                     n_head=4)  # fmt: skip
    config.save_pretrained(tmp_path)
    report = cli.main([str(tmp_path), "--rank", "8", "--optimizers", "adamw,galore_adamw",
                       "--per-layer", "off", "--checkpointing", "off"])  # fmt: skip
    out = capsys.readouterr().out
    assert (
        f"GaLore rank 8 on every linear layer but the output head ({len(PROJECTED)} matrices)"
        in out
    )
    with torch.device("meta"):
        twin = transformers.GPT2LMHeadModel(config).to(torch.bfloat16)
    for name, module in list(twin.named_modules()):
        if isinstance(module, Conv1D):
            n_in, n_out = module.weight.shape
            parent, _, attr = name.rpartition(".")
            setattr(twin.get_submodule(parent), attr, nn.Linear(n_in, n_out, device="meta",
                                                                dtype=torch.bfloat16))  # fmt: skip
    from galore2.plan import OPTIMIZERS, nbytes, state_pieces

    linear_state = nbytes(state_pieces(OPTIMIZERS["galore_adamw"], twin, "all-linear",
                                       {"rank": 8}))  # fmt: skip
    (galore,) = [r for r in report.rows if r.optimizer == "galore_adamw"]
    (adamw,) = [r for r in report.rows if r.optimizer == "adamw"]
    assert galore.state == linear_state
    conv_params = sum(p.numel() for n, p in twin.named_parameters() if n in PROJECTED)
    assert galore.state < adamw.state * 2 - 4 * conv_params  # fp32 moments, projected shrunk


def test_the_planner_says_plainly_when_nothing_is_projected(tmp_path, capsys):
    config = transformers.GPT2Config(vocab_size=512, n_positions=64, n_embd=64, n_layer=1,
                                     n_head=4)  # fmt: skip
    config.save_pretrained(tmp_path)
    report = cli.main([str(tmp_path), "--optimizers", "galore_adamw"])
    assert report.projected == 16 // 4  # one block: four matrices
    empty = cli.Report(**{**report.__dict__, "projected": 0})
    assert "GaLore projects nothing" in empty.header()
