"""Optimizer factory (``--optimizer NAME``) and the recipe's LR schedule.

Names and what they build:

=====================  ==========================================================
``adamw``              ``torch.optim.AdamW``: ``fused=True`` on CUDA (what users run),
                       ``foreach`` elsewhere (``optim.adamw_kernel``)
``adamw8bit``          bitsandbytes ``AdamW8bit`` (8-bit blockwise moments)
``galore_adamw``       ``galore2.GaLoreAdamW`` (low-rank fp32 moments)
``galore_adamw8bit``   ``galore2.GaLoreAdamW8bit`` (low-rank 8-bit moments)
``galore_adafactor``   ``galore2.GaLoreAdafactor`` (factored low-rank second moment;
                       explicit lr: relative_step and scale_parameter off)
``ranger21``           ``galore2.Ranger21`` (full rank)
``galore_ranger21``    ``galore2.GaLoreRanger21``
``fira``               ``galore2.Fira`` (GaLoreAdamW + Fira's residual compensation)
``apollo``             ``galore2.APOLLO`` (random projection, channel-wise gradient
                       scaling, α = 1)
``apollo_mini``        ``galore2.APOLLOMini`` (rank 1, tensor-wise scaling, α = √128)
``galore_muon``        ``galore2.GaLoreMuon`` (orthogonalized low-rank momentum)
=====================  ==========================================================

Optimizers of other packages (galore-torch, apollo-torch, fira, ...: the benchmarks'
peers, ``benchmarks/peers.py``) are built on the same split when the caller passes them
(``peers``: name → :class:`Peer`); the recipe itself names none.

Every optimizer gets the same parameter split: weight decay on ≥2-D weights only
(norm weights and biases get none), and for every galore2 optimizer with GaLore in its
chain (all but ``ranger21``) the weights of modules matching ``optim.target_modules``
are projected (GaLore's recipe: attention and MLP matrices; embeddings and the output
head stay full rank). GaLore's options (``--optim.residual fira``,
``--optim.scale_type channel``...) apply to any of them.

Every option is its galore2 declaration's: ``--optim.rank 32`` is parsed by GaLore's
``rank`` option and goes to the projected group as given (:func:`galore_settings`);
``--optim.lr``, ``--optim.weight_decay``, ``--optim.betas`` and ``--optim.eps`` by
galore2's ``lr``, ``weight_decay`` and Adam's ``betas`` / ``eps``, for every optimizer
(:data:`EVERY`, :func:`declarations`). The recipe's defaults of its own (projected rank
and no weight decay) are :data:`RECIPE_DEFAULTS`; :func:`setting` is the value in force.
A preset may fix options that define it (:func:`preset_fields`):
APOLLO's and APOLLO-Mini's α (``optim.scale``: 1 and √128, their ``preset_defaults``) and
APOLLO-Mini's rank 1 (``APOLLOMini.projected_rank``). The recipe uses those values instead
of the config file's ``optim.scale`` / ``optim.rank``, writes them into the run's
configuration (config.json, checkpoints) and prints them; setting them on the command line
is an error (:func:`recipes.resolve.resolve`, which asks once per run). Names whose
galore2 class has not been built yet fail with a clear message.

``optim.capture true`` (galore2 optimizers) runs the non-refresh steps through
:class:`galore2.CapturedStep`: one CUDA graph replayed per step, refresh steps eager. It
sets ``capturable=True`` (refusing ``capturable false``), zeroes gradients in place
(``set_to_none=False``, the graph reads the same tensors) and needs a constant learning
rate (``--optim.warmup_ratio 0 --optim.min_lr_ratio 1``): a graph holds its lr as a
constant, so under a changing schedule every step would be captured again, slower than
eager (:func:`check_capture` refuses it). Without CUDA it is accepted and every step runs
eagerly (CUDA graphs need a GPU), with a note; the optimizer is still checked by
``CapturedStep``'s constructor. One process only (not under torchrun yet). ``--optimizer adamw`` runs torch's fused kernel on CUDA
and its foreach path elsewhere (``optim.adamw_kernel`` auto / fused / foreach).
"""

from __future__ import annotations

import math
import types
from collections.abc import Callable, Mapping
from typing import Any, Protocol

import torch
from torch import nn

import galore2
from galore2.core.modules import WEIGHT_DECAY
from galore2.core.optimizer import ChainOptimizer
from galore2.core.options import Option
from galore2.core.step import LR
from galore2.core.transform import walk
from galore2.groups import DEFAULT_RANK
from galore2.optim import GaLore
from galore2.optim.adam import BETAS, EPS
from galore2.optim.schedules import NUM_ITERATIONS
from galore2.presets import PRESETS

