"""The planner's int8 weights (issue 40): codes and scales as stored, plus what dequantizing
the largest weight in a forward or backward allocates (the step's working copy is the
step's own memory, measured with the step)."""

from __future__ import annotations

import torch
from torch import nn

import galore2
from galore2.core.stored import store_of
from galore2.plan.formulas import Footprint, Shapes, dequantized_bytes
from galore2.plan.step import LiveBytes, storage_bytes


def _layer(out_f: int, in_f: int, dtype: torch.dtype = torch.float32) -> nn.Linear:
    torch.manual_seed(0)
    layer = nn.Linear(in_f, out_f).to(dtype)
    galore2.quantize_weights(layer, group_size=16)
    return layer


def test_dequantized_bytes_is_the_peak_of_a_real_forward_and_backward():
    """On the CPU (a weight within one block of rows, which the meta count shares): the
    most bytes a forward and a backward allocate besides their output and gradients."""
    layer = _layer(40, 96)
    store = store_of(layer.weight)
    x = torch.randn(3, 96, requires_grad=True)
    cpu = torch.device("cpu")
    live = LiveBytes(cpu)
    held = [x, *layer.parameters(), *layer.buffers()]
    live.track(held)
    base = live.now
    with live:
        y = layer(x)
        forward = live.peak - base
        live.reset_peak()
        start = live.now
        y.sum().backward()
    expected = dequantized_bytes(store, torch.float32)
    assert expected >= 40 * 96 * (4 + 4)  # the dense weight and at least one fp32 decode
    # the decode's peak, or the dense weight beside the output in F.linear
    assert forward == max(expected, 40 * 96 * 4 + storage_bytes([y], cpu))
    # backward: the gradients (y's, x's, the weight's, the bias's) and one dequantization
    grads = storage_bytes([y, x.grad, layer.weight.grad, layer.bias.grad], cpu)
    assert expected <= live.peak - start <= expected + grads


def test_footprint_counts_codes_scales_and_one_dequantization():
    shapes = Shapes(vocab_size=64, dim=32, n_layers=2, n_heads=2, ffn_dim=48)
    layers = nn.ModuleList(nn.Sequential(nn.Linear(32, 48), nn.Linear(48, 32)) for _ in range(2))
    model = nn.Sequential(nn.Embedding(64, 32), layers).to(torch.bfloat16)
    dense = Footprint.of(model, shapes)
    galore2.quantize_weights(model, group_size=16)
    fp = Footprint.of(model, shapes)
    # per layer: 48×32 + 32×48 codes, 48×2 + 32×3 fp32 scales; biases and embedding bf16
    codes, scales = 2 * 2 * 48 * 32, 2 * 4 * (48 * 2 + 32 * 3)
    plain = 2 * (64 * 32 + 2 * (48 + 32))
    largest = store_of(layers[0][0].weight)  # 48 × 32 (both have 1536 elements: the first)
    assert fp.dequantized == dequantized_bytes(largest, torch.bfloat16) > 2 * 48 * 32
    assert fp.weights() == codes + scales + plain + fp.dequantized
    assert dense.weights() == 2 * (64 * 32 + 2 * (48 * 32 * 2 + 48 + 32))
