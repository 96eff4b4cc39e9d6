"""``Ranger21`` and ``GaLoreRanger21``: AdamW plus Ranger21's components, each a switch.

Ranger21 (Wright & Demeure 2021, arXiv 2106.13731) is AdamW with eight add-ons. Here
each is a separate module (usable in any :class:`ChainOptimizer`), and these presets
compose them. Per step, in this order:

==========================  ============================  ===============================
component (switch)          acts on                       state per element
==========================  ============================  ===============================
AGC (``use_agc``)           full gradient, per row        0
centralization (``use_gc``) full gradient, per row        0
normalization (``use_gn``)  full gradient, whole tensor   0
GaLore projection           (GaLoreRanger21 only)         basis r·min(m,n)/(m·n)
PNM (``use_pnm``)           moments: full or subspace     3 (Adam without PNM: 2)
softplus / AdamD / AMSGrad  the PNM denominator           AMSGrad: +1
8-bit moments               (``moments_8bit``) storage    ~1 byte per moment instead of 4
update ``p ← p − lr·u``     weights (+ decoupled decay)   0
norm loss                   weights, per row              0
stable weight decay         weights (σ over all params)   0
lookahead                   weights, every k steps        1 (param dtype) or 0.5 (bf16)
warmup / warmdown           the learning rate             one int64 counter per param
==========================  ============================  ===============================

Inside GaLore the gradient modules and the weight modules act in full space; the moment
module (PNM, with its softplus denominator) acts on the projected gradient, and stable
weight decay's σ² sums the low-rank second moments divided by the *full* element
count. With every switch off, ``Ranger21`` is ``torch.optim.AdamW`` (tested).

Fixed relative to the reference implementation: stable weight decay and norm loss
reach every parameter (issue #53); lookahead and schedule counters are in the state
dict, so resuming is exact (issue #18); the schedule keeps per-group learning rates;
AMSGrad stores its running max; PNM uses β₀; normalization cannot produce NaN.
``moments_8bit=True`` stores the moments (PNM's, or Adam's with ``use_pnm=False``) of
tensors with ≥ 4096 elements 8-bit blockwise, as GaLoreAdamW8bit does
(:mod:`galore2.storage.moments`). It is a constructor switch, like the PNM variants:
it fixes the moment module's state keys for the optimizer's lifetime (a per-group option
could not be changed without invalidating the state); a checkpoint resumes only into an
optimizer built with the same switch (``load_state_dict`` refuses the other, naming the
8-bit keys it misses or finds).
Decay order: stable weight decay is applied after the update (σ needs this step's
second moments of every parameter), the order galore-torch uses for projected matrices.
It replaces decoupled weight decay (:class:`~galore2.core.modules.DecoupledWeightDecay`,
which ``use_stable_weight_decay=False`` chains instead): both read ``weight_decay``.
"""

from __future__ import annotations

from typing import Any, ClassVar

from ..core.modules import DecoupledWeightDecay
from ..core.optimizer import ChainOptimizer, ParamsT
from ..core.options import Bool, Option
from ..optim.adam import ScaleByAdam
from ..optim.galore import GaLore
from ..optim.gradient import AdaptiveGradientClipping, CentralizeGradient, NormalizeGradient
from ..optim.pnm import PNM_SWITCHES, ScaleByPNM
from ..optim.schedules import SCHEDULE_SWITCHES, WarmupWarmdown
from ..optim.weights import LOOKAHEAD_DTYPE, Lookahead, NormLoss, StableWeightDecay
from ..storage.moments import MOMENTS_8BIT


def _switch(name: str, what: str) -> Option:
    return Option(name, True, Bool(), what)


#: which modules a Ranger21 chains (each on by default)
GRADIENT_SWITCHES = (
    (_switch("use_agc", "adaptive gradient clipping"), AdaptiveGradientClipping),
    (_switch("use_gc", "gradient centralization"), CentralizeGradient),
    (_switch("use_gn", "gradient normalization"), NormalizeGradient),
)
WEIGHT_SWITCHES = (
    (_switch("use_norm_loss", "norm loss"), NormLoss),
    (_switch("use_stable_weight_decay", "stable weight decay (replaces decoupled decay)"),
     StableWeightDecay),
    (_switch("use_lookahead", "lookahead"), Lookahead),
)  # fmt: skip
USE_PNM = _switch("use_pnm", "positive-negative momentum (off: Adam's moments)")