from .config import OptimConfig


class Peer(Protocol):
    """An optimizer of another package, built as ``load()(groups, lr=, weight_decay=,
    **kwargs(cfg))`` on the recipe's split (``group_keys(cfg)``: its projected group's keys)."""

    projected: bool  # gets the projected group
    own_schedule: bool  # warms up and down itself (gets num_iterations, no LR schedule)

    def group_keys(self, cfg: OptimConfig) -> dict[str, Any]: ...

    def kwargs(self, cfg: OptimConfig) -> dict[str, Any]: ...

    def load(self) -> Callable[..., torch.optim.Optimizer]: ...


#: no peers: what the recipe's own entry points build
NO_PEERS: Mapping[str, Peer] = types.MappingProxyType({})


def _projects(cls: type) -> bool:
    """Whether the recipe projects for galore2 class ``cls``: GaLore is in its chain."""
    return GaLore in walk(cls.modules)


# name -> (galore2 class name, projected?)
_GALORE2 = {name: (cls.__name__, _projects(cls)) for name, cls in PRESETS.items()}
#: GaLore's settings every projected contender shares: a config file sets them for any
#: optimizer (those that do not project ignore them); peers read them (:func:`setting`).
#: Names only: the options are GaLore's declarations.
SHARED = ("rank", "update_proj_gap", "scale", "proj_type")
_SHARED_OPTIONS = tuple(o for o in GaLore.options if o.name in SHARED)
#: torch.optim's settings every contender takes (galore2's, torch's AdamW, bitsandbytes',
#: the peers), by galore2's declarations: ``lr``, ``weight_decay``, Adam's ``betas``, ``eps``
COMMON = (LR, WEIGHT_DECAY, BETAS, EPS)
#: the options any recipe optimizer may be given: :data:`COMMON`, GaLore's :data:`SHARED`
#: settings and the schedule length of those that warm up and down themselves (Ranger21's
#: ``num_iterations``; a peer's too; default: ``train.steps``). A config file sets them for
#: every contender; one that does not read one ignores it. An optimizer's own option of the
#: same name replaces it (GaLoreAdafactor's pair ``eps``): :func:`declarations`.
EVERY: Mapping[str, Option] = types.MappingProxyType(
    {o.name: o for o in (*COMMON, *_SHARED_OPTIONS, NUM_ITERATIONS)}
)
#: the recipe's own defaults for options, where galore2's differ; the one place the recipe
#: sets an option it was not given:
#: - ``rank``: a recipe run projects (galore2's ``rank`` defaults to None: nothing projected),
#:   at the rank galore2's integrations use when GaLore is asked for without one;
#: - ``weight_decay`` 0: GaLore's pre-training setup decays no weight, for every contender
#:   (constructed directly, the AdamW-family presets default to torch.optim.AdamW's 1e-2,
#:   Ranger21 to 1e-4).
RECIPE_DEFAULTS: Mapping[str, Any] = types.MappingProxyType(
    {"rank": DEFAULT_RANK, "weight_decay": 0.0}
)
NAMES = ("adamw", "adamw8bit", *_GALORE2)
_OWN_SCHEDULE = ("ranger21", "galore_ranger21")


def own_schedule(name: str, peers: Mapping[str, Peer] = NO_PEERS) -> bool:
    """Whether optimizer ``name`` carries its own warmup / warmdown (Ranger21's)."""
    return name in _OWN_SCHEDULE or (name in peers and peers[name].own_schedule)


def declarations(name: str) -> dict[str, Option]:
    """The options ``--optim.KEY`` may set for recipe optimizer ``name``: :data:`EVERY`,
    each replaced by ``name``'s own option of that name, and every option of a galore2
    optimizer."""
    cls = PRESETS.get(name)
    own = {} if cls is None else cls.all_options()
    return {k: own.get(k, o) for k, o in EVERY.items()} | own


def _split_decay(params: list[nn.Parameter], settings: dict[str, Any], wd: float) -> list[dict]:
    decay = [p for p in params if p.dim() >= 2]
    no_decay = [p for p in params if p.dim() < 2]
    groups = [
        {"params": decay, **settings, "weight_decay": wd},
        {"params": no_decay, **settings, "weight_decay": 0.0},
    ]
    return [g for g in groups if g["params"]]


