"""Adam's moment estimates as a transform (``ScaleByAdam``).

Acts on: whatever direction it is given — the full gradient in a plain group,
the projected r×n (or m×r) gradient inside GaLore.
State per element of the direction: 2 values in ``state_dtype`` (``exp_avg``,
``exp_avg_sq``) plus one int64 step counter on the CPU.

Moment storage (the ``moments`` constructor argument, :mod:`galore2.storage.moments`):
``"state_dtype"`` (the default) keeps both moments in the group's ``state_dtype``;
``"dynamic8"`` stores those of large directions in bitsandbytes' dynamic 8-bit blockwise
format (:mod:`galore2.storage.dynamic8`; ~1.016 bytes per element and moment for blocks of
256) — 8-bit Adam (``ScaleByAdam8bit``, ``GaLoreAdamW8bit``), whose paths (the fused Triton
kernel, the CPU's chunks and packs, the stacks) live in :mod:`galore2.optim.adam8bit`; small
directions keep ``state_dtype`` moments and match the default exactly.

The arithmetic (:mod:`galore2.optim.adam_paths`: one function per execution path, picked
by one dispatcher, :meth:`ScaleByAdam._directions`) follows ``torch.optim.AdamW``'s
single-tensor path (lerp for the
first moment, bias-corrected square root in the denominator, ``eps`` added
after the correction), so a plain group matches ``torch.optim.AdamW`` to
rounding. The returned direction is ``m̂ / (√v̂ + eps)``; the optimizer scales it
by ``-lr``.

``compile=True`` (a group option) runs that dense math — both moment updates and the
direction, per tensor (:func:`~galore2.optim.adam_paths.adam_math`) or for a whole batch
(:func:`~galore2.optim.adam_paths.adam_math_many`, ``foreach``) — through
``torch.compile(fullgraph=True, dynamic=True)``, compiled lazily once per process
(:func:`galore2.optim.compiled.compiled`). The step-dependent scalars (the folded bias
corrections) are plain Python floats, which ``dynamic=True`` traces as symbols rather than
constants: one compile per number of dimensions and dtype (per tensor; sizes 0 and 1 are
specialized, as dynamo always does) or per batch layout (foreach), not one per step; past
:data:`~galore2.optim.compiled.RECOMPILE_LIMIT` variants a function runs eagerly, with a warning
(:func:`~galore2.optim.compiled.run_compiled`). The step counter and the scalars stay
outside the graph.
Inductor may round differently (fused multiply-adds), so compiled steps match eager ones
to rounding, not bitwise; ``compile=False`` runs the eager code unchanged. Quantized
(8-bit) moments always take the eager path.
"""

from __future__ import annotations

import itertools
import math
from typing import Any, ClassVar

import torch
from torch import Tensor

from .. import _numerics
from ..core.options import Bool, Option, Optional, Pair, Real
from ..core.transform import Context, Group, State, Transform, members
from ..kernels import ops
from ..storage.dtype import STATE_DTYPE
from ..storage.moments import is_quantized
from .adam8bit import AXIS, local_on_stacks, step_batch, update_quantized
from .adam_paths import (
    adam_foreach,
    adam_fused,
    adam_math_many,
    adam_rounded,
    adam_single,
    corrections,
    fusable,
    masked_weights,
    per_entry,
    rounded_path,
    rounding,
)
from .adamw8bit_step import adamw8bit_group, fused_path
from .adamw_step import adamw_fused, mixed_path, torch_path
from .compiled import run_compiled
from .moments import MomentRule, bias_correction, moment_rule_kinds

_BETA = Real(low=0.0, high=1.0, high_open=True)
BETAS = Option(
    "betas",
    (0.9, 0.999),
    Pair(_BETA, _BETA),
    "(β₁, β₂): decay rates of the first and second moments",
)
EPS = Option(
    "eps", 1e-8, Real(low=0.0, low_open=True), "added to the denominator √v̂ for numerical stability"
)
COMPILE = Option(
    "compile",
    False,
    Bool(),
    "True: Adam's dense math (moments, m̂/(√v̂+eps)) runs through torch.compile, compiled "
    "once per process; 8-bit moments stay eager",
)

FUSED = Option(
    "fused",
    None,
    Optional(Bool(), "where the group is batched (off the CPU, or foreach=True)"),
    "groups whose step is plain AdamW (no rank; moments in the parameters' dtype): True: "
    "torch's fused AdamW kernel (torch.optim.AdamW(fused=True)'s bits) on any device; "
    "False: galore2's own Adam",
)

