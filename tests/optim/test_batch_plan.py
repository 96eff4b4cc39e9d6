"""The batched GaLore path's cached plan and stacked bases (galore2.optim.lowrank_batch).

What a non-refresh step costs on the host does not grow with the number of matrices (host
counter reads, stacks: per shape batch, not per matrix); and whatever the cache holds is
dropped when it stops being true — a refresh (together or staggered), a basis written in
place, ``load_state_dict`` mid-window, a changed ``update_proj_gap``, interleaved per-layer
steps — so the batched path (``foreach=True``) stays the per-tensor path (``foreach=False``)
through all of them, within float32's rounding of the reordered arithmetic
(``tests.helpers.f32_bound``: 2 ulps of the weights' magnitude per step)."""

from __future__ import annotations

import functools
import warnings

import pytest
import torch

import galore2
from benchmarks.step_counts import Counts, contender_maker, count_step, tiny_model
from galore2._numerics import mix_seed
from galore2.projectors.random import RandomProjector, gaussian_basis
from recipes.model import build_model
from recipes.resolve import parse_args
from tests.helpers import assert_f32_close
from tools.batch_reference import CONFIGS, params, run

KEYS = ("galore_adamw", "galore2_fira", "galore2_apollo", "galore2_apollo_mini")


@pytest.fixture(autouse=True)
def _quiet():
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        yield


@functools.cache
def _counts(key: str, layers: int) -> Counts:
    cfg = parse_args(["--config", "tiny", "--model.n_layers", str(layers)]).model
    torch.manual_seed(0)
    return count_step(contender_maker(key, foreach=True), build_model(cfg))


@pytest.mark.parametrize("key", KEYS)
def test_host_reads_and_stacks_per_step_do_not_grow_with_the_matrices(key):
    """2 layers (14 projected matrices) vs 6 (42): a non-refresh step reads no host counter
    one by one (the packed ones are one read each), makes as many stacks (one per shape
    batch for the gradients, one for the inner results, the group's non-finite flags) and
    regenerates nothing but APOLLO's seeded bases per matrix."""
    small, large = _counts(key, 2), _counts(key, 6)
    assert small.ops is not None and large.ops is not None
    assert large.counter_reads == small.counter_reads == 0, (small.ops, large.ops)
    assert large.syncs == small.syncs <= 1
    assert large.ops["stack"] == small.ops["stack"] > 0
    assert large.ops["_local_scalar_dense"] == small.ops["_local_scalar_dense"]


@pytest.mark.parametrize("key", KEYS)
def test_stacks_per_step_one_per_shape_batch_for_gradients_and_results(key):
    """The tiny model's step: one stack of gradients and one of inner results per shape
    batch (the bases are kept), besides each group's non-finite flags and (Fira / APOLLO)
    the limiter's previous norms."""
    made: list[torch.optim.Optimizer] = []

    def make(model):
        made.append(contender_maker(key, foreach=True)(model))
        return made[-1]

    torch.manual_seed(0)
    counts = count_step(make, tiny_model())
    opt = made[0]
    batches = sum(len(plan.batches) for plan in opt._chain[0]._plans.values())
    assert batches >= 3  # q/k/v/o, gate/up, down
    assert counts.ops is not None
    limiter = 1 if key != "galore_adamw" else 0
    assert counts.ops["stack"] <= 2 * batches + len(opt.param_groups) + limiter, counts.ops


def _same(make, steps, between=None) -> None:
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        looped = run(make, False, steps, between)
        batched = run(make, True, steps, between)
    finally:
        torch.set_num_threads(threads)
    start = params()
    assert max(float((a - p).abs().max()) for a, p in zip(looped, start, strict=True)) > 1e-2
    for k, (b, l_) in enumerate(zip(batched, looped, strict=True)):
        assert_f32_close(b, l_, steps=steps, what=f"parameter {k}")


def _staggered(cls, **options):
    def make(ps, foreach):
        n = 9  # tools.batch_reference's projected matrices
        return cls([{"params": ps[:n], "rank": 8, "update_proj_gap": 3,
                     "refresh_schedule": "staggered", **options}, {"params": ps[n:]}],
                   foreach=foreach, lr=1e-2, weight_decay=0.1)  # fmt: skip

    return make


@pytest.mark.parametrize("cls", [galore2.GaLoreAdamW, galore2.Fira, galore2.APOLLO])
def test_staggered_refreshes_leave_and_rejoin_their_batch(cls):
    """Gap 3, staggered: at most steps some matrices of a batch refresh (their own path)
    while the others stay batched; the re-stacked bases (or re-read seeds) follow."""
    _same(_staggered(cls), 10)