def param_groups(
    model: nn.Module, cfg: OptimConfig, projected: bool, keys: dict[str, Any] | None = None
) -> list[dict[str, Any]]:
    """Groups for ``cfg``: the projected group (if ``projected``: the weights
    ``optim.target_modules`` selects, :func:`galore2.groups.select`, with ``keys`` —
    default :func:`galore_settings`), then decayed / undecayed plain params."""
    params, wd = [p for p in model.parameters() if p.requires_grad], setting(cfg, "weight_decay")
    if not projected:
        return _split_decay(params, {}, wd)
    keys = galore_settings(cfg) if keys is None else keys
    if keys.get("rank") is None:
        raise ValueError(f"optim.rank must be an int >= 1: {cfg.name} projects; got None")
    chosen, plain = galore2.groups.select(model, cfg.target_modules, stacklevel=3)
    if not chosen:  # the run would be labelled GaLore and project nothing
        raise ValueError(
            f"optim.target_modules={cfg.target_modules!r} selects no module of this model "
            f"with a weight to project ({cfg.name} projects the weights of the modules whose "
            "name contains an entry): e.g. --optim.target_modules attn,mlp (the default)"
        )
    projected_group = {"params": chosen, "weight_decay": wd, **keys}
    return [projected_group, *_split_decay(plain, {}, wd)]


def projects(name: str, peers: Mapping[str, Peer] = NO_PEERS) -> bool:
    """Whether recipe optimizer ``name`` gets a projected group (a galore2 optimizer with
    GaLore in its chain, or a projecting peer)."""
    if name in peers:
        return peers[name].projected
    return name in _GALORE2 and _GALORE2[name][1]


def preset_fields(name: str) -> dict[str, Any]:
    """The shared options galore2 optimizer ``name`` fixes itself, as part of its
    definition: those of its ``preset_defaults`` (APOLLO's α = 1, APOLLO-Mini's √128) and
    the rank of its ``projected_rank`` (APOLLO-Mini: 1). ``{}`` for every other name.
    :func:`recipes.resolve.resolve` asks once per run and writes them into ``options``."""
    cls = PRESETS.get(name)
    if cls is None:
        return {}
    fixed = {k: v for k, v in cls.preset_defaults.items() if k in SHARED}
    rank = getattr(cls, "projected_rank", None)
    if rank is not None:
        fixed["rank"] = rank
    return fixed


def galore_settings(cfg: OptimConfig) -> dict[str, Any]:
    """The projected group's GaLore options as the recipe passes them: ``optim.options``'
    GaLore options (parsed, preset-fixed ones included: :func:`recipes.resolve.resolve`)
    over :data:`RECIPE_DEFAULTS`'."""
    names = {o.name for o in GaLore.options}
    return {k: v for k, v in {**RECIPE_DEFAULTS, **cfg.options}.items() if k in names}


def setting(cfg: OptimConfig, key: str) -> Any:
    """The value in force of option ``key`` for ``cfg``: given (``optim.options``, parsed),
    else the recipe's default (:data:`RECIPE_DEFAULTS`), else the declared default of
    ``cfg.name``'s optimizer (:func:`declarations`: :data:`EVERY`'s for any other)."""
    if key in cfg.options:
        return cfg.options[key]
    if key in RECIPE_DEFAULTS:
        return RECIPE_DEFAULTS[key]
    return declarations(cfg.name)[key].default


def galore2_options(cfg: OptimConfig) -> dict[str, tuple[Any, bool]]:
    """Option name → (the value the recipe gives galore2 optimizer ``cfg.name``, whether a run
    may change it on resume: its declaration's ``resumable``); ``{}`` for other optimizers.
    Unset options count at the values in force (:func:`setting`). ``cfg.options`` are parsed
    (:func:`recipes.resolve.parse_options`)."""
    cls = PRESETS.get(cfg.name)
    if cls is None:
        return {}
    return {name: (setting(cfg, name), o.resumable) for name, o in cls.all_options().items()}


def _galore_only(cls: type) -> set[str]:
    """GaLore's options that no other module of ``cls`` reads (they go on projected groups
    only); a shared one (``seed``, also lookahead's) goes to every group."""
    others = ChainOptimizer.declared_options([m for m in walk(cls.modules) if m is not GaLore])
    return {o.name for o in GaLore.options} - set(others)


ADAMW_KERNELS = ("auto", "fused", "foreach")


