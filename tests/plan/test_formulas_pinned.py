"""Planner formulas pinned against independent arithmetic (issue 30, behaviours no test
pinned): the activation peak with checkpointing includes the recomputed layer, and FSDP
counts the unsharded gradient and its fp32 reduce-scatter input."""

from __future__ import annotations

from galore2.plan.formulas import Footprint, Shapes, activation_bytes
from galore2.plan.state import Piece


def test_checkpointed_peak_includes_the_recomputed_layer():
    """8192 hidden, vocab 32000, 1 × 4096 tokens, bf16: the last layer's recomputed
    activations plus its backward temporaries outweigh the loss, so the peak is there."""
    d, V, f, h, L, t, a = 8192, 32000, 28672, 64, 2, 4096, 2
    shapes = Shapes(vocab_size=V, dim=d, n_layers=L, n_heads=h, ffn_dim=f)
    # by hand, each term named as autograd holds it (a: bytes per bf16 element)
    norm = 4 * t * d + 2 * a * t * d + 4 * t  # fp32 copy, normalized x, output, rsqrt
    attention = a * t * 4 * d + 4 * h * t  # q, k, v, attention output; fp32 log-sum-exp
    mlp = 4 * a * t * f  # gate, silu(gate), up, silu·up
    layer = 2 * norm + attention + mlp
    backward = a * t * (2 * d + 3 * f)
    loss = t * V * (a + 3 * 4)
    inputs = L * a * t * d  # what checkpointing keeps of each layer
    recompute = a * t * V + backward + layer
    assert recompute > loss  # this shape peaks in the recomputed layer, not at the loss
    expected = inputs + norm + recompute
    assert activation_bytes(shapes, 1, t, a, checkpointing=True) == expected
    assert activation_bytes(shapes, 1, t, a, checkpointing=False) == L * layer + norm + max(
        loss, a * t * V + backward
    )


def test_fsdp_gradients_count_the_unsharded_unit_and_its_fp32_copy():
    """bf16 parameters on 4 ranks: the sharded gradients, plus the larger unit's unsharded
    bf16 gradient and the fp32 reduce-scatter input of it (4 bytes per element)."""
    shapes = Shapes(vocab_size=64, dim=16, n_layers=2, n_heads=2, ffn_dim=32)
    root = (Piece((64, 16), 2), Piece((16,), 2), Piece((64, 16), 2))  # embed, norm, head
    layer = (Piece((16, 16), 2), Piece((32, 16), 2), Piece((16, 32), 2), Piece((16,), 2))
    fp = Footprint(shapes, 2, root + layer + layer, root, layer)
    elements = {"root": 64 * 16 * 2 + 16, "layer": 16 * 16 + 32 * 16 * 2 + 16}
    sharded = 2 * (elements["root"] + 2 * elements["layer"]) // 4  # every dim 0 splits evenly
    unit = max(elements.values())
    assert fp.gradients(world=4) == sharded + unit * 2 + unit * 4
    assert fp.gradients(world=1) == 2 * (elements["root"] + 2 * elements["layer"])
    fp32 = Footprint(shapes, 4, *(tuple(Piece(p.shape, 4) for p in x) for x in (
        root + layer + layer, root, layer)))  # fmt: skip
    assert fp32.gradients(world=4) == 2 * sharded + unit * 4  # fp32: no extra copy