def test_a_basis_written_in_place_is_restacked():
    """Writing a stored basis in place (not a refresh) between steps: the batch sees it."""

    def rotate(step, opt, ps):
        if step != 2:
            return
        g = torch.Generator().manual_seed(7)
        for p in ps[:4]:
            state = opt.state[p]
            key = "proj.left" if "proj.left" in state else "proj.right"
            Q = torch.linalg.qr(torch.randn(state[key].shape, generator=g)).Q
            state[key].copy_(Q)

    _same(CONFIGS["galore_adamw"], 5, rotate)
    _same(CONFIGS["fira"], 5, rotate)


def test_load_state_dict_mid_window_replaces_the_plan():
    """A checkpoint of step 3 loaded at step 7 (after a refresh at 5): the batched path
    continues from the loaded bases and counters, not from the ones it had stacked."""
    saved = {}

    def reload(step, opt, ps):
        if step == 2:
            saved["sd"] = opt.state_dict()
        if step == 6:
            opt.load_state_dict(saved.pop("sd"))

    for name in ("galore_adamw", "fira", "apollo"):
        _same(CONFIGS[name], 10, reload)


def test_a_changed_gap_moves_the_next_refresh_of_batched_matrices():
    """``update_proj_gap`` 5 → 2 after step 2 (the schedule is re-planned in place): the
    batched matrices refresh where the per-tensor ones do."""

    def shorten(step, opt, ps):
        if step == 2:
            opt.param_groups[0]["update_proj_gap"] = 2

    _same(CONFIGS["galore_adamw"], 8, shorten)


def test_per_layer_steps_between_batched_steps():
    """``step_param`` steps one matrix (its counters advance outside the batch): the next
    batched step refreshes it when it is due, as the per-tensor path does."""

    def one(step, opt, ps):
        if step in (1, 2):
            ps[0].grad = torch.ones_like(ps[0])
            opt.step_param(ps[0])

    _same(CONFIGS["galore_adamw"], 8, one)


def test_random_bases_stacked_equal_the_regenerated_ones():
    """RandomProjector.stacked draws exactly what bases() regenerates from each seed."""
    seeds = [0, 3, 2**40 + 1]
    for left, rows, rank in ((True, 12, 4), (False, 7, 1)):
        B = RandomProjector.stacked(seeds, left, rows, rank, torch.device("cpu"))
        for k, seed in enumerate(seeds):
            want = gaussian_basis(rows, rank, mix_seed(seed, 1 if left else 2), B.device)
            assert torch.equal(B[k], want)


def test_plans_are_not_pickled():
    """The plan caches this process's tensors; a pickled optimizer carries none and rebuilds."""
    import pickle

    ps = params()
    opt = CONFIGS["galore_adamw"](ps, True)
    for p in ps:
        p.grad = torch.randn(p.shape)
    opt.step()
    galore = opt._chain[0]
    assert galore._plans
    assert "_plans" not in galore.__getstate__()
    clone = pickle.loads(pickle.dumps(galore))
    assert not getattr(clone, "_plans", {})


def test_which_matrices_alone_have_their_direction_rounded():
    """``lowrank_plan.rounds_alone``: a matrix projected on its own has its inner rule write
    N in its weight's dtype only where its update rounds N so before anything else reads it
    — a local, one- or two-sided projection of a 16-bit weight by a projector with the base
    factors; not a sharded one (it all-gathers N first, in the rule's dtype), not Tucker,
    not a float32 weight, not a projector with factors of its own."""
    from types import SimpleNamespace as NS

    from galore2.optim.lowrank_plan import rounds_alone
    from galore2.projectors import LEFT, RIGHT, TUCKER, Projector, get_projector

    base = get_projector("svd")

    class OwnFactors(Projector):
        def back_factors(self, N, state, plan, dtype):  # pragma: no cover - never called
            raise AssertionError

    def case(side=LEFT, distributed=False, dtype=torch.bfloat16, projector=base):
        p = NS(side=side, plan=NS(placement=NS(distributed=distributed)), projector=projector)
        return rounds_alone(p, NS(param=torch.empty(0, dtype=dtype)))  # type: ignore[arg-type]

    assert case() and case(side=RIGHT) and case(dtype=torch.float16)
    assert type(base).back_factors is Projector.back_factors
    assert not case(distributed=True)
    assert not case(side=TUCKER)
    assert not case(dtype=torch.float32)
    assert not case(projector=OwnFactors.__new__(OwnFactors))