def check_kernel_and_capture(cfg: OptimConfig) -> None:
    """``ValueError`` for ``optim.adamw_kernel`` / ``optim.capture`` values the optimizer
    cannot use (before anything is built); with ``capture`` sets ``capturable=True``."""
    if cfg.adamw_kernel not in ADAMW_KERNELS:
        raise ValueError(
            f"optim.adamw_kernel must be one of {', '.join(ADAMW_KERNELS)}; "
            f"got {cfg.adamw_kernel!r}"
        )
    if cfg.adamw_kernel != "auto" and cfg.name != "adamw":
        raise ValueError(
            f"optim.adamw_kernel={cfg.adamw_kernel} applies to --optimizer adamw only "
            f"(torch's AdamW); got optimizer {cfg.name!r}"
        )
    if not cfg.capture:
        return
    if cfg.name not in PRESETS:
        raise ValueError(
            f"optim.capture replays galore2's capturable step (galore2.CapturedStep): it "
            f"needs a galore2 optimizer ({', '.join(PRESETS)}); got {cfg.name!r}"
        )
    if cfg.options.get("capturable") is False:
        raise ValueError("optim.capture needs optim.capturable true (it sets it): drop "
                         "--optim.capturable false")  # fmt: skip
    if cfg.per_layer:
        raise ValueError("optim.capture cannot replay optim.per_layer's updates inside "
                         "backward: set one of them false")  # fmt: skip
    cfg.options["capturable"] = True


def check_capture_schedule(cfg: OptimConfig, total_steps: int) -> None:
    """``ValueError`` when ``optim.capture`` meets a learning rate that changes between
    steps (see the module docstring)."""
    if not cfg.capture:
        return
    if own_schedule(cfg.name):  # the recipe's schedule is constant (CapturedStep refuses
        return  # the optimizer's own, with the reason)
    fn = schedule_fn(cfg, total_steps)
    if any(fn(s) != 1.0 for s in range(total_steps + 1)):
        raise ValueError(
            "optim.capture needs a constant learning rate (a CUDA graph holds it as a "
            "constant: every change would be captured again, slower than eager): use "
            "--optim.warmup_steps 0 --optim.warmup_ratio 0 --optim.min_lr_ratio 1"
        )


def adamw_kernel(cfg: OptimConfig, device: torch.device) -> dict[str, bool]:
    """torch AdamW's kernel switch for ``cfg.adamw_kernel`` on ``device``."""
    kernel = cfg.adamw_kernel
    if kernel == "auto":
        kernel = "fused" if device.type == "cuda" else "foreach"
    return {"fused": True} if kernel == "fused" else {"foreach": True}


def adamw_label(cfg: OptimConfig, device: torch.device) -> str:
    """The baseline's name in ratios: "torch AdamW (fused)" or "(foreach)"."""
    return f"torch AdamW ({next(iter(adamw_kernel(cfg, device)))})"


def _resolve(name: str, peers: Mapping[str, Peer]) -> Callable[..., torch.optim.Optimizer]:
    if name == "adamw":
        return torch.optim.AdamW
    if name == "adamw8bit":
        try:
            import bitsandbytes as bnb
        except ImportError as e:
            raise RuntimeError(
                "optim.name='adamw8bit' needs bitsandbytes: pip install bitsandbytes"
            ) from e
        return bnb.optim.AdamW8bit
    if name in peers:
        return peers[name].load()
    cls_name, _ = _GALORE2[name]
    cls = getattr(galore2, cls_name, None)
    if cls is None:
        ready = [n for n in NAMES if n not in _GALORE2 or hasattr(galore2, _GALORE2[n][0])]
        raise NotImplementedError(
            f"optim.name={name!r}: galore2.{cls_name} is not available yet (it lands with "
            f"a later release); available now: {', '.join(ready)}"
        )
    return cls


def available(name: str, peers: Mapping[str, Peer] = NO_PEERS) -> bool:
    try:
        _resolve(name, peers)
    except (NotImplementedError, RuntimeError):
        return False
    return True


