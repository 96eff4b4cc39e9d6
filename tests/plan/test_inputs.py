"""galore2.plan's inputs: sizes with units, the command line, CONFIG resolution, and their errors."""

from __future__ import annotations

import json
import re
import sys

import pytest

from galore2.plan import OPTIMIZERS, cli, configs
from galore2.plan.units import parse_size
from recipes import plan as recipe_plan

from ..missing_backends import assert_ok
from .conftest import SMALL, write


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("24GB", 24 * 10**9),
        ("24 GiB", 24 * 2**30),
        ("80gib", 80 * 2**30),
        ("512MB", 512 * 10**6),
        ("512MiB", 512 * 2**20),
        ("1.5TB", 15 * 10**11),
        ("2KiB", 2048),
        ("100B", 100),
        ("1e3MB", 10**9),
    ],
)
def test_sizes_parse_decimal_and_binary_units(text, expected):
    assert parse_size(text) == expected


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("24", "needs a unit"),
        ("24GX", "unknown unit 'GX'"),
        ("GB", "must be a size such as 24GB"),
        ("-1GB", "must be a size such as 24GB"),
        ("0GB", "at least 1 byte"),
        ("", "must be a size such as 24GB"),
    ],
)
def test_bad_sizes_name_the_argument_and_the_units(text, message):
    with pytest.raises(ValueError, match=message) as e:
        parse_size(text)
    assert str(e.value).startswith("--gpu-memory")
    if "unit" in message:
        assert "GiB" in str(e.value) and "MB" in str(e.value)


@pytest.mark.parametrize(
    ("args", "error", "message"),
    [
        (["--world-size", "0"], ValueError, "--world-size must be integers >= 1"),
        (["--world-size", "1,x"], ValueError, "--world-size must be integers >= 1"),
        (["--batch-size", "0"], ValueError, "--batch-size must be >= 1"),
        (["--seq-len", "-5"], ValueError, "--seq-len must be >= 1"),
        (["--rank", "0"], ValueError, "--rank must be >= 1"),
        (["--grad-accum", "0"], ValueError, "--grad-accum must be >= 1"),
        (["--gpu-memory", "24"], ValueError, "--gpu-memory '24' needs a unit"),
        (["--optimizers", "adamw,sgd"], ValueError, r"--optimizers: unknown \['sgd'\]"),
        (["--optimizers", ","], ValueError, "--optimizers: unknown empty list"),
        (["--plot", "out.jpg"], ValueError, "--plot must name a .png file"),
        (["--plot", "no/such/dir/out.png"], FileNotFoundError, "does not exist"),
    ],
)
def test_bad_arguments_fail_before_the_config_is_read(monkeypatch, args, error, message):
    def never(spec):
        raise AssertionError("CONFIG was read before the arguments were checked")

    monkeypatch.setattr(cli, "load", never)
    with pytest.raises(error, match=message):
        cli.main(["tiny", *args])


def test_world_sizes_take_commas_and_spaces():
    assert cli._world_sizes(["1,8"]) == [1, 8]
    assert cli._world_sizes(["1", "2,4", "2"]) == [1, 2, 4]


def test_argparse_choices_are_refused_with_usage(capsys):
    with pytest.raises(SystemExit) as e:
        cli.main(["tiny", "--per-layer", "maybe"])
    assert e.value.code == 2
    assert "--per-layer: invalid choice: 'maybe'" in capsys.readouterr().err


def test_run_prints_one_error_line_and_exits_2(capsys):
    with pytest.raises(SystemExit) as e:
        cli.run(["tiny", "--gpu-memory", "lots"])
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert err.startswith("error: --gpu-memory must be a size") and err.count("\n") == 1


def test_recipe_config_names_resolve_from_any_folder(monkeypatch, tmp_path):
    monkeypatch.chdir(tmp_path)  # not the checkout: the recipe finds its own configs
    source = recipe_plan.load("tiny")
    assert source.kind == "recipe" and source.label == "recipe tiny"
    assert (source.batch_size, source.seq_len, source.galore["rank"]) == (16, 128, 32)
    assert source.config.hidden_size == 128 and source.config.vocab_size == 257


