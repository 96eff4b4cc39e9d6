"""``ChainOptimizer``: the one ``torch.optim.Optimizer`` that every galore2 optimizer is.

A preset (``GaLoreAdamW``…) only chooses the chain of transforms and the
defaults; the step below is shared, never copied. Per parameter, a step is:

1. skip parameters without a gradient; refuse sparse gradients;
2. create state lazily (every key at its final shape, see :meth:`init_state`);
3. non-finite gradient → ``nonfinite="skip"`` leaves the parameter and its
   state untouched and counts it; ``"raise"`` raises before anything changes;
   ``"ignore"`` does not look (NaN propagates, as in ``torch.optim.AdamW``);
4. ``u = chain(grad)``; decoupled weight decay ``p ← p·(1 − lr·λ)``; ``p ← p − lr·u``
   (the decay-then-update order of ``torch.optim.AdamW``).

State holds tensors only, so ``state_dict()`` round-trips through
``torch.load(weights_only=True)``; :meth:`load_state_dict` keeps each state
tensor's saved dtype (torch's default would cast int counters, seeds and fp32
moments of bf16 parameters to the parameter's dtype).
"""

from __future__ import annotations

import warnings
from collections.abc import Callable, Iterable, Sequence
from functools import partial
from itertools import chain as iter_chain
from typing import Any

import torch
from torch import Tensor

from .._numerics import all_finite, finite_flags
from ..kernels.dispatch import run_kernel
from ..placement import LOCAL, Placement
from ..projectors import _BY_NAME as _PROJECTORS
from ..projectors.base import Projector
from ..projectors.tucker import TuckerProjector
from .config import GALORE_DEFAULTS, validate_group
from .modules import GradientTransform, ParamTransform, run_param_transforms
from .state import counter
from .transform import (
    Context,
    LowRankUpdate,
    NonFiniteUpdate,
    Transform,
    init_chain,
    run_chain,
    run_chain_one,
    state_kind,
)

_PROJECTOR_KINDS: dict[str, str] = {}
for _p in _PROJECTORS.values():
    _PROJECTOR_KINDS.update(type(_p).kinds)
_PROJECTOR_KINDS.update(Projector.kinds)
_PROJECTOR_KINDS.update(TuckerProjector.kinds)  # proj.mode{k}: per-mode Tucker factors

ParamsT = Iterable[Tensor] | Iterable[dict[str, Any]]


