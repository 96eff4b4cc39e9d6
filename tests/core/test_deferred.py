"""The deferred non-finite path (``galore2.core.deferred``): on a device whose kernels take
the flags, a step reads no flag of its own — a batch's flags are read one step later — and
leaves exactly the host-indexed step's results: the same weights and state bit for bit, the
same skip counts and step counters, NaN and Inf gradients included.

The path is CUDA's; without a GPU it runs on the CPU with the kernels under Triton's
interpreter (``DEVICES`` and the fused ops' devices extended to the CPU), against the same
kernels on the host-indexed path (``DEVICES`` empty); on a CUDA machine on the GPU.
"""

from __future__ import annotations

import sys
import warnings

import pytest
import torch

if sys.platform != "linux":  # triton ships Linux wheels only
    pytest.skip("triton is only installed on Linux", allow_module_level=True)

import galore2
from galore2 import _numerics
from galore2.core import deferred
from galore2.kernels import dispatch, ops, tables
from galore2.storage import dynamic8

from ..kernels.test_triton_kernels import DEVICE

# a left and a right shape batch of three: a skipped matrix leaves two, which stay a batch
# on the host-indexed path (a lone matrix would take the per-tensor path there: the same
# products in another summation order, not the bits the grouped kernel gives it)
MATRICES = ((40, 24), (40, 24), (40, 24), (24, 56), (24, 56), (24, 56))
PLAIN = ((24,), (56,), (30, 8))
# GaLoreAdamW8bit: 8-bit moments need 4096 elements (R is 32 x 128 or 128 x 32 at rank 32),
# and the plain group's 64 x 64 tensor has them too (one galore2::adamw8bit_ launch; its
# gradient is the unusable one at step 3)
SHAPES = {
    "adamw": (galore2.GaLoreAdamW, MATRICES, PLAIN, 4),
    "adamw8bit": (galore2.GaLoreAdamW8bit, ((64, 128),) * 3 + ((128, 64),) * 3,
                  ((64, 64), (24,), (30, 8)), 32),
    # GaLoreAdamW8bit where every direction is too small for 8-bit moments: float32 ones,
    # stacked, on GaLoreAdamW's kernels
    "adamw8bit_small": (galore2.GaLoreAdamW8bit, MATRICES, PLAIN, 4),
    # the norm-growth limiter on (their default): a skipped matrix keeps its last norm
    "apollo": (galore2.APOLLO, MATRICES, PLAIN, 4),
    "fira": (galore2.Fira, MATRICES, PLAIN, 4),
}  # fmt: skip
STEPS = 9
# (step, kind, index, value): matrices and plain tensors whose gradient is unusable
BAD = {(3, "m", 1, float("nan")), (3, "p", 0, float("inf")), (6, "m", 5, float("-inf")),
       (6, "p", 2, float("nan"))}  # fmt: skip


@pytest.fixture
def kernels_on_cpu(monkeypatch):
    """galore2's fused ops (Triton, interpreted) where a CUDA step takes them."""
    monkeypatch.setenv(dispatch.ENV_VAR, "triton")
    monkeypatch.setattr(ops, "FUSED_OP_DEVICES", ("cpu", "cuda", "meta"))
    tables.clear()


@pytest.fixture(params=list(SHAPES))
def preset(request) -> str:
    """GaLoreAdamW, and GaLoreAdamW8bit (8-bit moments of every shape batch by
    galore2::adam8bit_stack_, its plain group's 8-bit tensor by galore2::adamw8bit_)."""
    return request.param


