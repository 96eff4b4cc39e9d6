"""The recipe on a CUDA device (bf16 parameters, MFU and peak-memory metrics). GPU only."""

from __future__ import annotations

import math

import pytest
import torch

from recipes.pretrain import main

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]


@pytest.mark.parametrize("extra", [[], ["--optim.per_layer", "true"]])
def test_tiny_recipe_on_gpu_bf16(tmp_path, extra):
    hist = main(["--config", "tiny", "--steps", "20", "--train.log_every", "10",
                 "--train.eval_every", "20", "--train.progress", "false", "--out",
                 str(tmp_path), "--model.activation_checkpointing", "true", *extra])  # fmt: skip
    last = hist[-1]
    assert last["loss"] < hist[0]["loss"] and math.isfinite(last["val_loss"])
    assert last["peak_mem_gb"] > 0 and "peak_rss_gb" not in last
    if "mfu" in last:  # known device: a plausible fraction
        assert 0 < last["mfu"] < 1
