"""INT8 weights in the recipe: ``--model.weight_bits 8`` (issue 40)."""

from __future__ import annotations

import json
import sys
from dataclasses import replace

import pytest
import torch

import galore2
from galore2.storage.weights import QuantizedLinear
from recipes.metrics import weight_bytes
from recipes.model import build_model
from recipes.pretrain import main
from recipes.resolve import parse_args
from tests.recipes.test_build import BOUND, FAST, TINY
from tests.recipes.test_recipe import SMALL

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


def test_weight_bytes_count_codes_and_scales_against_the_dense_weights():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(32, 16), torch.nn.Linear(16, 4))
    model.to(torch.bfloat16)
    dense = 2 * (32 * 16 + 16 + 16 * 4 + 4)  # every parameter in bf16
    assert weight_bytes(model) == {"weight_bytes": dense, "dense_weight_bytes": dense}
    galore2.quantize_weights(model, group_size=8, target_modules=["0"])
    # layer 0: 16 × 32 int8 codes, 16 × 4 fp32 scales; its bias and layer 1 stay bf16
    stored = 16 * 32 + 4 * 16 * 4 + 2 * (16 + 16 * 4 + 4)
    assert weight_bytes(model) == {"weight_bytes": stored, "dense_weight_bytes": dense}


def test_recipe_summary_and_metrics_report_the_weight_bytes(tmp_path, capsys):
    main([*SMALL, "--out", str(tmp_path), "--steps", "4", "--model.weight_bits", "8",
          "--model.weight_group_size", "16"])  # fmt: skip
    summary = json.loads((tmp_path / "summary.json").read_text())
    rows = [json.loads(r) for r in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    # the same model built again: codes (1 byte) + a scale per 16 inputs of every linear
    # layer but the head, the rest dense (fp32 on the CPU)
    model = build_model(parse_args([*SMALL, "--model.weight_bits", "8",
                                    "--model.weight_group_size", "16"]).model, "meta")  # fmt: skip
    quantized = [m for m in model.modules() if isinstance(m, QuantizedLinear)]
    assert quantized
    codes = sum(m.weight_codes.numel() for m in quantized)
    saved = sum(3 * m.weight_codes.numel() for m in quantized)  # 4 fp32 bytes − 1 code byte
    scales = sum(4 * m.weight_codes.numel() // 16 for m in quantized)
    dense = 4 * sum(p.numel() for p in model.parameters())
    assert codes and summary["dense_weight_bytes"] == dense
    assert summary["weight_bytes"] == dense - saved + scales
    assert all(r["weight_bytes"] == summary["weight_bytes"] for r in rows)
    out = capsys.readouterr().out
    assert "(int8 codes + scales) vs" in out and f"({summary['weight_bytes'] / dense:.3f}×)" in out
