"""The roofline counts (``benchmarks/roofline.py``): per-layer bytes and kernels per step of
every preset, counted (never timed) on meta tensors at small widths, pinned as budgets."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from benchmarks import roofline, roofline_ops
from galore2.optim import lowrank_batch
from recipes.config import ModelConfig
from recipes.resolve import parse_args

# Small widths where every moment of interest is large enough to be quantized by the 8-bit
# preset (≥ 4096 elements: rank 16 × 256); two and four decoder layers.
SMALL = ModelConfig(vocab_size=512, dim=256, n_layers=4, n_heads=4, ffn_dim=688, max_seq_len=16)
RANK = 16

# Today's figures (main at 9e00c21 plus branch roofline), the "before" of issue 38 but for
# item 3 (its row below): budgets that may only go down. The lead tightens them as the fused paths land. Per preset:
# (bytes per added layer ÷ torch fused AdamW's, rounded to 0.1; kernels per step at 4 layers)
BUDGETS = {
    # its plain group on galore2::adamw_ (bf16 weights, fp32 moments: one launch a weight;
    # before: 1.7, 63)
    # issue 38 item 1, the non-finite check of a projected matrix on R, not a second read
    # of G (0.13x a layer off every GaLore row without a residual; before: 1.4, 1.3, 1.8,
    # 11.1, 2.0, 1.4 for GaLoreAdamW, 8-bit, Adafactor, GaLoreRanger21, Muon, bf16 state)
    # issue 38 item 4: each shape batch projected and written back along the data by one
    # grouped launch each (galore2::mm_each_ / addmm_each_; before: 1.3, 40; 1.1, 42; 1.5,
    # 111; 10.8, 150; 4.2, 109; 2.2, 98; 1.2, 97; 1.7, 97; 2.3, 126; 1.2, 34)
    "GaLoreAdamW": (0.6, 15),
    # issue 38 item 5: each shape stack's 8-bit moments by one op (before: 2.4, 705); then
    # its directions written in bf16 (no cast of N), the plain group's 8-bit tensors by one
    # galore2::adamw8bit_ each and its norms by one adamw_, the flags deferred (before:
    # 0.6, 32)
    "GaLoreAdamW8bit": (0.5, 16),
    "GaLoreAdafactor": (0.9, 89),
    "Ranger21": (17.2, 109),
    "GaLoreRanger21": (10.2, 131),
    # issue 38 item 6: along the data, no m×n tensor (the check on R, the low-rank Adam by
    # galore2::adam_directions_, the residual's channel norms by one grouped launch, never
    # made, and P·X + G ⊙ φ into each weight by one: galore2::residual_norms_each /
    # addmm_scaled_each_; before: 3.9, 70); the flags deferred (before: 1.0, 54); the
    # residual's and R's channel norms taken by the projection's launch
    # (galore2::project_norms_each: G read once; before: 1.0, 57)
    "Fira": (0.9, 51),
    # issue 38 item 6: the random bases drawn once per refresh, S = G·φ made from the bf16
    # gradient in one pass (before: 3.0, 103; 2.5, 99); then G ⊙ φ applied by one addcmul_
    # per weight, never made, and the channel norms by vector_norm off the CPU (before:
    # 2.3, 86; 1.7, 81 — 7 launches a layer more, a quarter to a third fewer bytes); then
    # along the data (no stack of the gradients), the check on R, the low-rank Adam by
    # galore2::adam_directions_, G's channel norms and G ⊙ φ by one grouped launch per
    # shape batch (galore2::channel_norms_each / scaled_add_each_; before: 1.4, 85; 1.2, 88);
    # then the flags deferred (no host read), the limiter keeping a flagged-out matrix's
    # norm by the members' positions uploaded, a gather of the flags and a where (three
    # launches more: 51, 54); then G's and R's channel norms taken by the projection's
    # launch (galore2::project_norms_each, c = 0: G read once more no longer; before: 0.9,
    # 54)
    "APOLLO": (0.8, 48),
    "APOLLOMini": (0.8, 57),
    "GaLoreMuon": (1.1, 59),
    # +12 kernels (114 -> 126 at 4 layers): a masked parameter's device step counters put
    # back after its step, a stack, a stack, a where and a _foreach_copy_ per group (issue 38
    # item 2: the masked step keeps the skip's counts)
    "GaLoreAdamW, capturable=True": (2.1, 126),
    # bf16 moments: its plain group on torch's fused AdamW kernel (issue 38 item 3; before
    # it: 48 kernels at 4 layers)
    "GaLoreAdamW, state_dtype=bfloat16": (0.6, 21),
}
#: rows with no full-size copy today (GaLoreAdamW and GaLoreMuon: their plain group's bf16
#: gradients are read by galore2::adamw_ as they are, not cast to fp32)
NO_FULL_COPY = (
    "GaLoreAdamW",
    "GaLoreMuon",
    "GaLoreAdamW, state_dtype=bfloat16",
    "GaLoreAdamW8bit",
    "APOLLO",
    "APOLLOMini",
    "Fira",  # along the data: its residual never made (before: a float32 stack of it)
)


@pytest.fixture(scope="module")
def result() -> dict:
    base = parse_args(["--config", "tiny"]).optim
    optim = dataclasses.replace(base, options={**base.options, "rank": RANK})
    # the exact-SVD projector for the warm-up's refresh (twice as fast on meta tensors; a
    # non-refresh step does not depend on the projector: APOLLO keeps its random one)
    return roofline.measure(SMALL, optim, projector="svd")


def test_every_preset_is_measured(result: dict) -> None:
    assert set(result["rows"]) == {roofline.BASELINE, *BUDGETS}


def test_fused_adamw_baseline(result: dict) -> None:
    """torch's fused AdamW: per decay group one step-counter add and one fused kernel, and its
    bytes: weights, gradients and both bf16 moments read, weights and moments written."""
    base = result["rows"][roofline.BASELINE]
    assert base["kernels"]["per_layer"] == 0
    assert base["layers"]["4"]["kernels"] == 4
    per_layer = 4 * SMALL.dim**2 + 3 * SMALL.dim * SMALL.ffn_dim + 2 * SMALL.dim
    assert base["bytes"]["per_layer"] == per_layer * 2 * (4 + 3)


@pytest.mark.parametrize("label", BUDGETS)
def test_per_layer_bytes_and_kernels(result: dict, label: str) -> None:
    row, base = result["rows"][label], result["rows"][roofline.BASELINE]
    ratio = round(row["bytes"]["per_layer"] / base["bytes"]["per_layer"], 1)
    bytes_budget, kernels_budget = BUDGETS[label]
    assert ratio <= bytes_budget, f"{label}: per-layer bytes {ratio}x fused AdamW's"
    assert row["layers"]["4"]["kernels"] <= kernels_budget


def _full_size(result: dict, label: str) -> list[str]:
    """The ``_to_copy`` launches in the 4-layer step of a tensor at least as large as the
    smallest weight matrix (a full-size weight or gradient, or a stack or flat view of some).
    A 3-D stack is measured per matrix: a stack of r-sized bases is not a full-size copy."""
    smallest = SMALL.dim * SMALL.dim
    out = []
    for key, n in result["rows"][label]["layers"]["4"]["copies"].items():
        dims = [int(d) for d in key.split()[0].split("x")]
        numel = 1
        for d in dims[-2:] if len(dims) == 3 else dims:
            numel *= d
        if numel >= smallest:
            out.append(f"{n} x _to_copy {key}")
    return out


_COPYING = pytest.mark.xfail(
    strict=True,
    reason="issue 38: the capturable step and the Ranger21s cast the plain "
    "group's bf16 embedding and head gradients to fp32 (_to_copy 512x256 bf16->fp32, twice: "
    "fp32 moments; GaLoreAdafactor and the Ranger21s flat views of several)",
)


@pytest.mark.parametrize(
    "label",
    [pytest.param(k, marks=() if k in NO_FULL_COPY else _COPYING) for k in BUDGETS],
)
def test_no_full_size_copy(result: dict, label: str) -> None:
    assert _full_size(result, label) == []


#: rows whose non-refresh step reads no flag where the kernels run (galore2.core.deferred:
#: every group's kernels take the flags); the others read them once a step
DEFERRED = {"GaLoreAdamW", "GaLoreAdamW8bit", "APOLLO", "APOLLOMini", "Fira",
            "GaLoreAdamW, capturable=True"}  # fmt: skip


@pytest.mark.parametrize("label", BUDGETS)
def test_host_reads(result: dict, label: str) -> None:
    """Issue 38 item 2: GaLoreAdamW's, GaLoreAdamW8bit's, APOLLO's, APOLLO-Mini's and
    Fira's steps (and the capturable one) make no host read on a machine where galore2's
    kernels run (meta tensors standing for CUDA): its flags are
    copied once, read at the next step; every other row reads its flags once."""
    row = result["rows"][label]
    want = 0 if label in DEFERRED else 1
    assert row["layers"]["2"]["syncs"] == row["layers"]["4"]["syncs"] == want
    if label in DEFERRED - {"GaLoreAdamW, capturable=True"}:  # one copy of the flags
        ops = row["layers"]["4"]["ops"]
        assert ops.get("copy_") == 1, ops
        # none gathered (APOLLO's and Fira's limiter gather their norms: one cat)
        assert ops.get("cat", 0) == (1 if label in ("APOLLO", "APOLLOMini", "Fira") else 0)


def test_plain_group_on_torch_fused_kernel(result: dict) -> None:
    """With moments in the weights' dtype the plain group (embeddings, head, norms; decayed
    and not) is torch's fused kernel: one launch per group, as torch's fused AdamW."""
    ops = result["rows"]["GaLoreAdamW, state_dtype=bfloat16"]["layers"]["4"]["ops"]
    assert ops.get("_fused_adamw_") == result["rows"][roofline.BASELINE]["layers"]["4"]["ops"][
        "_fused_adamw_"] == 2  # fmt: skip


@pytest.mark.parametrize("label", ["GaLoreAdamW", "GaLoreAdamW, capturable=True"])
def test_matmul_flops_are_the_projections(result: dict, label: str) -> None:
    """Each projected matrix (m × n) costs one projection and one back-projection, 2·m·n·r
    FLOPs each, whatever the path (a matmul into an ``out=`` buffer counted by its factors,
    not by the buffer), and nothing else multiplies matrices."""
    row = result["rows"][label]
    d, f = SMALL.dim, SMALL.ffn_dim
    per_layer = 2 * 2 * RANK * (4 * d * d + 3 * d * f)
    assert row["flops"]["bf16"]["per_layer"] == per_layer
    assert row["flops"]["bf16"]["fixed"] == 0
    assert set(row["flops"]) == {"bf16"}


def test_plain_group_with_fp32_moments_on_galore2_fused_op(result: dict) -> None:
    """With fp32 moments for bf16 weights (the default) the plain group is galore2::adamw_:
    one launch per parameter group (the list kernel: embeddings and head with decay, the
    norms without), whatever the depth; no cast of a gradient; the low-rank moments by
    galore2::adam_directions_, one launch per shape stack (q/k/v/o, gate/up, down)."""
    row = result["rows"]["GaLoreAdamW"]
    ops = row["layers"]["4"]["ops"]
    assert ops.get("adamw_") == 2 == row["layers"]["2"]["ops"].get("adamw_")
    assert ops.get("_fused_adamw_", 0) == 0 and ops.get("_fused_adam_", 0) == 0
    assert ops.get("adam_directions_") == 3 == row["layers"]["2"]["ops"].get("adam_directions_")


# ---- issue 38's acceptance at llama_350m widths (GaLoreAdamW; bf16 weights, rank 256) ----
LABELS_350M = ["GaLoreAdamW", "GaLoreAdamW8bit"]
PER_LAYER_8BIT = 0.764  # GaLoreAdamW8bit's bytes per added layer ÷ fused AdamW's
KERNELS_8BIT = (16, 0)  # its kernels at 4 layers, per added layer


@pytest.fixture(scope="module")
def wide() -> dict:
    """GaLoreAdamW, GaLoreAdamW8bit and torch's fused AdamW at llama_350m widths, 2 and 4
    layers (meta: a few seconds a count), as they run where the Triton kernels do: every
    shape batch along the data on the grouped kernels (each projected by one
    galore2::mm_each_, written back by one galore2::addmm_each_)."""
    assert lowrank_batch.grouped_would_run(torch.empty(0, device="meta"))
    cfg = parse_args(["--config", "llama_350m"])
    return roofline.measure(cfg.model, cfg.optim, labels=LABELS_350M, projector="svd")


def _without_grouped(mp: pytest.MonkeyPatch) -> None:
    mp.setattr(lowrank_batch, "grouped_would_run", lambda u: False)


@pytest.fixture(scope="module")
def stacked() -> dict:
    """The same counts where the grouped kernels do not run (a GPU without Triton, or
    ``GALORE2_KERNELS=torch``): every shape batch stacked (its gradients projected by one
    ``bmm``, its updates applied by foreach kernels;
    :data:`galore2.optim.lowrank_batch.MIN_ALONG_DATA_ELEMENTS`)."""
    cfg = parse_args(["--config", "llama_350m"])
    with pytest.MonkeyPatch.context() as mp:
        _without_grouped(mp)
        return roofline.measure(cfg.model, cfg.optim, labels=LABELS_350M, projector="svd")


@pytest.fixture(scope="module")
def along() -> dict:
    """Along the data without the grouped kernels (each gradient read by its own
    projection, each update written by its own ``addmm_``): the bytes of ``wide``, one
    launch per matrix each way."""
    cfg = parse_args(["--config", "llama_350m"])
    with pytest.MonkeyPatch.context() as mp:
        _without_grouped(mp)
        mp.setattr(lowrank_batch, "MIN_ALONG_DATA_ELEMENTS", 0)
        return roofline.measure(cfg.model, cfg.optim, labels=LABELS_350M, projector="svd")


def _ratios(wide: dict, label: str = "GaLoreAdamW") -> tuple[float, float]:
    row, base = wide["rows"][label], wide["rows"][roofline.BASELINE]
    return (row["bytes"]["per_layer"] / base["bytes"]["per_layer"],
            row["bytes"]["fixed"] / base["bytes"]["fixed"])  # fmt: skip


def test_350m_budgets(wide: dict) -> None:
    """The default step's figures where the Triton kernels run, budgets that may only go
    down: 0.976x per layer, 1.714x fixed, 15 kernels whatever the depth (a projection,
    a low-rank Adam and a write-back per shape batch: 9; the plain group's two adamw_, the
    check's norm and its verdict, the step counters), the stored fp32 bases read by the grouped kernels as they
    are (no stack, no cast); GaLoreAdamW8bit 0.764x, 16 kernels at 4
    layers, none per added layer. Along the data
    (``along``) has these bytes at 50 launches more at 4 layers, 336 at 24."""
    per_layer, fixed = _ratios(wide)
    row = wide["rows"]["GaLoreAdamW"]
    assert per_layer <= 0.977 and fixed <= 1.715
    assert row["layers"]["4"]["kernels"] <= 15 and row["kernels"]["per_layer"] == 0
    assert row["layers"]["4"]["ops"].get("mm_each_") == 3 == row["layers"]["4"]["ops"].get(
        "addmm_each_")  # fmt: skip
    assert "_foreach_copy_" not in row["layers"]["4"]["ops"]  # no basis cast
    per_layer8, _ = _ratios(wide, "GaLoreAdamW8bit")
    row8 = wide["rows"]["GaLoreAdamW8bit"]
    assert per_layer8 <= PER_LAYER_8BIT
    assert row8["layers"]["4"]["kernels"] <= KERNELS_8BIT[0]
    assert row8["kernels"]["per_layer"] <= KERNELS_8BIT[1]


def test_350m_stacked_budgets(stacked: dict) -> None:
    """Where the grouped kernels do not run, the stacked step: 2.235x per layer, 1.68x
    fixed, 35 kernels at 4 layers, one per added layer; GaLoreAdamW8bit 1.74x, 33, one
    per layer (46 and three before its plain group's fused ops). Per layer the gradients are stacked (2 B read, 2 written, 2 read by the bmm)
    and the dense updates written into that stack and read by one foreach add into the
    weights (2 + 2, the weight 4). On an H200 (BENCHMARKS.md, "GPU session") along the data
    by one launch per matrix took 14.95 ms against 6.59 stacked: the launches cost the
    host 8.4 ms, the 5.2 GB more of the stacked step ~1.2 ms of device time."""
    per_layer, fixed = _ratios(stacked)
    row = stacked["rows"]["GaLoreAdamW"]
    assert per_layer <= 2.24 and fixed <= 1.69
    assert row["layers"]["4"]["kernels"] <= 35 and row["kernels"]["per_layer"] <= 1
    per_layer8, _ = _ratios(stacked, "GaLoreAdamW8bit")
    row8 = stacked["rows"]["GaLoreAdamW8bit"]
    assert per_layer8 <= 1.74
    assert row8["layers"]["4"]["kernels"] <= 33 and row8["kernels"]["per_layer"] <= 1


def test_350m_acceptance_kernels_per_layer(wide: dict) -> None:
    """Issue 38: kernels per step independent of depth up to at most 2 per layer."""
    assert wide["rows"]["GaLoreAdamW"]["kernels"]["per_layer"] <= 2


@pytest.mark.parametrize("fixture", ["wide", "stacked", "along"])
def test_350m_no_full_size_copy(fixture: str, request: pytest.FixtureRequest) -> None:
    """No ``_to_copy`` of a full-size gradient or weight (stacks of r-sized R, N and bases
    only: each entry smaller than the smallest weight, 1024 x 1024)."""
    counts = request.getfixturevalue(fixture)
    smallest = 1024 * 1024
    for key in counts["rows"]["GaLoreAdamW"]["layers"]["4"]["copies"]:
        dims = [int(d) for d in key.split()[0].split("x")]
        assert dims[-1] * (dims[-2] if len(dims) > 1 else 1) < smallest, key


def test_350m_along_the_data_budgets(along: dict) -> None:
    """Along the data (before the stacked default: 1.006x per layer, 1.70x fixed, 76
    kernels at 4 layers, 0 _to_copy; 67 with the plain group's list launch). Per layer: the
    gradient read by its projection (2 B an element) and the non-finite check's read of R
    (0.5), the weight read and written by its addmm_ (4), the low-rank Adam by
    galore2::adam_directions_ (R written by the projection and read, the fp32 moments read
    and written, N written and read by the addmm_: 24 B a low-rank element, a quarter of
    the elements: 6), the bases cast to bf16 (~0.5). Fixed: galore2::adamw_ (22 B an
    element) and the non-finite check of the plain weights' gradients (2)."""
    per_layer, fixed = _ratios(along)
    row = along["rows"]["GaLoreAdamW"]
    assert per_layer <= 1.007
    assert fixed <= 1.71
    assert row["layers"]["4"]["kernels"] <= 67
    assert row["layers"]["4"]["to_copy"] == 0
    assert _ratios(along, "GaLoreAdamW8bit")[0] <= 0.8  # 0.79x


def test_350m_nonfinite_check_reads_the_projections() -> None:
    """Issue 38 item 1: on a non-refresh step the non-finite check reads each projected
    matrix's R (bf16; r x n for the left-projected q/k/v/o and gate/up, m x r for the
    right-projected down), not its gradient: per added layer exactly 2·r·(4·d + 3·f) bytes
    (a quarter of the gradients' 2·(4·d² + 3·d·f) at rank d/4), plus the gradients of the
    layer's two norm weights (plain parameters, 2·d each) in full; nothing written."""
    cfg = parse_args(["--config", "llama_350m"])
    d, f, r = cfg.model.dim, cfg.model.ffn_dim, cfg.optim.options["rank"]
    lo, hi = (roofline_ops.by_op("GaLoreAdamW", "llama_350m", n) for n in roofline.LAYERS)
    (n_lo, read_lo, written_lo, _), (n_hi, read_hi, written_hi, _) = (
        t[("_foreach_norm", "bf16")] for t in (lo, hi)
    )
    assert n_lo == n_hi == 1  # one norm over every tested tensor of the step
    span = roofline.LAYERS[1] - roofline.LAYERS[0]
    assert (read_hi - read_lo) / span == 2 * r * (4 * d + 3 * f) + 2 * 2 * d
    assert written_lo == written_hi == 0


def test_350m_low_rank_adam_is_one_launch_per_shape(
    wide: dict, stacked: dict, along: dict
) -> None:  # fmt: skip
    """The low-rank Adam runs once per shape stack (q/k/v/o, gate/up, down), never per
    matrix: stacked, torch's fused Adam on the stacks (one launch for the lists); along
    the data (grouped or not), galore2::adam_directions_ writing N in bf16 itself (no cast
    of R or N, no zeroed buffer)."""
    ops = stacked["rows"]["GaLoreAdamW"]["layers"]["4"]["ops"]
    assert ops.get("_fused_adam_") == 1 and "adam_directions_" not in ops
    for counts in (wide, along):
        ops = counts["rows"]["GaLoreAdamW"]["layers"]["4"]["ops"]
        assert ops.get("adam_directions_") == 3
        for op in ("_to_copy", "_foreach_zero_", "_fused_adam_"):
            assert ops.get(op, 0) == 0, op


def test_350m_fixed_part_is_the_fused_op_and_the_check(along: dict) -> None:
    """The depth-independent part: galore2::adamw_ reads 12 and writes 10 bytes per element
    of the plain weights (bf16 weight and gradient, fp32 moments), torch's fused AdamW reads
    8 and writes 6; the non-finite check reads each gradient once more (2). So the fixed
    bytes are 24/14 of fused AdamW's, less what the 2-to-4-layer split puts in the
    per-layer part: the gate/up bases' cast, none at 2 layers (a stack of 4 MiB is kept
    with its cast) and one per step at 4 (8 MiB: cast at each step), 12.6 MB, 1.4% of
    fused AdamW's fixed bytes."""
    _, fixed = _ratios(along)
    assert 24 / 14 - 0.02 < fixed <= 24 / 14 * (1 + 1e-3)


def test_350m_acceptance_bytes_per_layer(wide: dict) -> None:
    """Issue 38: GaLoreAdamW's bytes per added layer ≤ fused AdamW's (0.976x): the floor
    (10 B an element) plus the non-finite check's read of R (0.5), R and N between the
    grouped matmuls and the low-rank Adam (2), the fp32 bases read by both (1.1)."""
    assert _ratios(wide)[0] <= 1.0


def test_350m_acceptance_bytes_per_layer_8bit(wide: dict) -> None:
    """Issue 38: GaLoreAdamW8bit's bytes per added layer ≤ fused AdamW's (0.764x)."""
    assert _ratios(wide, "GaLoreAdamW8bit")[0] <= 1.0


def test_350m_8bit_step_on_fused_ops(wide: dict) -> None:
    """GaLoreAdamW8bit where the kernels run: the plain group's two 8-bit tensors
    (embeddings, head) by one galore2::adamw8bit_ each — gradient and weight read, weight
    written, both codes read and written: 10 B an element against fused AdamW's 14 — and
    its norms by one adamw_ (no stack of the gradients, no float32 direction, no foreach
    update); each shape stack's directions written in bf16 by its adam8bit_stack_ (no cast
    of N). Fixed part 0.862x fused AdamW's (the check's read of the plain gradients
    included), under issue 38's 1.6x; no launch per layer."""
    row = wide["rows"]["GaLoreAdamW8bit"]
    ops = row["layers"]["4"]["ops"]
    assert ops.get("adamw8bit_") == 2 and ops.get("adamw_") == 1
    assert ops.get("adam8bit_stack_") == 3
    for op in ("_foreach_add_", "_foreach_mul_", "_to_copy", "_fused_adam_"):
        assert op not in ops, op
    assert _ratios(wide, "GaLoreAdamW8bit")[1] <= 0.863
    assert row["kernels"]["per_layer"] == 0


@pytest.mark.xfail(
    strict=True,
    reason="issue 38: fp32 moments for bf16 weights in one pass "
    "(22 B an element) are 1.57x fused AdamW's 14; the non-finite check's read "
    "of each plain gradient (2 B: a whole-tensor skip must see it before "
    "galore2::adamw_ writes anything) makes it 1.68x",
)
def test_350m_acceptance_fixed_part(wide: dict) -> None:
    assert _ratios(wide)[1] <= 1.6


@pytest.mark.parametrize("label", ["APOLLO", "APOLLOMini"])
def test_random_bases_drawn_once_per_refresh(result: dict, label: str) -> None:
    """APOLLO's seeded random bases are drawn at a refresh and kept (per shape stack), not
    drawn again at every step: a non-refresh step launches no ``normal_``; and no launch
    grows with depth: each shape batch's weights take their update G ⊙ φ by one
    ``galore2::scaled_add_each_`` (never one ``addcmul_`` per weight), after one pass
    over their gradients for the norm-growth limiter's channel norms: APOLLO's with its
    projection (``galore2::project_norms_each``), APOLLO-Mini's per-tensor φ by
    ``galore2::channel_norms_each``."""
    row = result["rows"][label]
    ops = [row["layers"][n]["ops"] for n in ("2", "4")]
    assert "normal_" not in ops[1] and "addcmul_" not in ops[1]
    assert row["kernels"]["per_layer"] == 0
    shapes = 3  # q/k/v/o, gate/up, down
    assert ops[0]["scaled_add_each_"] == ops[1]["scaled_add_each_"] == shapes
    norms = "project_norms_each" if label == "APOLLO" else "channel_norms_each"
    assert ops[0][norms] == ops[1][norms] == shapes
    other = "channel_norms_each" if label == "APOLLO" else "project_norms_each"
    assert other not in ops[1]


# ---- issue 38 item 6 at llama_350m widths: Fira, APOLLO, GaLoreMuon ----
LABELS_ITEM6 = ["APOLLO", "APOLLOMini", "Fira", "GaLoreMuon"]


@pytest.fixture(scope="module")
def item6() -> dict:
    """Issue 38 item 6's presets at llama_350m widths where the Triton kernels run."""
    cfg = parse_args(["--config", "llama_350m"])
    return roofline.measure(cfg.model, cfg.optim, labels=LABELS_ITEM6, projector="svd")


@pytest.mark.parametrize("label", ["APOLLO", "APOLLOMini"])
def test_350m_acceptance_apollo(item6: dict, label: str) -> None:
    """Issue 38: APOLLO's bytes per added layer ≤ 1.3× fused AdamW's (1.0625x, 1.241x
    with G's channel norms by a second read of G; APOLLO-Mini 0.718x), no launch per
    layer. Per projected element (14 B for fused AdamW): the projection with G's and R's
    channel norms (galore2::project_norms_each, c = 0: the bf16 gradient read once, R
    written, the bases: 2.8; the limiter needs ‖φ ⊙ G‖ before anything is written), the
    check of R (0.5), the low-rank Adam (5.0), N's channel norms (0.5) and G ⊙ φ into the
    weight (6: G read, the weight read and written). APOLLO-Mini's per-tensor φ keeps the
    separate passes (G's column norms, R's norm)."""
    ratio, _ = _ratios(item6, label)
    assert ratio <= (1.07 if label == "APOLLO" else 0.72)
    assert item6["rows"][label]["kernels"]["per_layer"] == 0


def test_350m_acceptance_fira(item6: dict) -> None:
    """Issue 38: Fira along the data at 1.268x fused AdamW's bytes per added layer (≤ 1.3;
    4.85x stacked, its residual made in float32; 1.524x with the residual's norms by a
    second read of G), no launch per layer. Per projected element (14 B for fused AdamW):
    the projection with the residual's and R's channel norms (galore2::project_norms_each:
    G read once, the bases, R written: 3.1), the check of R (0.5), the low-rank Adam
    (5.0), N's channel norms (0.5), X = N − R ⊙ φ/(α·decay) (1.5) and P·X + G ⊙ φ into
    the weight (galore2::addmm_scaled_each_: G, the weight read and written, the bases, X:
    7.1)."""
    assert _ratios(item6, "Fira")[0] <= 1.27
    assert item6["rows"]["Fira"]["kernels"]["per_layer"] == 0
    assert item6["rows"]["Fira"]["kernels"]["fixed"] <= 51


@pytest.mark.xfail(
    strict=True,
    reason="issue 38 item 6: GaLoreMuon (3.35x) runs Newton–Schulz's five iterations in "
    "float32 on the r-sized stacks (~290 MB a layer: ~23 B a projected element on their "
    "own); in bf16 and fused, its floor is still about 1.4x",
)
def test_350m_acceptance_muon(item6: dict) -> None:
    assert _ratios(item6, "GaLoreMuon")[0] <= 1.3


def test_7b_matrices_alone_write_rounded_directions() -> None:
    """At Llama-7B widths no matrix batches (``lowrank_batch.MAX_MATRIX_BYTES``): each goes
    through the inner rule alone. Its update rounds N to the weights' bf16 first
    (``Projector.back_factors``), so Adam writes its direction in bf16 by
    ``galore2::adam_directions_`` (``lowrank_plan.rounds_alone``) — no float32 direction
    zeroed, written and cast: 1.06x fused AdamW's bytes per added layer (1.49x before),
    28 kernels a layer (35)."""
    cfg = parse_args(["--config", "llama_7b"])
    out = roofline.measure(cfg.model, cfg.optim, labels=["GaLoreAdamW"], projector="svd")
    row = out["rows"]["GaLoreAdamW"]
    ops = row["layers"]["4"]["ops"]
    assert "_fused_adam_" not in ops and "_foreach_zero_" not in ops, ops
    assert ops["adam_directions_"] == 4 * 7  # one per matrix
    assert _ratios(out)[0] <= 1.07
    assert row["kernels"]["per_layer"] <= 28