def _run(defer: bool, monkeypatch, bad=BAD, reads: list | None = None, steps: int = STEPS,
         preset: str = "adamw"):  # fmt: skip
    monkeypatch.setattr(deferred, "DEVICES", frozenset({DEVICE} if defer else ()))
    make, matrices, shapes, rank = SHAPES[preset]
    if preset == "adamw8bit":  # 8-bit moments by CUDA's path: stacks on the fused kernel
        monkeypatch.setattr(dynamic8, "use_torch", lambda t: False)
    g = torch.Generator().manual_seed(0)
    mats = [torch.nn.Parameter(torch.randn(s, generator=g).to(DEVICE, torch.bfloat16))
            for s in matrices]  # fmt: skip
    plain = [torch.nn.Parameter(torch.randn(s, generator=g).to(DEVICE, torch.bfloat16))
             for s in shapes]  # fmt: skip
    opt = make(
        [{"params": mats, "rank": rank, "update_proj_gap": 4}, {"params": plain}],
        lr=5e-2, weight_decay=0.1, foreach=True,
    )  # fmt: skip
    gg = torch.Generator().manual_seed(1)
    seen = []
    for step in range(1, steps + 1):
        for kind, ws in (("m", mats), ("p", plain)):
            for i, w in enumerate(ws):
                w.grad = torch.randn(w.shape, generator=gg).to(DEVICE, torch.bfloat16)
                for s, k, j, value in bad:
                    if (s, k, j) == (step, kind, i):
                        w.grad.view(-1)[3] = value
        if reads is not None:
            reads.append([])
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            opt.step()
        if reads is not None:  # no look at the state between steps (it settles the skips)
            continue
        seen.append(
            (
                [w.detach().clone() for w in (*mats, *plain)],
                opt.nonfinite_skips,
                {
                    (j, k): v.clone()
                    for j, w in enumerate((*mats, *plain))
                    for k, v in opt.state[w].items()
                },
            )
        )
    return seen, opt


def _bits(t: torch.Tensor) -> torch.Tensor:
    ints = {torch.bfloat16: torch.int16, torch.float32: torch.int32, torch.int64: torch.int64}
    return t.view(ints[t.dtype]) if t.dtype in ints else t


COUNTERS = ("adam.step", "galore.step", "nonfinite.skips")


def _spy_records(monkeypatch) -> list:
    records: list = []
    real = deferred.DeferredSkips.record

    def spy(self, batches):
        records.extend(len(owners) for owners, _ in batches)
        return real(self, batches)

    monkeypatch.setattr(deferred.DeferredSkips, "record", spy)
    return records


def test_a_deferred_skip_leaves_what_the_skip_leaves(kernels_on_cpu, monkeypatch, preset):
    """Step 3 has a NaN gradient in a matrix (a shape batch of three) and an Inf one in a
    plain tensor, and defers (its flags unread): those two keep their weights and state bit
    for bit; every other parameter gets the bits it gets in a run without the unusable
    gradients (the kernels step each tensor alone); the skip counts and step counters are
    the host-indexed step's. (The host-indexed step leaves the skipped matrix out of its
    shape batch, and a new batch may round the others apart by an ulp: the deferred step
    keeps the batch whole.)"""
    records = _spy_records(monkeypatch)
    later, _ = _run(True, monkeypatch, steps=3, preset=preset)
    assert len(records) == 4, records  # steps 2 and 3: both groups deferred
    clean, _ = _run(False, monkeypatch, bad=set(), steps=3, preset=preset)
    now, _ = _run(False, monkeypatch, steps=3, preset=preset)
    skipped = {1, len(SHAPES[preset][1])}  # matrix 1, plain tensor 0
    (w2, _, s2), (w3, skips, s3) = later[1], later[2]
    assert skips == now[2][1] == 2
    for j, (a, b) in enumerate(zip(w3, clean[2][0], strict=True)):
        assert torch.equal(_bits(a), _bits(w2[j] if j in skipped else b)), j
    for (j, key), a in s3.items():
        if key in COUNTERS:
            assert torch.equal(a, now[2][2][j, key]), (j, key)
        else:
            want = s2[j, key] if j in skipped else clean[2][2][j, key]
            assert torch.equal(_bits(a), _bits(want)), (j, key)


