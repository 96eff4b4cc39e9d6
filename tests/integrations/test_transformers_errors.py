"""Readable refusals of the Hugging Face integration (issue 39 items 12, 13):
``galore_settings`` given as a string, ``optim_args`` given as a dict, an unbalanced pair
in ``optim_args``, and ``optimizer_cls_and_kwargs(None, args)`` checking ``optim_args``
(the guide says everything is checked when the pair is made)."""

from __future__ import annotations

import pytest

transformers = pytest.importorskip("transformers")

from galore2.integrations.transformers import (  # noqa: E402
    GaLoreTrainer,
    optimizer_cls_and_kwargs,
    parse_optim_args,
)

from .hf_cases import tiny_llama, training_args  # noqa: E402


def test_galore_settings_as_a_string_is_refused_readably(tmp_path):
    with pytest.raises(TypeError, match=r"galore_settings must be a dict .* got a str: 'rank=8'"):
        GaLoreTrainer(tiny_llama(), training_args(tmp_path), galore_settings="rank=8")


def test_optim_args_as_a_dict_is_refused_readably(tmp_path):
    with pytest.raises(TypeError, match=r"optim_args must be a string .* got a dict"):
        parse_optim_args({"rank": 8})
    args = training_args(tmp_path)
    args.optim_args = {"rank": 8}
    with pytest.raises(TypeError, match=r"optim_args must be a string .* galore_settings"):
        optimizer_cls_and_kwargs(tiny_llama(), args)


@pytest.mark.parametrize("text", ["betas=(0.9,0.95", "betas=0.9,0.95)", "rank=8,betas=((0.9,0.95)"])
def test_unbalanced_parentheses_are_refused(text):
    with pytest.raises(ValueError, match=r"unbalanced parentheses"):
        parse_optim_args(text)


def test_the_pair_without_a_model_checks_optim_args(tmp_path):
    args = training_args(tmp_path)
    args.optim_args = "rank=8,lrr=0.1"
    with pytest.raises(ValueError, match=r"optim_args='rank=8,lrr=0.1': unknown setting"):
        optimizer_cls_and_kwargs(None, args)
    args.optim_args = "rank=0"
    with pytest.raises(ValueError, match=r"optim_args='rank=0'"):
        optimizer_cls_and_kwargs(None, args)
    args.optim_args = "rank=8"
    factory, kwargs = optimizer_cls_and_kwargs(None, args)
    assert kwargs["args"] is args
