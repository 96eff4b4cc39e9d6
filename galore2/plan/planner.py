"""The plan: per optimizer and option set, the bytes per GPU and whether they fit.

Every row combines one optimizer (:data:`OPTIMIZERS`) with one option set (per-layer
updates on/off, activation checkpointing on/off, an FSDP world size). Weights, gradients
and activations come from :mod:`galore2.plan.formulas`; optimizer state from
:mod:`galore2.plan.state` (measured for galore2's optimizers: ``init_state()`` on the
meta device; counted for ``torch.optim.AdamW`` and bitsandbytes' ``AdamW8bit``); the
step's own memory from :mod:`galore2.plan.step` (measured: the step run on the meta
device). A row's total is the larger of two moments (:attr:`Row.total`).
"""

from __future__ import annotations

import warnings
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

from torch import nn

from ..core.transform import walk
from ..groups import param_groups, select
from ..optim.galore import GaLore
from ..presets import PRESETS
from .formulas import Footprint, decoder_layers
from .state import Piece, counted, measured, nbytes
from .step import StepMemory, TorchAdamW, by_depth, measure

__all__ = ["OPTIMIZERS", "Optimizer", "Row", "build", "plan", "projected", "state_pieces",
           "step_memory"]


@dataclass(frozen=True)
class Optimizer:
    """An optimizer the planner sizes: a counted rule (``rule``; ``adamw`` with its
    ``kernel`` in ``kwargs``) or a galore2 preset (``preset``, a key of
    ``galore2.presets.PRESETS``) with extra GaLore group keys (``group``) and constructor
    arguments that change no state (``kwargs``)."""

    name: str
    label: str
    rule: str | None = None
    preset: str | None = None
    group: dict[str, Any] = field(default_factory=dict)
    kwargs: dict[str, Any] = field(default_factory=dict)

    @property
    def projects(self) -> bool:
        """Whether the preset has GaLore in its chain (every one but Ranger21)."""
        return self.preset is not None and GaLore in walk(PRESETS[self.preset].modules)


#: the optimizers a plan compares, by name
OPTIMIZERS: dict[str, Optimizer] = {
    o.name: o
    for o in (
        # the recipe's AdamW on a GPU (optim.adamw_kernel auto): torch's fused kernel
        Optimizer("adamw", "AdamW (fused)", rule="adamw", kwargs={"kernel": "fused"}),
        Optimizer(
            "adamw_foreach", "AdamW (foreach)", rule="adamw", kwargs={"kernel": "foreach"}
        ),
        Optimizer("adamw8bit", "AdamW 8-bit (bnb)", rule="adamw8bit"),
        Optimizer("galore_adamw", "GaLoreAdamW", preset="galore_adamw"),
        Optimizer(
            "galore_adamw8bit_int8",
            "GaLoreAdamW8bit, INT8 basis",
            preset="galore_adamw8bit",
            group={"basis_dtype": "int8"},
        ),
        Optimizer(
            "galore_adamw8bit_int4",
            "GaLoreAdamW8bit, INT4 basis",
            preset="galore_adamw8bit",
            group={"basis_dtype": "int4"},
        ),
        Optimizer("galore_adafactor", "GaLoreAdafactor", preset="galore_adafactor"),
        Optimizer("fira", "Fira", preset="fira"),
        Optimizer("apollo", "APOLLO", preset="apollo"),
        Optimizer("apollo_mini", "APOLLO-Mini (rank 1)", preset="apollo_mini"),
        Optimizer("galore_muon", "GaLoreMuon", preset="galore_muon"),
        # num_iterations sets Ranger21's schedule length only: no state depends on it
        Optimizer(
            "ranger21", "Ranger21 (full rank)", preset="ranger21", kwargs={"num_iterations": 1}
        ),
        Optimizer(
            "galore_ranger21",
            "GaLoreRanger21",
            preset="galore_ranger21",
            kwargs={"num_iterations": 1},
        ),
    )
}


@dataclass(frozen=True)
class Row:
    """Bytes per GPU of one optimizer under one option set.

    ``step``: the optimizer step's own temporaries at its peak; ``held``: what the optimizer
    keeps between steps beyond its state (:class:`~galore2.plan.step.StepMemory`)."""

    optimizer: str
    per_layer: bool
    checkpointing: bool
    world_size: int
    weights: int
    gradients: int
    state: int
    activations: int
    step: int = 0
    held: int = 0

    @property
    def total(self) -> int:
        """weights + gradients + state + held + the larger of activations and step: the
        step's temporaries are not alive with the activation peak (the whole-model step
        runs after backward has freed activations; a per-layer update runs once its
        parameter's gradient is made, the largest ones, embeddings and output head, at
        the ends of backward)."""
        return self.weights + self.gradients + self.state + self.held + self.peak

    @property
    def peak(self) -> int:
        """The larger of activations and the step's temporaries."""
        return max(self.activations, self.step)

    def fits(self, budget: int) -> bool:
        """Whether the total is at most ``budget`` bytes."""
        return self.total <= budget

    def to_dict(self) -> dict[str, Any]:
        """The fields and the total (for ``--json``)."""
        return {**asdict(self), "total": self.total}