_CPU = torch.device("cpu")


class ScaleByAdam(MomentRule, Transform):
    """Adam's moments; ``moments`` picks their storage (``"state_dtype"`` or ``"dynamic8"``,
    see the module docstring). Its step is counted once per direction and step, by
    :meth:`~galore2.optim.moments.MomentRule.count_step` (one direction) or
    :meth:`~galore2.optim.moments.MomentRule.count_steps` (a batch), before the path that
    runs its arithmetic is chosen (:meth:`_directions`)."""

    name = "adam"
    label = "Adam"
    step_key = "adam.step"
    second_key = "adam.exp_avg_sq"
    options = (BETAS, EPS, STATE_DTYPE, COMPILE, FUSED)
    # ScaleByAdam8bit kept its moments under ``adam8.*`` before storage formats were shared
    renamed_keys: ClassVar[dict[str, str]] = {
        f"adam8.{k}": f"adam.{k}"
        for k in ("exp_avg", "exp_avg.absmax", "exp_avg_sq", "exp_avg_sq.absmax", "block_dim")
    }
    kinds: ClassVar[dict[str, str]] = moment_rule_kinds("adam", "exp_avg", "exp_avg_sq")
    axis = AXIS
    linear_keys = ("adam.exp_avg",)
    quadratic_keys = ("adam.exp_avg_sq",)
    #: kept on the parameters' device with ``capturable=True`` (see
    #: :meth:`~galore2.optim.moments.MomentRule.count_step`)
    device_counters = ("adam.step",)
    #: whether a batch's 8-bit directions step together (packs, stacks:
    #: :func:`galore2.optim.adam8bit.step_batch`) rather than one by one
    batches_8bit: ClassVar[bool] = False

    def __repr__(self) -> str:
        return f"{type(self).__name__}(moments={self.moments!r})"

    def adamw_rule(self, group: Group) -> Transform | None:
        """This rule, when its update is torch's Adam: moments kept in ``state_dtype`` (not
        8-bit), eager (not ``compile``), and ``fused`` not False."""
        if self.moments != "state_dtype" or group.get("compile") or group.get("fused") is False:
            return None
        return self

    def torch_adamw(
        self, params: list[Tensor], grads: list[Tensor], states: list[State], group: Group,
        keep: Tensor | None = None,
    ) -> bool:  # fmt: skip
        """The whole AdamW step of a group's tensors (moments, decoupled decay, the update)
        by torch's fused AdamW kernel, one launch per (device, dtype) list, bit for bit
        ``torch.optim.AdamW(fused=True)``'s, where :func:`torch_path` allows it; bf16
        weights with float32 moments (which that kernel does not take) by galore2's fused
        op where :func:`mixed_path` allows it (one launch for the group, reading and writing
        each byte once, galore2's own arithmetic to the last bit of a rounding); see
        :func:`~galore2.optim.adamw_step.adamw_fused`. False (nothing done) otherwise: the
        chain runs. The step counters (``adam.step``) count as always; the kernel reads
        the counts from one fill of float32 device scalars. ``keep``: a deferred step's
        flags, one per tensor (:meth:`defers_adamw` said yes: galore2's op takes them)."""
        # a deferred step: defers_adamw found galore2's op this step (not asked twice)
        mixed = keep is not None or not torch_path(params, grads, states, group)
        if mixed and keep is None and not mixed_path(params, grads, states, group):
            return False
        counted, _ = members(states)
        steps = self.count_steps(counted, group, _CPU)
        assert not isinstance(steps, Tensor)  # host counters: capturable takes the chain
        adamw_fused(params, grads, states, group, steps, mixed, keep)
        return True

    def defers_adamw(
        self, params: list[Tensor], grads: list[Tensor], states: list[State], group: Group
    ) -> bool:
        """Does :meth:`torch_adamw` run this step on galore2's fused op, which takes a
        deferred step's flags (:mod:`galore2.core.deferred`)? Not torch's fused AdamW (one
        found-inf flag for a whole list, not one per tensor)."""
        return not torch_path(params, grads, states, group) and mixed_path(
            params, grads, states, group
        )

    def defers_directions(
        self, states: list[State], group: Group, device: torch.device, stacked: bool
    ) -> bool:
        """Do the bf16 directions of these states' batch (GaLore's factored shape batch on
        ``device``, ``stacked``: one stacked entry) come from galore2's op, which takes a
        deferred step's flags (:func:`adam_rounded`)? Where that op runs
        (:func:`rounded_path`'s devices, the kernels on), moments kept in float32 (not
        8-bit: an 8-bit rule's directions too small for them qualify) and stacked, eager."""
        if group.get("compile") or not states or not stacked:
            return False
        if any(is_quantized(s, "adam.exp_avg") for s in states):
            return False
        if group["state_dtype"] != "float32" or group.get("capturable"):
            return False
        return device.type in ops.FUSED_OP_DEVICES and ops.triton_would_run()

    def capture_problem(self, group: Group) -> str | None:
        """Why a step of this rule cannot replay from a CUDA graph (None: it can; see
        :mod:`galore2.core.capture`): 8-bit moments quantize through host-side paths, and
        ``compile=True`` compiles inside the step."""
        problem = super().capture_problem(group)
        if problem is not None:
            return problem
        if group.get("compile"):
            return "compile=True compiles inside the step: capture without it"
        return None

    def masked_keys(self, group: Group) -> tuple[str, ...]:
        """Both moments, when they are float32 or float64 tensors and the step is eager
        (no ``compile``): a masked direction's lerp weight is 0 and its second moment's
        decay 1, so they keep their bits (a zero gradient adds 0). Not for bfloat16 moments
        (a lerp by a tensor weight rounds apart from one by a Python float there: the
        snapshot keeps those bitwise equal to the host path) nor 8-bit ones."""
        if self.moments != "state_dtype" or group.get("compile"):
            return ()
        if group["state_dtype"] not in ("float32", "float64"):
            return ()
        return (*self.linear_keys, *self.quadratic_keys)

    def _masks(self, ctxs: list[Context | None], group: Group) -> list[Tensor | None]:
        """Each direction's flag when this rule masks its moments itself (:meth:`masked_keys`),
        else None (the snapshot puts them back, and the arithmetic stays the host path's)."""
        masks = [None if c is None else c.mask for c in ctxs]
        # a masked step sets every direction's flag (none is set on other steps)
        if masks and masks[0] is not None and self.masked_keys(group):
            return masks
        return [None] * len(ctxs)

    def stacks(self, group: Group, device: torch.device) -> bool:
        """Stacked entries where :meth:`update_many` runs its foreach kernels (Adam is
        elementwise; a stack's members may count different steps): not with ``compile=True``
        or on the CPU without ``foreach``. 8-bit moments of small directions are plain
        tensors and stack; quantized ones do not (the stacking checks the tensors)."""
        return not group.get("compile") and (device.type != "cpu" or bool(group.get("foreach")))

    def complex_problem(self, group: Group) -> str | None:
        """Adam is elementwise: on a complex parameter's real view it is
        ``torch.optim.AdamW``'s complex Adam (which uses that view too)."""
        if self.moments != "state_dtype":
            return "8-bit moments are not defined for complex parameters"
        return None

    def update(self, u: Tensor, state: State, group: Group, ctx: Context) -> Tensor:
        """Update both moments with ``u`` and return ``m̂ / (√v̂ + eps)``."""
        if is_quantized(state, "adam.exp_avg"):
            return update_quantized(self, u, state, group)
        return self._directions([u], [state], group, [ctx], batched=False)[0]

    def update_many(
        self, us: list[Tensor], states: list[State], group: Group, ctxs: list[Context]
    ) -> list[Tensor]:
        """The same arithmetic as :meth:`update` for a batch (:meth:`_directions`; 8-bit
        moments: :meth:`update` per tensor, or with :attr:`batches_8bit` and host counters
        :func:`~galore2.optim.adam8bit.step_batch` first). On the CPU the batched paths run
        only when the group asks for them (``foreach=True``)."""
        if not us or (us[0].device.type == "cpu" and not group.get("foreach")):
            # torch's CPU foreach kernels are a slower per-tensor loop (measured: a step of
            # torch.optim.AdamW(foreach=True) takes ~1.5x its for-loop on 2 cores).
            return [self.update(u, s, group, c) for u, s, c in zip(us, states, ctxs, strict=True)]
        out: list[Tensor | None] = [None] * len(us)
        if self.batches_8bit and not group.get("capturable"):
            step_batch(self, us, states, group, ctxs, out)
        plain = [
            i for i, s in enumerate(states)
            if out[i] is None and not is_quantized(s, "adam.exp_avg")
        ]  # fmt: skip
        if plain:
            results = self._directions(
                [us[i] for i in plain], [states[i] for i in plain], group,
                [ctxs[i] for i in plain], batched=True,
            )  # fmt: skip
            for i, r in zip(plain, results, strict=True):
                out[i] = r
        return self.update_rest(out, us, states, group, ctxs)

    def _directions(
        self, us: list[Tensor], states: list[State], group: Group, ctxs: list[Context],
        batched: bool,
    ) -> list[Tensor]:  # fmt: skip
        """Adam's one dispatcher (moments in ``state_dtype``; 8-bit ones:
        :mod:`galore2.optim.adam8bit`): each step's path among
        :mod:`~galore2.optim.adam_paths`' — one direction (``batched=False``): the
        single-tensor :func:`adam_single` (compiled with ``compile``); a batch: compiled :func:`adam_math_many` with ``compile``, else bf16 directions by
        galore2's op (:func:`adam_rounded`, where :func:`rounded_path`), torch's fused Adam
        kernel (:func:`adam_fused`, where :func:`fusable`), else :func:`adam_foreach`; a
        masked step (``capturable``) and steps that differ take the foreach kernels."""
        beta1, beta2 = group["betas"]
        first = ctxs[0] if ctxs else None  # a deferred step's flags (Context.keep)
        keeps = ([(c.keep, c.keep_at) for c in ctxs]
                 if first is not None and first.keep is not None else None)  # fmt: skip
        if not batched and keeps is not None:  # defers_directions said batched
            raise RuntimeError("a deferred step reached Adam's one-tensor path, which has no flags")
        if not batched:
            (u,), (state,) = us, states
            t = self.count_step(state, group, u.device)
            return [adam_single(
                u, state["adam.exp_avg"], state["adam.exp_avg_sq"], t, group,
                mask=self._masks(ctxs, group)[0], compile=bool(group.get("compile")),
            )]  # fmt: skip
        if group.get("compile"):
            exp_avgs, exp_avg_sqs, us, scales, shifts, _ = self._batch(us, states, group)
            return run_compiled(adam_math_many, us, exp_avgs, exp_avg_sqs, 1 - beta1, beta2,
                                1 - beta2, scales, shifts)  # fmt: skip
        masks = self._masks(ctxs, group)
        unmasked = not masks or masks[0] is None
        given = us
        rounded = unmasked and rounded_path(us, states, rounding(ctxs))
        if unmasked and not rounded and len(us) > 1 and keeps is None:
            split = self._split_rounded(us, states, group, ctxs)
            if split is not None:
                return split
        counts: list[list[int]] | None = [] if rounded else None  # per entry: its steps
        exp_avgs, exp_avg_sqs, us, scale, shift, t = self._batch(
            us, states, group, not rounded, counts
        )
        if rounded:  # one count, or each entry's members' own (steps differ after a skip)
            return adam_rounded(given, exp_avgs, exp_avg_sqs, t if t is not None else counts,
                                beta1, beta2, group["eps"], keeps)  # fmt: skip
        if keeps is not None:  # defers_directions said the op runs: a broken promise
            raise RuntimeError("a deferred step reached Adam's foreach path, which has no flags")
        if unmasked and t is not None and fusable(exp_avgs, exp_avg_sqs, us):
            return adam_fused(us, exp_avgs, exp_avg_sqs, t, beta1, beta2, group["eps"])
        if unmasked:
            weights, decays = 1 - beta1, beta2
        else:  # a masked step: every direction has its flag
            flags: list[Tensor] = masks  # type: ignore[assignment]
            weights, decays = masked_weights(flags, exp_avgs[0].dtype, beta1, beta2)
        return adam_foreach(us, exp_avgs, exp_avg_sqs, weights, decays, 1 - beta2, scale, shift)

    def _split_rounded(
        self, us: list[Tensor], states: list[State], group: Group, ctxs: list[Context]
    ) -> list[Tensor] | None:  # fmt: skip
        """A batch of which some entries take galore2's bf16-direction op and others not (a
        host-indexed skip step's shape batch that lost a matrix: its moments no longer one
        contiguous stack) stepped as two batches, so each entry's arithmetic is its own and
        not its neighbours': the others' bits as on a step without the skip. None when
        every entry or none takes the op."""
        ok = [rounded_path([u], [s], c.rounds_to) for u, s, c in zip(us, states, ctxs, strict=True)]
        if all(ok) or not any(ok):
            return None
        out: list[Tensor | None] = [None] * len(us)
        for want in (True, False):
            idx = [i for i, k in enumerate(ok) if k is want]
            part = self._directions([us[i] for i in idx], [states[i] for i in idx], group,
                                    [ctxs[i] for i in idx], batched=True)  # fmt: skip
            for i, r in zip(idx, part, strict=True):
                out[i] = r
        return out  # type: ignore[return-value]

    def _batch(
        self, us: list[Tensor], states: list[State], group: Group, cast: bool = True,
        counts: list[list[int]] | None = None,
    ) -> tuple[list[Tensor], list[Tensor], list[Tensor], list[float], list[float], int | None]:  # fmt: skip
        """What the batched paths start from: the moments, the directions in their dtype
        (``cast=False``: as given),
        and each tensor's (scale, shift) after counting its step (steps may differ per
        tensor: reset, parameters added later); last, the step of the whole batch when it
        is one host count (the usual step), else None. ``counts`` (host counters): each
        entry's members' new counts are appended to it."""
        beta1, beta2 = group["betas"]
        exp_avgs = [s["adam.exp_avg"] for s in states]
        exp_avg_sqs = [s["adam.exp_avg_sq"] for s in states]
        if cast:
            us = [u if u.dtype == m.dtype else u.to(m.dtype)
                  for u, m in zip(us, exp_avgs, strict=True)]  # fmt: skip
        # a stacked entry's step counters are its members' (see StackedState)
        counted, starts = members(states)
        device = exp_avgs[0].device
        steps = self.count_steps(counted, group, device)
        if isinstance(steps, Tensor):  # device counters (capturable): corrections at once
            # both β's powers by one pow (float64: the int64 counts are promoted), then
            # (1 − β₁ᵗ)/√(1 − β₂ᵗ) and (1 − β₁ᵗ)·eps: five kernels for the whole batch
            betas = _numerics.constants((beta1, beta2), torch.float64, device).view(2, 1)
            bc = bias_correction(betas, steps)
            both = torch.empty_like(bc)
            torch.div(bc[0], bc[1].sqrt(), out=both[0])
            torch.mul(bc[0], group["eps"], out=both[1])
            dtype = exp_avgs[0].dtype
            if dtype in (torch.float32, torch.float64):
                # in the moments' dtype, where the host path's Python floats act (its
                # rounding of the float64 values): the same bits, and a foreach multiply by
                # float32 0-d tensors is ~2.5x faster on the CPU than by float64 ones
                both = both.to(dtype)
            scale, shift = both[0], both[1]
            if len(counted) == len(states):  # no stacked entry
                return exp_avgs, exp_avg_sqs, us, list(scale.unbind()), list(shift.unbind()), None
            return exp_avgs, exp_avg_sqs, us, *per_entry(scale, shift, starts, us), None
        if counts is not None:
            counts.extend(steps[a:b] for a, b in itertools.pairwise(starts))
        first = steps[0]
        if steps.count(first) == len(steps):  # the usual step: one count for the whole batch
            scale, shift = corrections(beta1, beta2, group["eps"], first)
            k = len(states)
            return exp_avgs, exp_avg_sqs, us, [scale] * k, [shift] * k, first
        known: dict[int, tuple[float, float]] = {}
        scales, shifts = [], []
        for t in steps:
            found = known.get(t)
            if found is None:
                found = known[t] = corrections(beta1, beta2, group["eps"], t)
            scales.append(found[0])
            shifts.append(found[1])
        if len(counted) == len(states):
            return exp_avgs, exp_avg_sqs, us, scales, shifts, None
        return exp_avgs, exp_avg_sqs, us, *per_entry(
            torch.tensor(scales, dtype=torch.float64, device=device),
            torch.tensor(shifts, dtype=torch.float64, device=device), starts, us,
        ), None  # fmt: skip

    def bias_correction(self, state: State, group: Group) -> float | Tensor:
        """√(1 − β₂ᵗ) / (1 − β₁ᵗ) after ``t`` steps (1 before the first); a float64 tensor on
        the counter's device for a device counter (``capturable=True``: no host read)."""
        beta1, beta2 = group["betas"]
        step = state["adam.step"]
        if group.get("capturable"):
            td = step.to(torch.float64)
            value = bias_correction(beta2, td).sqrt() / bias_correction(beta1, td)
            return torch.where(td > 0, value, torch.ones_like(value))
        return _host_correction(beta1, beta2, int(step))

    def bias_corrections(self, states: list[State], group: Group) -> list[float | Tensor]:
        """:meth:`bias_correction` of each of ``states`` (host counters: one read when packed)."""
        if group.get("capturable"):
            return [self.bias_correction(s, group) for s in states]
        packed = self._counters.packed(states, "adam.step")
        steps = packed.tolist() if packed is not None else [int(s["adam.step"]) for s in states]
        beta1, beta2 = group["betas"]
        known: dict[int, float] = {}
        for t in steps:
            if t not in known:
                known[t] = _host_correction(beta1, beta2, t)
        return [known[t] for t in steps]