class ChainOptimizer(torch.optim.Optimizer):
    """Runs a chain of :class:`~galore2.core.transform.Transform` per parameter."""

    def __init__(
        self,
        params: ParamsT,
        chain: list[Transform],
        defaults: dict[str, Any],
        *,
        grad_transforms: Sequence[GradientTransform] = (),
        param_transforms: Sequence[ParamTransform] = (),
        lr_schedule: Callable[[dict[str, Any], int], float] | None = None,
    ) -> None:
        self._chain = list(chain)
        self._lr_schedule = lr_schedule
        self._grad_transforms = list(grad_transforms)
        self._param_transforms = list(param_transforms)
        self._owns_decay = any(t.owns_weight_decay for t in self._param_transforms)
        self._warned: set[str] = set()
        self._placements: dict[int, Placement] = {}
        self._where: tuple[int, dict[int, tuple[dict[str, Any], int]]] | None = None
        super().__init__(params, defaults)

    # ---- groups ------------------------------------------------------------------
    def add_param_group(self, param_group: dict[str, Any]) -> None:
        """Fill defaults, validate every key, then add (nothing is added if validation fails)."""
        if not isinstance(param_group, dict):
            raise TypeError(f"param_group must be a dict, got {type(param_group).__name__}")
        group = dict(param_group)
        for key, value in self.defaults.items():
            group.setdefault(key, value)
        group.update(validate_group(group))
        for module in (*self._grad_transforms, *self._chain, *self._param_transforms):
            module.validate(group)
        super().add_param_group(group)

    # ---- state -------------------------------------------------------------------
    def _warn_once(self, message: str) -> None:
        if message not in self._warned:
            self._warned.add(message)
            warnings.warn(message, stacklevel=4)

    def _placement(self, p: Tensor) -> Placement:
        """LOCAL for a plain tensor; a galore2.fsdp placement for a DTensor (imported lazily).

        Built for every parameter at once (and again after ``add_param_group``), so an
        unsupported DTensor anywhere raises before any parameter is touched.
        """
        placement = self._placements.get(id(p))
        if placement is None:
            from ..fsdp.detect import is_dtensor  # cheap: imports nothing distributed

            params = [q for _, _, q in self._indexed_params()]
            built: dict[int, Placement] = {}
            if any(is_dtensor(q) for q in params):
                from ..fsdp import assign_owners, placement_for

                for q in params:
                    built[id(q)] = placement_for(q) if is_dtensor(q) else LOCAL
                assign_owners([(q.shape, built[id(q)]) for q in params])
            else:
                built = {id(q): LOCAL for q in params}
            self._placements = built
            placement = built.get(id(p), LOCAL)
        return placement

    def _context(self, p: Tensor, index: int) -> Context:
        placement = self._placement(p)
        return Context(
            param=placement.local(p),
            index=index,
            warn_once=self._warn_once,
            placement=placement,
            shape=p.shape,
        )

    def _init_param_state(self, p: Tensor, group: dict[str, Any], index: int) -> None:
        ctx = self._context(p, index)  # validates a DTensor's placement before any state exists
        state = self.state[p]
        state["nonfinite.skips"] = counter()
        if self._lr_schedule is not None:
            state["schedule.step"] = counter()
        for hook in (*self._grad_transforms, *self._param_transforms):
            hook.init(p.shape, ctx.param, group, state, ctx)
        init_chain(self._chain, p.shape, ctx.param, group, state, ctx)

    def _indexed_params(self) -> Iterable[tuple[int, dict[str, Any], Tensor]]:
        index = 0
        for group in self.param_groups:
            for p in group["params"]:
                yield index, group, p
                index += 1

    @torch.no_grad()
    def init_state(self) -> None:
        """Create the state of every parameter now (as the first ``step()`` would).

        Useful to size state without training (works on the meta device) and
        before loading a checkpoint.
        """
        for index, group, p in self._indexed_params():
            if not self.state[p]:
                self._init_param_state(p, group, index)

    def state_bytes(self) -> dict[str, int]:
        """Bytes of optimizer state by kind: ``moments``, ``basis``, ``other`` and ``total``."""
        out = {"moments": 0, "basis": 0, "other": 0}
        for state in self.state.values():
            for key, value in state.items():
                if not isinstance(value, Tensor):
                    continue
                kind = (
                    _PROJECTOR_KINDS.get(key)
                    or self._hook_kinds.get(key)
                    or state_kind(self._chain, key)
                )
                local = value.to_local() if hasattr(value, "to_local") else value  # this rank's
                out[kind] = out.get(kind, 0) + local.numel() * local.element_size()
        out["total"] = sum(out.values())
        return out

    def refresh_stats(self) -> dict[int, dict[str, float]]:
        """Per projected parameter (by its index over all groups, as in ``state_dict``): the
        number of subspace refreshes so far, the current gap between refreshes (it varies
        with ``adaptive_refresh``) and the last measured subspace overlap (NaN if none)."""
        out: dict[int, dict[str, float]] = {}
        for index, group, p in self._indexed_params():
            state = self.state.get(p, {})
            if "galore.refreshes" not in state:
                continue
            gap = state.get("galore.gap")
            sim = state.get("galore.similarity")
            out[index] = {
                "refreshes": int(state["galore.refreshes"]),
                "gap": int(gap) if gap is not None else int(group["update_proj_gap"]),
                "similarity": float(sim) if sim is not None else float("nan"),
            }
        return out

    @property
    def _hook_kinds(self) -> dict[str, str]:
        kinds: dict[str, str] = {"schedule.step": "other"}
        for hook in (*self._grad_transforms, *self._param_transforms):
            kinds.update(hook.kinds)
        return kinds

    @property
    def nonfinite_skips(self) -> int:
        """How many per-parameter updates were skipped for non-finite gradients."""
        return sum(int(s["nonfinite.skips"]) for s in self.state.values() if "nonfinite.skips" in s)

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        super().load_state_dict(state_dict)
        for group in self.param_groups:  # GaLore keys added since the checkpoint was written
            for key in GALORE_DEFAULTS.keys() & self.defaults.keys():
                group.setdefault(key, self.defaults[key])
        saved_ids = iter_chain.from_iterable(g["params"] for g in state_dict["param_groups"])
        params = iter_chain.from_iterable(g["params"] for g in self.param_groups)
        saved_state = state_dict["state"]
        for pid, p in zip(saved_ids, params, strict=True):
            for key, value in saved_state.get(pid, {}).items():
                if isinstance(value, Tensor):
                    # int64 scalars (counters, seeds) live on the CPU; everything else,
                    # 0-d float moments of a 0-d parameter included, with the parameter
                    on_cpu = value.dim() == 0 and not value.is_floating_point()
                    device = torch.device("cpu") if on_cpu else p.device
                    self.state[p][key] = value.detach().to(device=device, copy=True)

    # ---- step --------------------------------------------------------------------
    def _check_sparse(self) -> None:
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is not None and p.grad.is_sparse:
                    raise RuntimeError(
                        "galore2 optimizers do not support sparse gradients (got one for a "
                        f"parameter of shape {tuple(p.shape)}); use torch.optim.SparseAdam for "
                        "sparse embeddings"
                    )

    def _finite_everywhere(self, params: list[Tensor], grads: list[Tensor]) -> list[bool]:
        """Finite flags; for sharded parameters, of the whole gradient (agreed by all ranks),
        so that every rank raises — or goes on — together."""
        ok = finite_flags([self._placement(p).local(g) for p, g in zip(params, grads, strict=True)])
        sharded = [i for i, p in enumerate(params) if self._placement(p).distributed]
        if sharded:
            bad = self._placement(params[sharded[0]]).any_global([not ok[i] for i in sharded])
            for i, b in zip(sharded, bad, strict=True):
                ok[i] = not b
        return ok

    def _check_raise(self) -> None:
        """``nonfinite="raise"``: look at every gradient before any parameter changes."""
        for group in self.param_groups:
            if group["nonfinite"] != "raise":
                continue
            items = list(self._indexed_params_of(group))
            ok = self._finite_everywhere([p for _, _, p in items], [g for _, g, _ in items])
            bad = [tuple(p.shape) for (_, _, p), f in zip(items, ok, strict=True) if not f]
            if bad:
                raise FloatingPointError(
                    f"non-finite gradient in parameters of shape {bad} (nonfinite='raise'); "
                    "use nonfinite='skip' to skip such updates instead"
                )

    @torch.no_grad()
    def step(self, closure: Callable[[], Any] | None = None) -> Any:
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        self._check_sparse()
        self._check_raise()
        stepped: list[tuple[dict[str, Any], dict[str, Tensor], Context]] = []
        for group in self.param_groups:
            stepped += self._step_items(group, list(self._indexed_params_of(group)))
        run_param_transforms(self._param_transforms, self._chain, stepped)
        return loss

    @torch.no_grad()
    def step_param(self, p: Tensor) -> None:
        """Update one parameter now from its ``.grad`` (per-layer updates inside backward).

        Same arithmetic as :meth:`step` restricted to ``p``; ``nonfinite="raise"`` checks
        only ``p``'s gradient. Step hooks registered on the optimizer are not run.
        """
        if p.grad is None:
            return
        needs_all = [t.name for t in self._param_transforms if t.needs_stats]
        if needs_all:
            raise ValueError(
                f"{', '.join(needs_all)} needs statistics over every parameter each step, "
                "which per-layer updates (step_param) cannot provide; use optimizer.step()"
            )
        count = sum(len(g["params"]) for g in self.param_groups)
        if self._where is None or self._where[0] != count:  # (re)build after add_param_group
            where = {id(q): (g, i) for i, g, q in self._indexed_params()}
            self._where = (count, where)
        found = self._where[1].get(id(p))
        if found is None:
            raise ValueError(f"parameter of shape {tuple(p.shape)} is not in this optimizer")
        group, index = found
        grad = p.grad
        if grad.is_sparse:
            self._check_sparse()
        if group["nonfinite"] == "raise" and not self._finite_everywhere([p], [grad])[0]:
            raise FloatingPointError(
                f"non-finite gradient in a parameter of shape {tuple(p.shape)} (nonfinite='raise')"
            )
        stepped = self._step_items(group, [(index, grad, p)])
        run_param_transforms(self._param_transforms, self._chain, stepped)

    def _step_items(
        self, group: dict[str, Any], items: list[tuple[int, Tensor, Tensor]]
    ) -> list[tuple[dict[str, Any], dict[str, Tensor], Context]]:
        """Step ``items`` of ``group``; returns (group, local state, ctx) of those updated."""
        if not items:
            return []
        if self._lr_schedule is not None:  # built-in schedule: lr = schedule(group, step count)
            for _, _, p in items:
                if not self.state[p]:
                    self._init_param_state(p, group, self._where_index(p, items))
            count = int(self.state[items[0][2]]["schedule.step"])
            group = {**group, "lr": self._lr_schedule(group, count)}
            for _, _, p in items:
                self.state[p]["schedule.step"] += 1
        given = group  # parameter modules see the group as given (with the scheduled lr)
        if self._owns_decay:  # a parameter module (stable weight decay) applies the decay
            group = {**group, "weight_decay": 0.0}
        lr = float(group["lr"])
        decay = 1.0 - lr * group["weight_decay"]
        params, states, ctxs, grads = [], [], [], []
        for index, grad, p in items:
            state = self.state[p]
            if not state:
                self._init_param_state(p, group, index)
            ctx = self._context(p, index)
            grad = ctx.placement.local(grad)
            if ctx.placement.distributed:  # transforms see local views of DTensor state
                state = {k: ctx.placement.local(v) for k, v in state.items()}
            params.append(ctx.param)
            states.append(state)
            ctxs.append(ctx)
            grads.append(-grad if group["maximize"] else grad)
        for hook in self._grad_transforms:  # full-space gradient modules, in place
            for g, state, ctx in zip(grads, states, ctxs, strict=True):
                hook.apply_(g, group, state, ctx)
        self._agree_on_nonfinite(group, states, ctxs, grads)
        self._chain[0].prepare(grads, states, group, ctxs)
        updated: list[int] = []
        for chunk in _chunks(params):
            updated += self._step_chunk(chunk, params, states, ctxs, grads, group, lr, decay)
        return [(given, states[i], ctxs[i]) for i in updated]

    @staticmethod
    def _where_index(p: Tensor, items: list[tuple[int, Tensor, Tensor]]) -> int:
        return next(index for index, _, q in items if q is p)

    def _agree_on_nonfinite(
        self,
        group: dict[str, Any],
        states: list[dict[str, Tensor]],
        ctxs: list[Context],
        grads: list[Tensor],
    ) -> None:
        """Sharded parameters: decide NaN/Inf skips from every rank's shard, in one all-reduce.

        A NaN lands only on the rank owning its row; skipping on some ranks but not on
        others would desynchronize collectives, so the decision is made together.
        """
        sharded = [i for i, c in enumerate(ctxs) if c.placement.distributed]
        if not sharded or group["nonfinite"] == "ignore":
            return
        bad = [not f for f in finite_flags([grads[i] for i in sharded])]
        bad = ctxs[sharded[0]].placement.any_global(bad)
        for i, b in zip(sharded, bad, strict=True):
            ctxs[i].finite_checked = True
            ctxs[i].skip = b

    def _step_chunk(
        self,
        chunk: list[int],
        params: list[Tensor],
        states: list[dict[str, Tensor]],
        ctxs: list[Context],
        grads: list[Tensor],
        group: dict[str, Any],
        lr: float,
        decay: float,
    ) -> list[int]:
        first = self._chain[0]
        if len(chunk) == 1:  # the CPU path: no list machinery
            i = chunk[0]
            try:
                if ctxs[i].finite_checked:
                    if ctxs[i].skip:
                        raise NonFiniteUpdate
                elif (
                    group["nonfinite"] != "ignore"
                    and not first.checks_nonfinite(states[i])
                    and not all_finite(grads[i])
                ):
                    raise NonFiniteUpdate
                u = run_chain_one(self._chain, grads[i], states[i], group, ctxs[i])
            except NonFiniteUpdate:
                states[i]["nonfinite.skips"] += 1
                return []
            apply_update(params[i], u, lr, decay)
            return [i]
        # Tensors whose first transform does not check for NaN/Inf itself: one fused check.
        unchecked = [
            i
            for i in chunk
            if group["nonfinite"] != "ignore"
            and not ctxs[i].finite_checked
            and not first.checks_nonfinite(states[i])
        ]
        flags = finite_flags([grads[i] for i in unchecked])
        bad = {i for i, ok in zip(unchecked, flags, strict=True) if not ok}
        bad |= {i for i in chunk if ctxs[i].finite_checked and ctxs[i].skip}
        live = [i for i in chunk if i not in bad]
        outs = run_chain(
            self._chain,
            [grads[i] for i in live],
            [states[i] for i in live],
            group,
            [ctxs[i] for i in live],
        )
        for i in bad:
            states[i]["nonfinite.skips"] += 1
        done = []
        for i, u in zip(live, outs, strict=True):
            if u is None:
                states[i]["nonfinite.skips"] += 1
            else:
                apply_update(params[i], u, lr, decay)
                done.append(i)
        return done

    def _indexed_params_of(self, group: dict[str, Any]) -> Iterable[tuple[int, Tensor, Tensor]]:
        offset = 0
        for g in self.param_groups:
            if g is group:
                break
            offset += len(g["params"])
        for i, p in enumerate(group["params"]):
            if p.grad is None:
                continue
            yield offset + i, p.grad, p