def build(
    optimizer: Optimizer,
    model: nn.Module,
    target_modules: Any,
    galore: dict[str, Any],
    keep: set[int] | None = None,
) -> Any:
    """``optimizer`` over ``model``'s trainable parameters (only those whose ``id`` is in
    ``keep``, when given), every state tensor created (galore2's ``init_state()``; a meta
    model allocates nothing) with ``galore`` (rank, …) on the ``target_modules`` group; a
    :class:`~galore2.plan.step.TorchAdamW` for the ``adamw`` rule, None for ``adamw8bit``.
    A preset's own definition wins over ``galore``: its ``preset_defaults`` (APOLLO's
    projector, scaling and α) and its ``projected_rank`` (APOLLO-Mini: 1); a preset without
    GaLore (Ranger21) gets one group of every trainable parameter."""
    params = [p for p in model.parameters() if p.requires_grad]
    params = [p for p in params if keep is None or id(p) in keep]
    if optimizer.rule is not None:
        return TorchAdamW(params, **optimizer.kwargs) if optimizer.rule == "adamw" else None
    cls = PRESETS[optimizer.preset]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # e.g. rank >= min dim of a small weight
        if optimizer.projects:
            settings = {k: v for k, v in galore.items() if k not in cls.preset_defaults}
            rank = getattr(cls, "projected_rank", None)
            settings |= {"rank": rank} if rank is not None else {}
            groups = param_groups(model, target_modules, **settings, **optimizer.group)
            if keep is not None:
                groups = [{**g, "params": [p for p in g["params"] if id(p) in keep]}
                          for g in groups]  # fmt: skip
                groups = [g for g in groups if g["params"]]
        else:
            groups = [{"params": params}]
        try:
            opt = cls(groups, **optimizer.kwargs)
        except ImportError as e:  # GaLoreAdamW8bit without bitsandbytes
            others = ",".join(n for n in OPTIMIZERS if n != optimizer.name)
            msg = f"{optimizer.name}: {e} (or leave it out: --optimizers {others})"
            raise ImportError(msg) from e
        except ValueError as e:  # the settings given do not suit this preset
            raise ValueError(f"optimizer {optimizer.name!r} ({cls.__name__}): {e}") from None
        opt.init_state()
    return opt


def _pieces(optimizer: Optimizer, opt: Any, params: Any) -> list[Piece]:
    if optimizer.rule is not None:
        fused = optimizer.kwargs.get("kernel") == "fused"
        return counted(optimizer.rule, params, device_step=fused)
    return measured(opt)


def state_pieces(
    optimizer: Optimizer, model: nn.Module, target_modules: Any, galore: dict[str, Any]
) -> list[Piece]:
    """The state ``optimizer`` holds for ``model``: counted by rule, or measured from a
    galore2 optimizer built over it (:func:`build`)."""
    opt = None if optimizer.rule is not None else build(optimizer, model, target_modules, galore)
    return _pieces(optimizer, opt, model)


def step_memory(
    optimizer: Optimizer,
    model: nn.Module,
    target_modules: Any,
    galore: dict[str, Any],
    per_layer: bool,
    n_layers: int,
) -> StepMemory:
    """The step's own memory (:mod:`galore2.plan.step`): measured on the root parameters
    and the first decoder layers of ``model`` (``n_layers`` of them), extrapolated to all;
    0 for bitsandbytes' 8-bit AdamW (a rule: its kernels work in place). An optimizer that
    refuses per-layer updates (Ranger21: its stable weight decay needs every gradient) has
    the whole step's memory on its (hypothetical) per-layer rows."""
    if optimizer.rule == "adamw8bit":
        return StepMemory()
    key = (repr(optimizer), _signature(model), repr(target_modules), repr(sorted(galore.items())),
           per_layer, n_layers)  # fmt: skip
    if key not in _MEASURED:
        if len(_MEASURED) >= 256:
            _MEASURED.clear()
        _MEASURED[key] = _step_memory(optimizer, model, target_modules, galore, per_layer, n_layers)
    return _MEASURED[key]


#: step_memory's measurements in this process, by optimizer, model shapes and settings: a
#: measurement runs steps at full width (minutes at 7B), and a plan per world size, a
#: plot, a recipe and a config.json of the same model ask the same question again
_MEASURED: dict[tuple, StepMemory] = {}


def _signature(model: nn.Module) -> tuple:
    """What a step's memory depends on in ``model``: its modules' kinds and its parameters'
    names, shapes, dtypes, devices and whether they train."""
    kinds = tuple(type(m).__qualname__ for m in model.modules())
    params = tuple((n, tuple(p.shape), str(p.dtype), p.device.type, p.requires_grad)
                   for n, p in model.named_parameters())  # fmt: skip
    return kinds, params


