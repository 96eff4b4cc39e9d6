"""The planner names what it cannot plan (issue 39 items 8, 12, 13): a config without its
sizes (transformers would fill in Llama-7B's), a binary config, a Hugging Face config
given to the recipe's planner, and a budget heading written as given (``fits 1.5 GB``)."""

from __future__ import annotations

import pytest

pytest.importorskip("transformers")

from galore2.plan import cli  # noqa: E402
from recipes import plan as recipe_plan  # noqa: E402

from .conftest import SMALL, write  # noqa: E402


@pytest.mark.parametrize(
    "drop, named",
    [
        (list(SMALL), "vocab_size, hidden_size/n_embd/d_model, num_hidden_layers/n_layer/"
         "num_layers, num_attention_heads/n_head/num_heads, intermediate_size/n_inner/ffn_dim"),
        (["num_hidden_layers"], "missing: num_hidden_layers/n_layer/num_layers ("),
        (["vocab_size", "intermediate_size"], "missing: vocab_size, intermediate_size/"),
    ],
    ids=["only-model-type", "layers", "vocab-and-mlp"],
)  # fmt: skip
def test_a_config_without_its_sizes_names_them(tmp_path, drop, named):
    config = {k: v for k, v in SMALL.items() if k not in drop or k == "model_type"}
    path = write(tmp_path / "c", config)
    with pytest.raises(ValueError, match="the model's sizes are missing") as e:
        cli.main([str(path)])
    assert named in str(e.value) and str(path) in str(e.value)


def test_a_multimodal_config_may_give_its_sizes_in_text_config(small):
    from galore2.plan.formulas import missing_sizes

    text = {k: v for k, v in SMALL.items() if k != "model_type"}
    assert missing_sizes({"model_type": "llava", "text_config": text}) == []


def test_a_binary_config_is_named(tmp_path, capsys):
    path = tmp_path / "config.json"
    path.write_bytes(bytes(range(128, 256)))
    with pytest.raises(SystemExit):
        cli.run([str(path)])
    err = capsys.readouterr().err
    assert err.startswith(f"error: CONFIG {str(path)!r}: not a text file"), err


def test_the_recipes_planner_sends_a_hugging_face_config_to_galore2_plan(tmp_path, small):
    for spec in (small, small.parent):
        hint = rf"a Hugging Face config.json.*python -m galore2.plan {spec}"
        with pytest.raises(ValueError, match=hint):
            recipe_plan.main([str(spec)])
    toml = tmp_path / "bad.toml"
    toml.write_bytes(bytes(range(128, 256)))
    with pytest.raises(ValueError, match=rf"CONFIG '{toml}': not a recipe config"):
        recipe_plan.main([str(toml)])


@pytest.mark.parametrize("budget, heading", [("1.5GB", "fits 1.5 GB"), ("24GB", "fits 24 GB"),
                                             ("0.75GiB", "fits 0.75 GiB")])  # fmt: skip
def test_the_budget_column_is_headed_by_the_budget_as_given(small, capsys, budget, heading):
    cli.main([str(small), "--gpu-memory", budget, "--optimizers", "adamw"])
    assert f"| {heading} |" in capsys.readouterr().out