def _chunks(params: list[Tensor]) -> list[list[int]]:
    """How a group's tensors are batched through the chain.

    On accelerators the whole group goes at once (foreach kernels, few launches). On the
    CPU each tensor goes alone — grad → update → apply while its data is in cache, with
    one tensor's temporaries alive at a time (batching a group measured ~1.6x slower).
    """
    cpu = [i for i, p in enumerate(params) if p.device.type == "cpu"]
    rest = [i for i, p in enumerate(params) if p.device.type != "cpu"]
    return [[i] for i in cpu] + ([rest] if rest else [])


def apply_update(p: Tensor, u: Tensor | LowRankUpdate, lr: float, decay: float) -> None:
    """p ← decay·p − lr·u; a low-rank u is applied by one fused ``addmm_`` (no m×n temporary),
    or on CUDA by the Triton matmul with that epilogue (:mod:`galore2.kernels.lowrank`)."""
    if isinstance(u, LowRankUpdate):
        target = p.view(u.A.shape[0], u.B.shape[1]) if p.is_contiguous() else None
        if target is not None:
            if (
                run_kernel(
                    "lowrank",
                    target,
                    u.A,
                    u.B,
                    supported=lambda k: k.supported(target, u.A, u.B),
                    kernel=lambda k: partial(
                        k.lowrank_update, target, u.A, u.B, alpha=-lr * u.scale, beta=decay
                    ),
                )
                is not None
            ):
                return
            target.addmm_(u.A, u.B, beta=decay, alpha=-lr * u.scale)
            return
        u = u.dense()
    if decay != 1.0:
        p.mul_(decay)
    p.add_(u, alpha=-lr)
