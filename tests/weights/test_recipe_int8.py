"""INT8 weights in the recipe: ``--model.weight_bits 8`` (issue 40)."""

from __future__ import annotations

import sys
from dataclasses import replace

import pytest
import torch

import galore2
from recipes.model import build_model
from tests.recipes.test_build import BOUND, FAST, TINY

Q8 = replace(TINY, weight_bits=8)


def test_build_quantizes_the_fp32_draws_as_quantize_weights_does():
    """The recipe quantizes on the meta device and each linear weight's fp32 draw as it is
    initialized: the same codes as building fp32 weights, then quantize_weights."""
    torch.manual_seed(0)
    built = build_model(Q8, "cpu").state_dict()
    torch.manual_seed(0)
    ref = build_model(TINY, "cpu")
    galore2.quantize_weights(ref, 8, TINY.weight_group_size)
    ref_sd = ref.state_dict()
    assert built.keys() == ref_sd.keys()
    assert any(k.endswith("weight_codes") for k in built)
    for k in built:
        assert torch.equal(built[k], ref_sd[k]), k
    torch.manual_seed(0)
    wrapped = build_model(replace(Q8, activation_checkpointing=True), "cpu").state_dict()
    for k in built:  # the seeds do not depend on the wrapping (names taken before it)
        assert torch.equal(built[k], wrapped[k]), k


def test_meta_build_is_quantized_and_keeps_head_and_embeddings():
    model = build_model(Q8, "meta").to(torch.bfloat16)
    kinds = {type(m).__name__ for m in model.modules()}
    assert "QuantizedLinear" in kinds
    assert type(model.lm_head).__name__ == "Linear"
    assert model.lm_head.weight.dtype == torch.bfloat16
    assert model.model.layers[0].mlp.up_proj.weight_scales.dtype == torch.float32


def test_fsdp_and_bad_values_are_refused_before_building():
    with pytest.raises(ValueError, match="not supported under FSDP2.*--optim.per_layer"):
        build_model(Q8, "cpu", world_size=2)
    with pytest.raises(ValueError, match="model.weight_bits / model.weight_group_size: bits"):
        build_model(replace(TINY, weight_bits=4), "meta")
    with pytest.raises(ValueError, match="weight_group_size: group_size must be"):
        build_model(replace(Q8, weight_group_size=1), "meta")


def test_build_peak_memory_stays_near_the_int8_weights():
    """Codes and scales are materialized, never the dense weights: the build grows the
    process by ≤ 1.25× the stored bytes (about half the bf16 weights)."""
    if not sys.platform.startswith("linux"):
        pytest.skip("peak RSS is read from /proc/self/status (Linux only)")
    from benchmarks.build_memory import run_child

    r = run_child(*FAST, "--dtype", "bf16", "--model.weight_bits", "8")
    assert r["weights_bytes"] < 0.55 * 2 * r["params"], r
    assert r["ratio"] <= BOUND, r