@pytest.mark.parametrize(
    ("make", "error", "message"),
    [
        (lambda d: d / "nope" / "config.json", FileNotFoundError, "no such file or folder"),
        (lambda d: "llama_9000", FileNotFoundError,
         r"no such file or folder \(a recipe config name\? python -m recipes.plan llama_9000"),
        (lambda d: _file(d / "c.toml", "[model]"), ValueError,
         r"a recipe config; the recipe plans it .*: python -m recipes.plan .*c.toml"),
        (lambda d: d, FileNotFoundError, "the folder has no config.json"),
        (lambda d: _file(d / "c.yaml", "a: 1"), ValueError, "got a .yaml file"),
        (lambda d: _file(d / "c.json", "{"), ValueError, "not valid JSON"),
        (lambda d: _file(d / "c.json", "{}"), ValueError, 'needs a "model_type" key'),
        (lambda d: write(d / "x", {"model_type": "no_such_llm"}), ValueError,
         "model_type 'no_such_llm' is unknown to transformers"),
    ],
)  # fmt: skip
def test_bad_configs_say_what_is_wrong(tmp_path, make, error, message):
    with pytest.raises(error, match=message):
        cli.main([str(make(tmp_path))])


def _file(path, text):
    path.write_text(text)
    return path


def test_a_recipe_name_is_the_recipes_to_resolve(tmp_path):
    with pytest.raises(FileNotFoundError, match="no recipe config of that name"):
        recipe_plan.main(["llama_9000"])
    with pytest.raises(FileNotFoundError, match="no such file or folder"):
        configs.load("llama_7b")  # the planner knows no recipe names


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"hidden_size": -64}, r"\(LlamaConfig\) has hidden_size=-64; it must be an int >= 1"),
        ({"num_hidden_layers": 0}, r"has num_hidden_layers=0; it must be an int >= 1"),
        ({"vocab_size": -5}, r"has vocab_size=-5; it must be an int >= 1"),
        ({"intermediate_size": -1}, r"has intermediate_size=-1; it must be an int >= 1"),
        ({"hidden_size": 64.5}, "not a valid llama config: .*hidden_size"),
        ({"num_attention_heads": 5}, "not a valid llama config: .*multiple of the number of"),
        ({"vocab_size": "many"}, "not a valid llama config: .*vocab_size"),
    ],
)
def test_invalid_config_values_are_one_error_line_and_status_2(tmp_path, capsys, change, message):
    """Issue 30 item 6: a negative hidden_size (or another invalid value) printed a traceback."""
    path = write(tmp_path / "bad", {**SMALL, **change})
    with pytest.raises(SystemExit) as e:
        cli.run([str(path)])
    assert e.value.code == 2
    captured = capsys.readouterr()
    assert captured.out == "" and captured.err.count("\n") == 1
    assert captured.err.startswith("error: ") and re.search(message, captured.err), captured.err


def test_missing_transformers_is_a_clear_error(monkeypatch, small):
    monkeypatch.setitem(sys.modules, "transformers", None)  # import transformers fails
    with pytest.raises(ImportError, match=r"needs transformers.*pip install transformers"):
        cli.main([str(small)])


def test_a_config_folder_works_like_its_config_json(small, capsys):
    outs = []
    for spec in (small, small.parent):
        cli.main([str(spec), "--json"])
        outs.append(json.loads(capsys.readouterr().out))
    assert outs[0]["rows"] == outs[1]["rows"]
    assert len(outs[0]["rows"]) == len(OPTIMIZERS) * 2 * 2  # × per-layer × checkpointing


def test_the_planner_imports_without_optional_packages_and_names_what_is_missing():
    out = assert_ok("planner")  # transformers, matplotlib, bitsandbytes… missing
    assert (
        "need bitsandbytes" in out
        and "--optimizers adamw,adamw_foreach,adamw8bit,galore_adamw," in out
    )