def build_optimizer(
    model: nn.Module,
    cfg: OptimConfig,
    total_steps: int,
    peers: Mapping[str, Peer] = NO_PEERS,
) -> torch.optim.Optimizer:
    """The optimizer ``cfg.name`` (its options parsed: :func:`recipes.resolve.parse_options`) over
    ``model``'s trainable parameters; ``peers``: optimizers of other packages by name."""
    if cfg.name not in NAMES and cfg.name not in peers:
        names = ", ".join((*NAMES, *peers))
        peer = "" if peers else " (other packages' optimizers: python -m benchmarks.pretrain)"
        raise ValueError(f"optim.name must be one of {names}; got {cfg.name!r}{peer}")
    cls = _resolve(cfg.name, peers)
    common = {o.name: setting(cfg, o.name) for o in COMMON}  # lr, weight_decay, betas, eps
    kwargs: dict[str, Any] = {"lr": common["lr"], "weight_decay": common["weight_decay"]}
    if cfg.name in peers:
        peer = peers[cfg.name]
        keys = peer.group_keys(cfg) if peer.projected else None
        groups = param_groups(model, cfg, peer.projected, keys)
        kwargs.update(peer.kwargs(cfg))
    elif cfg.name in PRESETS:
        groups = param_groups(model, cfg, _GALORE2[cfg.name][1])
        galore_only, declared = _galore_only(cls), cls.all_options()
        # the common settings it declares (not GaLoreAdafactor's betas; its own pair eps)
        kwargs.update({k: v for k, v in common.items() if k in declared})
        if cfg.name == "galore_adafactor":
            # An explicit lr, as the recipe gives galore-torch's GaLoreAdafactor: no 1/√t
            # cap and no RMS(θ) factor (that factor alone divides the step by ~50 here).
            kwargs.update(relative_step=False, scale_parameter=False)
        # every other option set with --optim.KEY, as given (GaLore's own went on the
        # projected group; shared settings the optimizer does not declare are not its)
        kwargs.update(
            {k: v for k, v in cfg.options.items() if k in declared and k not in galore_only}
        )
    else:
        groups = param_groups(model, cfg, False)
        kwargs.update(common)
        if cfg.name == "adamw":
            device = next(model.parameters()).device
            kwargs.update(adamw_kernel(cfg, device))
    if own_schedule(cfg.name, peers):
        kwargs["num_iterations"] = cfg.options.get("num_iterations") or total_steps
    return cls(groups, **kwargs)


def schedule_fn(cfg: OptimConfig, total_steps: int) -> Callable[[int], float]:
    """LR multiplier at step s: linear warmup, then cosine from 1 to ``min_lr_ratio``.

    Not used for ``ranger21`` / ``galore_ranger21``, which carry Ranger21's own warmup and
    explore-exploit warmdown (length ``optim.num_iterations``, default ``train.steps``)."""
    if total_steps < 1:
        raise ValueError(f"train.steps must be >= 1, got {total_steps}")
    if not 0.0 <= cfg.min_lr_ratio <= 1.0:
        raise ValueError(f"optim.min_lr_ratio must be in [0, 1], got {cfg.min_lr_ratio}")
    warmup = cfg.warmup_steps or int(cfg.warmup_ratio * total_steps)
    warmup = min(max(warmup, 0), total_steps)

    def fn(step: int) -> float:
        if step < warmup:
            return (step + 1) / warmup
        progress = min(1.0, (step - warmup) / max(1, total_steps - warmup))
        cosine = 0.5 * (1.0 + math.cos(math.pi * progress))
        return cfg.min_lr_ratio + (1.0 - cfg.min_lr_ratio) * cosine

    return fn


def build_scheduler(
    optimizer: torch.optim.Optimizer,
    cfg: OptimConfig,
    total_steps: int,
    peers: Mapping[str, Peer] = NO_PEERS,
) -> torch.optim.lr_scheduler.LambdaLR:
    if own_schedule(cfg.name, peers):  # Ranger21 warms up and down itself (its own step counter)
        return torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0)
    return torch.optim.lr_scheduler.LambdaLR(optimizer, schedule_fn(cfg, total_steps))


def restore_scheduler(scheduler: torch.optim.lr_scheduler.LambdaLR, step: int) -> None:
    """After loading an optimizer checkpoint taken at ``step``: continue the schedule from there.

    The schedule restarts from each group's ``initial_lr`` (this run's ``optim.lr``, which
    may differ from the checkpoint's) at ``step``: the learning rate the uninterrupted run
    has there (bit for bit), or the new base value from the step the change applies.
    """
    groups = scheduler.optimizer.param_groups
    scheduler.base_lrs = [g["initial_lr"] for g in groups]
    scheduler.last_epoch = step
    for g, base, fn in zip(groups, scheduler.base_lrs, scheduler.lr_lambdas, strict=True):  # type: ignore[attr-defined]
        g["lr"] = base * fn(step)
    scheduler._last_lr = [g["lr"] for g in groups]  # type: ignore[attr-defined]