class ScaleByAdam8bit(ScaleByAdam):
    """``ScaleByAdam(moments="dynamic8")``: Adam whose moments of large directions are stored
    8-bit blockwise (bitsandbytes' dynamic map), a batch's 8-bit directions stepped
    together (:attr:`~ScaleByAdam.batches_8bit`); constructing it without bitsandbytes
    raises ``ImportError``. Its paths: :mod:`galore2.optim.adam8bit`."""

    batches_8bit = True

    def __init__(self) -> None:
        super().__init__(moments="dynamic8")

    def __getstate__(self) -> dict[str, Any]:
        """The kept stacks are a cache of this process's tensors: a pickle carries none."""
        return {k: v for k, v in self.__dict__.items() if k != "_stacks"}

    def torch_adamw(
        self, params: list[Tensor], grads: list[Tensor], states: list[State], group: Group,
        keep: Tensor | None = None,
    ) -> bool:  # fmt: skip
        """A group whose large tensors have 8-bit moments by galore2's fused ops where
        :func:`.adamw8bit_step.fused_path` allows it (one ``adamw8bit_`` launch per such
        tensor, the others by ``adamw_``); one without by :meth:`ScaleByAdam.torch_adamw`
        where galore2's fused ops run (not on the CPU, whose 8-bit rule keeps its chain).
        ``keep``: a deferred step's flags."""
        if not any(is_quantized(s, "adam.exp_avg") for s in states):
            if not params or params[0].device.type not in ops.FUSED_OP_DEVICES:
                return False
            return super().torch_adamw(params, grads, states, group, keep)
        if keep is None and not fused_path(params, grads, states, group):
            return False
        adamw8bit_group(self, params, grads, states, group, keep)
        return True

    def defers_adamw(
        self, params: list[Tensor], grads: list[Tensor], states: list[State], group: Group
    ) -> bool:
        """Does :meth:`torch_adamw` run this step on galore2's fused ops, which take a
        deferred step's flags?"""
        if not any(is_quantized(s, "adam.exp_avg") for s in states):
            on = bool(params) and params[0].device.type in ops.FUSED_OP_DEVICES
            return on and super().defers_adamw(params, grads, states, group)
        return fused_path(params, grads, states, group)

    def adamw_rule(self, group: Group) -> Transform | None:
        """This rule, eager (not ``compile``) and ``fused`` not False: its
        :meth:`torch_adamw` takes 8-bit moments (and leaves the CPU's step to the chain)."""
        if group.get("compile") or group.get("fused") is False:
            return None
        return self

    def defers_directions(
        self, states: list[State], group: Group, device: torch.device, stacked: bool
    ) -> bool:
        """Do the directions of a GaLore shape batch's states (its matrices' own: 8-bit
        moments do not stack) come from the fused 8-bit kernel, which takes a deferred
        step's flags (:func:`~galore2.optim.adam8bit.step_batch`): every state's moments
        8-bit on the kernel's path, on ``device`` where galore2's ops run, eager? A batch
        whose directions are too small for 8-bit moments (float32 ones, stacked): as
        :meth:`ScaleByAdam.defers_directions` says."""
        if not any(is_quantized(s, "adam.exp_avg") for s in states):
            return super().defers_directions(states, group, device, stacked)
        if stacked or not states or group.get("compile") or group.get("capturable"):
            return False
        if device.type not in ops.FUSED_OP_DEVICES or not ops.triton_would_run():
            return False
        return all(is_quantized(s, "adam.exp_avg") and local_on_stacks(s) for s in states)


def _host_correction(beta1: float, beta2: float, t: int) -> float:
    """√(1 − β₂ᵗ) / (1 − β₁ᵗ) of a host count ``t`` (1 at ``t`` = 0)."""
    if t <= 0:
        return 1.0
    return math.sqrt(bias_correction(beta2, t)) / bias_correction(beta1, t)