# GaLoreAdamW8bit's nine steps under the interpreter take ~30 s: -m slow (its skip above and
# its reads below run by default)
@pytest.mark.parametrize(
    "preset", ["adamw", pytest.param("adamw8bit", marks=pytest.mark.slow), "apollo", "fira"]
)
def test_deferred_steps_count_as_the_skip_path_counts(kernels_on_cpu, monkeypatch, preset):
    """Nine steps with unusable gradients at steps 3 and 6 (both shape batches, two plain
    tensors): after every step the skip count and every step counter are the host-indexed
    run's, every state tensor is finite, and the weights stay within two bf16 roundings of
    it (the runs part by an ulp at a skip, see above; a skip missed or an update applied
    twice at lr 5e-2 moves a weight by about 0.05)."""
    records = _spy_records(monkeypatch)
    later, _ = _run(True, monkeypatch, preset=preset)
    # both groups defer at every step but the first and the refreshes: 5 and 9, and 6 for
    # the matrix skipped at step 3 (its count a step behind, as the skip leaves it) — after
    # a skip too, its shape batch's members counting different steps (each with its own
    # bias corrections in the directions kernel): steps 2, 3, 4, 7 and 8
    assert len(records) == 2 * 5, records
    now, _ = _run(False, monkeypatch, preset=preset)
    assert later[-1][1] == 4  # every unusable gradient skipped, counted once
    for step, ((wa, sa, sta), (wb, sb, stb)) in enumerate(zip(later, now, strict=True), 1):
        assert sa == sb, step
        for a, b in zip(wa, wb, strict=True):
            bound = 2 * 2.0**-8 * (b.double().abs() + 2.0**-6)
            assert bool(((a.double() - b.double()).abs() <= bound).all()), step
        assert sta.keys() == stb.keys()
        for (j, key), a in sta.items():
            if key in COUNTERS:
                assert torch.equal(a, stb[j, key]), (step, j, key)
            else:
                assert bool(torch.isfinite(a).all()), (step, j, key)


def test_a_deferred_step_reads_only_the_last_steps_flags(kernels_on_cpu, monkeypatch, preset):
    """Where every batch of a step defers, its host reads (``_numerics.host_list``, the one
    read of a step) are of the flags the step before recorded — its host copies
    (:meth:`DeferredSkips.record`), one per batch — and of nothing this step computed:
    such a read waits for nothing the step queued."""
    real_record, real_read = deferred.DeferredSkips.record, _numerics.host_list
    log: list = []  # per step: ("record" | "read", tensor)

    def record(self, batches):
        before = len(self.pending)
        real_record(self, batches)
        log[-1].extend(("record", host) for _, host, _ in self.pending[before:])

    def host_list(t):
        log[-1].append(("read", t))
        return real_read(t)

    monkeypatch.setattr(deferred.DeferredSkips, "record", record)
    monkeypatch.setattr(_numerics, "host_list", host_list)
    _run(True, monkeypatch, bad=set(), reads=log, steps=4, preset=preset)
    full = [s for s in range(1, 4) if sum(e == "record" for e, _ in log[s]) == 2]
    assert len(full) == 3, [[e for e, _ in step] for step in log]  # steps 2, 3 and 4
    for s in full:
        if sum(e == "record" for e, _ in log[s - 1]) != 2:
            continue  # the step before read its own flags too
        before = [t for e, t in log[s - 1] if e == "record"]
        reads = [t for e, t in log[s] if e == "read"]
        assert len(reads) == 2 and all(any(t is r for r in before) for t in reads), s


def test_a_skip_leaves_the_other_shape_batches_bits(kernels_on_cpu, monkeypatch, preset):
    """At step 3 one matrix of the first shape batch is unusable: the host-indexed step
    leaves it out (its batch's moments then no longer one contiguous stack), the deferred
    step keeps the batch whole. The other shape batch's weights and state are the same bits
    either way: each entry of Adam's batch takes its own arithmetic, not its neighbours'
    (``ScaleByAdam._split_rounded``)."""
    later, _ = _run(True, monkeypatch, steps=3, preset=preset)
    now, _ = _run(False, monkeypatch, steps=3, preset=preset)
    n = len(SHAPES[preset][1])
    other = range(n // 2, n)  # the second shape batch (no unusable gradient at step 3)
    (wa, _, sa), (wb, _, sb) = later[2], now[2]
    for j in other:
        assert torch.equal(_bits(wa[j]), _bits(wb[j])), j
        for key in ("adam.exp_avg", "adam.exp_avg_sq"):
            if (j, key) in sa:
                assert torch.equal(_bits(sa[j, key]), _bits(sb[j, key])), (j, key)