def _step_memory(
    optimizer: Optimizer,
    model: nn.Module,
    target_modules: Any,
    galore: dict[str, Any],
    per_layer: bool,
    n_layers: int,
) -> StepMemory:
    layers = decoder_layers(model, n_layers)
    inside = {id(p) for p in layers.parameters()}
    root = {id(p) for p in model.parameters() if id(p) not in inside}

    def run(depth: int) -> StepMemory:
        keep = root | {id(p) for layer in layers[:depth] for p in layer.parameters()}
        params = [p for p in model.parameters() if p.requires_grad and id(p) in keep]
        opt = build(optimizer, model, target_modules, galore, keep)
        device = params[0].device
        state = nbytes(x for x in _pieces(optimizer, opt, params) if x.layout != "cpu")
        try:
            return measure(opt, params, state, device, per_layer)
        except ValueError:  # step_param refused (Ranger21's stable weight decay needs
            if not per_layer:  # every gradient): the row is hypothetical, so is its step
                raise
        return measure(build(optimizer, model, target_modules, galore, keep), params, state,
                       device)  # fmt: skip

    return by_depth(run, n_layers)


def projected(model: nn.Module, target_modules: Any) -> int:
    """How many weights of ``model`` GaLore projects for ``target_modules``
    (:func:`galore2.groups.select`'s choice, ``galore2.param_groups``' too: with
    ``"all-linear"``, the weights of ``nn.Linear`` and ``transformers``' ``Conv1D`` layers
    but the output head's); 0 means every GaLore row is its optimizer at full rank."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "no parameter was selected": the count says it
        chosen, _ = select(model, target_modules)
    return len(chosen)


def _choices(name: str, values: Sequence[Any], check) -> list[Any]:
    values = list(values)
    if not values or not all(check(v) for v in values):
        raise ValueError(f"{name} must be a non-empty list of valid values, got {values!r}")
    return list(dict.fromkeys(values))


def plan(
    model: nn.Module,
    *,
    batch_size: int,
    seq_len: int,
    rank: int,
    world_sizes: Sequence[int] = (1,),
    per_layer: Sequence[bool] = (False, True),
    checkpointing: Sequence[bool] = (False, True),
    optimizers: Sequence[str] = tuple(OPTIMIZERS),
    target_modules: Any = "all-linear",
    galore: dict[str, Any] | None = None,
    grad_accum: int = 1,
    footprint: Footprint | None = None,
) -> list[Row]:
    """One :class:`Row` per optimizer × world size × per-layer × checkpointing.

    Args:
        model: the model (build it on the meta device: nothing is allocated), in the
            parameter dtype of training.
        batch_size: sequences per GPU per micro-batch.
        seq_len: tokens per sequence.
        rank: GaLore's rank (overrides ``galore["rank"]``).
        world_sizes: FSDP world sizes.
        per_layer: per-layer updates off and/or on: the values to try.
        checkpointing: activation checkpointing off and/or on: the values to try.
        optimizers: names in :data:`OPTIMIZERS`.
        target_modules: the projected modules (``galore2.param_groups``' argument).
        galore: other GaLore group settings (``proj_type``, ``projector``, …).
        grad_accum: micro-batches per step (> 1 keeps every gradient alive).
        footprint: the model's :class:`Footprint` (default: from ``model.config``).
    """
    for name, value in (("batch_size", batch_size), ("seq_len", seq_len), ("rank", rank),
                        ("grad_accum", grad_accum)):  # fmt: skip
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise ValueError(f"{name} must be an int >= 1, got {value!r}")
    unknown = [o for o in optimizers if o not in OPTIMIZERS]
    if unknown or not optimizers:
        raise ValueError(f"optimizers {unknown or '[]'}: choose from {', '.join(OPTIMIZERS)}")
    worlds = _choices("world_sizes", world_sizes, lambda w: isinstance(w, int) and w >= 1)
    layered = _choices("per_layer", per_layer, lambda v: isinstance(v, bool))
    ckpt = _choices("checkpointing", checkpointing, lambda v: isinstance(v, bool))
    fp = footprint or Footprint.of(model)
    settings = {**(galore or {}), "rank": rank}
    rows = []
    for name in dict.fromkeys(optimizers):
        spec = OPTIMIZERS[name]
        pieces = state_pieces(spec, model, target_modules, settings)
        steps = {pl: step_memory(spec, model, target_modules, settings, pl, fp.shapes.n_layers)
                 for pl in layered}  # fmt: skip
        for w in worlds:
            state = nbytes(pieces, w)
            for pl in layered:
                grads = fp.gradients(w, pl, grad_accum)
                own = steps[pl]
                # FSDP: each rank steps its shards (an estimate, not measured under FSDP)
                step, held = -(-own.transient // w), -(-own.held // w)
                for ac in ckpt:
                    acts = fp.activations(batch_size, seq_len, ac)
                    rows.append(Row(name, pl, ac, w, fp.weights(w), grads, state, acts,
                                    step, held))  # fmt: skip
    return rows