_GALORE_HINT = "GaLore options (rank, update_proj_gap, ...) need GaLoreRanger21"


class _Ranger21Base(ChainOptimizer):
    _galore = False
    option_hints: ClassVar[dict[str, str]] = {o.name: _GALORE_HINT for o in GaLore.options}
    modules = (
        *(m for _, m in GRADIENT_SWITCHES),
        ScaleByPNM,
        ScaleByAdam,
        DecoupledWeightDecay,
        *(m for _, m in WEIGHT_SWITCHES),
        WarmupWarmdown,
    )
    construct_options = (
        *(o for o, _ in GRADIENT_SWITCHES),
        USE_PNM,
        *PNM_SWITCHES,
        MOMENTS_8BIT,
        *(o for o, _ in WEIGHT_SWITCHES),
        LOOKAHEAD_DTYPE,
        *SCHEDULE_SWITCHES,
    )

    def __init__(
        self,
        params: ParamsT,
        lr: float = 1e-3,
        num_iterations: int | None = None,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        weight_decay: float = 1e-4,
        **options: Any,
    ) -> None:
        switches = {
            o.name: o.validate(options.pop(o.name, o.default)) for o in self.construct_options
        }
        #: the constructor switches this optimizer was built with
        self.switches = switches
        pnm = {o.name: switches[o.name] for o in PNM_SWITCHES}
        if not switches["use_pnm"] and any(pnm.values()):
            on = [name for name, value in pnm.items() if value]
            raise ValueError(
                f"{', '.join(on)} modify the PNM moment module: they need use_pnm=True "
                "(or switch them off)"
            )
        storage = "dynamic8" if switches["moments_8bit"] else "state_dtype"
        moments = (
            ScaleByPNM(**pnm, moments=storage)
            if switches["use_pnm"]
            else ScaleByAdam(moments=storage)
        )
        schedule = None
        if switches["use_warmup"] or switches["use_warmdown"]:
            schedule = WarmupWarmdown(
                warmup=switches["use_warmup"],
                warmdown=switches["use_warmdown"],
                **{o.name: switches[o.name] for o in SCHEDULE_SWITCHES[2:]},
            )
        defaults = {
            "lr": lr,
            "betas": betas,
            "eps": eps,
            "weight_decay": weight_decay,
            "num_iterations": num_iterations,
            **options,
        }
        super().__init__(
            params,
            [GaLore(moments)] if self._galore else [moments],
            defaults,
            grad_transforms=[m() for o, m in GRADIENT_SWITCHES if switches[o.name]],
            param_transforms=[
                Lookahead(slow_dtype=switches["lookahead_dtype"]) if m is Lookahead else m()
                for o, m in WEIGHT_SWITCHES
                if switches[o.name]
            ],
            schedule=schedule,
            # stable weight decay replaces the decoupled decay
            decay=None if switches["use_stable_weight_decay"] else DecoupledWeightDecay(),
        )


class Ranger21(_Ranger21Base):
    """Ranger21 at full rank: AdamW + AGC, centralization, normalization, PNM, softplus,
    norm loss, stable weight decay, lookahead and the warmup/warmdown schedule.

    ``lr`` is each group's peak learning rate; the built-in schedule (``use_warmup``,
    ``use_warmdown``) scales it by step, counted in the optimizer state, so an external
    LR scheduler (HF Trainer's) multiplies on top. ``num_iterations`` is the run's
    number of optimizer steps. Every component has a ``use_*`` switch; see the module
    docstring for the order and the state each costs.
    """


class GaLoreRanger21(_Ranger21Base):
    """Ranger21 with GaLore: in groups with ``rank`` set, PNM's moments live in the
    low-rank subspace; gradient and weight modules act in full space.

    Takes every :class:`Ranger21` argument plus the GaLore options of
    :class:`~galore2.GaLoreAdamW` (``rank``, ``update_proj_gap``, ``scale``,
    ``proj_type``, ``projector``, …) as defaults for groups that do not set them.
    """

    _galore = True
    option_hints: ClassVar[dict[str, str]] = {}
    modules = (GaLore, *_Ranger21Base.modules)
