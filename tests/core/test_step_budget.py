"""What a step costs an accelerator, counted on the CPU (``benchmarks/step_counts.py``):
at most one device→host synchronization per step for every galore2 optimizer, and on the
batched path a launch count within twice torch AdamW's (foreach) plus the projections.

A regression here — a ``float()`` of a gradient statistic, a per-tensor kernel where a
foreach one ran — fails CI although no GPU ever runs it.
"""

from __future__ import annotations

import warnings

import pytest
import torch

import galore2
from benchmarks.contenders import CONTENDERS
from benchmarks.step_counts import (
    big_model,
    contender_maker,
    count_step,
    counting,
    meta_reads,
    same_groups_adamw,
)

GALORE2 = [c.key for c in CONTENDERS if c.package == "galore2"]


@pytest.fixture(autouse=True)
def _quiet():
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        yield


@pytest.mark.parametrize("foreach", [None, True])
@pytest.mark.parametrize("key", GALORE2)
def test_at_most_one_sync_per_step(key, foreach):
    options = {} if foreach is None else {"foreach": foreach}
    counts = count_step(contender_maker(key, **options))
    assert counts.syncs <= 1, (key, counts)
    assert counts.launches > 0  # the counter saw the step


def test_the_counter_sees_reads_of_device_values():
    """The harness itself: a float() of a gradient statistic is a sync, a counter read is
    not, and galore2's batched read counts once."""
    opt = galore2.GaLoreAdamW([torch.nn.Parameter(torch.ones(3))])
    with counting(opt) as counts:
        float(torch.ones(2).sum())
        int(torch.tensor(3))  # a host-resident int counter
        galore2._numerics.host_list(torch.ones(4) > 0)
    assert (counts.syncs, counts.counter_reads) == (2, 1)


def _launch_budget(key: str, model_fn, **options) -> tuple[int, int]:
    """(launches other than matmuls of galore2's batched step, 2 × torch AdamW's)."""
    ours = count_step(contender_maker(key, **options), model_fn())
    ref = count_step(lambda m: same_groups_adamw(contender_maker(key)(m)), model_fn())
    return ours.launches - ours.matmuls, 2 * ref.launches


def test_batched_galore_adamw_within_twice_adamw_launches():
    from benchmarks.step_counts import tiny_model

    ours, budget = _launch_budget("galore_adamw", tiny_model, foreach=True)
    assert ours <= budget, (ours, budget)


def test_batched_galore_adamw_within_budget_at_7b_layer_shapes():
    """Meta tensors of Llama-7B's shapes: the batched path is the default off the CPU."""
    with meta_reads():
        ours, budget = _launch_budget("galore_adamw", big_model, projector="svd")
    assert ours <= budget, (ours, budget)


def test_batched_launches_do_not_grow_with_the_parameter_count():
    """Foreach kernels and per-shape batched projections (``galore2.optim.lowrank_batch``):
    doubling the layers adds no launch at all, matmuls included (one ``bmm`` per shape for
    the projections, one for the back-projections)."""
    from recipes.model import build_model
    from recipes.resolve import parse_args

    def model(layers: int):
        cfg = parse_args(["--config", "tiny", "--model.n_layers", str(layers)]).model
        torch.manual_seed(0)
        return build_model(cfg)

    small = count_step(contender_maker("galore_adamw", foreach=True), model(2))
    large = count_step(contender_maker("galore_adamw", foreach=True), model(4))
    assert large.launches == small.launches
    assert large.matmuls == small.matmuls == 6  # 3 shapes (q/k/v/o, gate/up, down) × 2


def test_batched_galore_adamw_within_issue_27_kernel_budget():
    """Issue 27's budget on the tiny model (28 projected matrices): kernels of a non-refresh
    batched step ≤ 3 × torch AdamW (foreach)'s + 3 per projected matrix, and the count this
    pipeline reached (40: foreach moments and apply, each shape batch's moments one stacked
    entry, one bmm per shape and side, one non-finite check for the three groups) holds."""
    from benchmarks.step_counts import tiny_model

    ours = count_step(contender_maker("galore_adamw", foreach=True), tiny_model())
    ref = count_step(lambda m: torch.optim.AdamW(m.parameters(), foreach=True), tiny_model())
    assert ours.launches <= 3 * ref.launches + 3 * 28, (ours.launches, ref.launches)
    assert ours.launches <= 40, ours.ops
    assert ours.matmuls == 6  # 3 shapes × (projection, back-projection)


def test_capturable_batched_step_creates_no_host_tensor_and_holds_its_kernel_count():
    """``capturable=True`` (what a CUDA graph would capture): no read of a device value, no
    tensor made from a Python scalar (``scalar_tensor``: ``torch.where(ok, x, 0.0)``), and
    within issue 27's budget on the tiny model (3 × 9 + 3 × 28 = 111): the gradients are
    masked and the state saved and restored a few kernels per group, not per tensor
    (galore2.core.masked: a stack, a flag pick and a masking per gradient shape — on the
    CPU a multiply and a nan_to_num, on CUDA one masked fill; a clone, a flag pick and a
    where per state shape, with no per-element mask), and Adam's bias corrections computed
    from its device step counters (six kernels per group: the last casts them to the
    moments' dtype), at the count reached (98: GaLore masks a shape batch's low-rank update
    before its back-projection instead of the m×n result, the gradients are masked by two
    vectorized kernels on the CPU, +1 per gradient shape, and the corrections cast, +1 per
    group; 93 on CUDA; 90 before, 93 with Adam's float32 moments masked by Adam itself,
    not saved and put back; 95 with them in the snapshot and the updates of a shape batch masked by one fill of
    their stack, where it was one foreach multiply over a 0-d mask per tensor — counted once
    here, but on CUDA a list of 0-d tensors against matrices takes foreach's per-tensor path;
    93 before that, with gradients that form a stack projected as it and Adam's device
    counters packed; 100 before that, 247 when the masking went per tensor, 102 per (device, dtype)
    with per-element masks, which cost more time). On a GPU the counters' increment and
    stack launch too (2 per group). 99 since the device step counters of a masked parameter
    are put back after its step (issue 38 item 2: a stack before the chain, a stack, a
    ``where`` and a ``_foreach_copy_`` after it, per group; on the CPU, where the counters
    are host-resident 0-d tensors, only the ``where`` counts: +1; on CUDA +4 per group)."""
    from benchmarks.step_counts import tiny_model

    c = count_step(contender_maker("galore_adamw", foreach=True, capturable=True), tiny_model())
    assert c.syncs == 0
    assert c.ops["scalar_tensor"] == 0 and c.ops["lift_fresh"] == 0, c.ops
    assert c.launches <= 3 * 9 + 3 * 28, c.ops
    assert c.launches <= 99, c.ops
