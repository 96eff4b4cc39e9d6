"""Hugging Face ``Trainer`` integration: a :class:`~galore2.GaLoreAdamW` from ``TrainingArguments``.

Three ways in, one builder (same groups, weight decay rule and hyperparameters)::

    opt = create_optimizer(model, args, rank=128)
    trainer = Trainer(model, args, optimizers=(opt, None), ...)

    trainer = GaLoreTrainer(model, args, galore_settings={"rank": 128}, ...)

    pair = optimizer_cls_and_kwargs(model, args, rank=128)
    trainer = Trainer(model, args, optimizer_cls_and_kwargs=pair, ...)

Use :class:`GaLoreTrainer` or ``optimizer_cls_and_kwargs`` with FSDP: the Trainer refuses
``optimizers=`` there. FSDP2 (``fsdp_version=2``) works: the optimizer is built on the
unsharded model, accelerate swaps the sharded parameters in before the first step, and
galore2 creates its state lazily on that step. FSDP1's flattened 1-D parameters cannot be
projected.

Importing this module imports ``transformers``; ``import galore2`` does not.
"""

from __future__ import annotations

import inspect
import re
import warnings
from collections.abc import Iterable, Mapping
from typing import Any

import transformers
from torch import nn
from transformers.trainer_utils import check_target_module_exists

from ..core.optimizer import ChainOptimizer
from ..core.options import Option, closest, hints
from ..core.transform import walk
# default_rank: the rank used when neither ``galore_settings`` nor ``args.optim_args`` sets one
from ..groups import _output_head_names, default_rank, is_linear, param_groups
from ..optim.adam import BETAS
from ..optim.galore import GaLore
from ..presets import PRESETS
from ..presets.adamw import GaLoreAdamW

#: Not an option of the optimizer: which modules are projected (replaces
#: ``args.optim_target_modules``).
TARGET_MODULES = "target_modules"


def allowed_settings(optimizer_cls: type = GaLoreAdamW) -> dict[str, Option]:
    """Every key accepted in ``galore_settings`` and ``args.optim_args`` for
    ``optimizer_cls``: its group options and constructor switches, as it declares them."""
    return optimizer_cls.all_options()


def parse_optim_args(optim_args: str | None, optimizer_cls: type = GaLoreAdamW) -> dict[str, Any]:
    """Parse ``TrainingArguments.optim_args`` (``"rank=128,update_proj_gap=200,scale=0.25"``).

    Each value is parsed by the option it sets (ints, floats, bools ``true``/``false``,
    ``none``, pairs ``a,b`` in parentheses: ``betas=(0.9,0.95)``) and validated. Entries
    are separated by commas (spaces around them are ignored); a malformed entry (a missing
    comma: ``"rank=8 scale=0.25"``), a key set twice and unknown keys raise ``ValueError``
    quoting the text as given.
    """
    out: dict[str, Any] = {}
    if optim_args is None or optim_args == "":
        return out
    if not isinstance(optim_args, str):
        raise TypeError(
            f"optim_args must be a string like 'rank=128,update_proj_gap=200' (the Trainer's "
            f"TrainingArguments.optim_args), got a {type(optim_args).__name__}: "
            f"{optim_args!r}; pass a dict as galore_settings instead"
        )
    options = allowed_settings(optimizer_cls)
    where = f"optim_args={optim_args!r}"
    depth = 0
    for ch in optim_args:
        depth += {"(": 1, ")": -1}.get(ch, 0)
        if depth < 0:
            break
    if depth:
        raise ValueError(f"{where}: unbalanced parentheses (a pair is written betas=(0.9,0.95))")
    entries: dict[str, str] = {}
    for item in _split_items(optim_args):
        key, sep, value = (part.strip() for part in item.partition("="))
        if not sep or not key:
            raise ValueError(f"{where}: entries must look like key=value, got {item.strip()!r}")
        if value.startswith("("):  # a pair: betas=(0.9, 0.95)
            value = "".join(value.split())
        elif any(ch.isspace() for ch in value + key):
            raise ValueError(
                f"{where}: {item.strip()!r} is not one key=value; entries are separated by "
                "commas (rank=8,scale=0.25)"
            )
        if key in entries:
            raise ValueError(f"{where}: {key!r} is set twice; set each key once")
        entries[key] = value
    _check_keys(entries, where, optimizer_cls)  # every unknown key at once, each hint once
    for key, value in entries.items():
        if key == TARGET_MODULES:
            out[key] = value
            continue
        try:
            out[key] = options[key].parse(value)
        except ValueError as e:
            raise ValueError(f"{where}: {e}") from None
    return out


def _split_items(text: str) -> list[str]:
    """Split at commas outside parentheses (``betas=(0.9,0.95),rank=8``)."""
    items, depth, start = [], 0, 0
    for i, ch in enumerate(text):
        depth += {"(": 1, ")": -1}.get(ch, 0)
        if ch == "," and depth == 0:
            items.append(text[start:i])
            start = i + 1
    items.append(text[start:])
    return [item for item in items if item.strip()]


def _check_keys(keys: Iterable[str], source: str, optimizer_cls: type = GaLoreAdamW) -> None:
    allowed = {*allowed_settings(optimizer_cls), TARGET_MODULES}
    unknown = sorted(set(keys) - allowed)
    if unknown:
        raise ValueError(
            f"{source}: unknown setting(s) {unknown} for {optimizer_cls.__name__}"
            f"{closest(unknown, allowed)}{hints(optimizer_cls.option_hints, unknown)}; "
            f"allowed: {sorted(allowed)}"
        )


def target_module_names(model: nn.Module, target_modules: str | list[str] | None) -> list[str]:
    """Names of the linear modules whose weights are projected: ``nn.Linear`` and
    ``transformers``' ``Conv1D`` (GPT-2's linear layers, weight stored in×out; the Trainer's
    own ``optim="galore_adamw"`` skips those, so on GPT-2 it projects nothing).

    ``target_modules`` follows ``TrainingArguments.optim_target_modules`` exactly as the
    Trainer's own ``optim="galore_adamw"`` does: a string is ``re.fullmatch``-ed against each
    module name; a list matches a name equal to an entry, containing an entry, or
    fullmatching an entry as a regex (``check_target_module_exists``); ``"all-linear"`` is
    every linear layer, the output head included. Only linear modules are kept (another
    module matched by name rather than by regex is named in a warning), and only those whose
    weight goes by their own name: a head tied to the input embedding is listed by
    ``named_parameters`` as the embedding, so the Trainer does not project it, nor do we.

    ``None`` (galore2's default; the Trainer has none) is every linear layer except the
    output head, as :func:`galore2.param_groups`'s ``"all-linear"``.
    """
    if target_modules is None:
        heads = _output_head_names(model)
        names = [n for n, m in model.named_modules() if is_linear(m) and n not in heads]
    elif isinstance(target_modules, (str, list, tuple)):
        targets = target_modules if isinstance(target_modules, str) else list(target_modules)
        all_linear = isinstance(targets, str) and targets.replace("_", "-") == "all-linear"
        names, ignored = [], []
        for name, module in model.named_modules():
            found, is_regex = check_target_module_exists(targets, name, return_is_regex=True)
            if not is_linear(module):
                if found and not is_regex:
                    ignored.append(name)
            elif found or all_linear:
                names.append(name)
        if ignored:
            warnings.warn(
                f"galore2: modules {ignored} match optim_target_modules but are not linear "
                "(nn.Linear or transformers' Conv1D); "
                "they are trained without projection",
                stacklevel=3,
            )
    else:
        raise TypeError(
            "optim_target_modules must be a list of strings, a regex string or 'all-linear', "
            f"got {target_modules!r}"
        )
    own = {n for n, _ in model.named_parameters()}  # a tied weight once, by its first name
    names = [n for n in names if f"{n}.weight" in own]
    if not names:
        why = " (an empty list selects nothing; None or 'all-linear' means every linear layer)"
        raise ValueError(
            f"galore2: no linear module (nn.Linear or transformers' Conv1D) matches "
            f"{target_modules!r}"
            f"{why if not target_modules and target_modules is not None else ''}"
        )
    return names


def _optimizer_class(optimizer_cls: type | str | None) -> type:
    """The galore2 optimizer class named by ``optimizer_cls`` (a class, or its name in
    :data:`galore2.presets.PRESETS`: ``"galore_adamw"``…; ``None``: GaLoreAdamW), else
    TypeError: a torch optimizer would silently drop every GaLore setting."""
    cls = GaLoreAdamW if optimizer_cls is None else optimizer_cls
    if isinstance(cls, str):
        cls = PRESETS.get(cls, cls)
    if not (isinstance(cls, type) and issubclass(cls, ChainOptimizer)):
        projecting = {k: c for k, c in PRESETS.items() if GaLore in walk(c.modules)}
        raise TypeError(
            "optimizer_cls must be a galore2 optimizer class "
            f"({', '.join(c.__name__ for c in projecting.values())}) or its name "
            f"({', '.join(projecting)}), got {optimizer_cls!r}; for a torch optimizer use "
            "the Trainer's own `optim` argument"
        )
    return cls


def _settings_dict(settings: Any) -> dict[str, Any]:
    """``galore_settings`` as a dict; ``TypeError`` for anything but a mapping of names."""
    if settings is None:
        return {}
    if not isinstance(settings, Mapping) or not all(isinstance(k, str) for k in settings):
        raise TypeError(
            "galore_settings must be a dict of option names to values, e.g. "
            f"{{'rank': 128, 'update_proj_gap': 200}}; got a {type(settings).__name__}: "
            f"{settings!r} (a 'rank=128,...' string goes in TrainingArguments.optim_args)"
        )
    return dict(settings)


def _check_settings(settings: dict[str, Any], source: str, optimizer_cls: type) -> None:
    """Keys and single values of ``settings`` (what can be checked without a model)."""
    _check_keys(settings, source, optimizer_cls)
    options = allowed_settings(optimizer_cls)
    for key, value in settings.items():
        if key != TARGET_MODULES:
            try:
                options[key].validate(value)
            except ValueError as e:
                raise ValueError(f"{source}: {e}") from None


def _decay_parameter_names(model: nn.Module) -> list[str]:
    # The Trainer's rule (biases and LayerNorm/RMSNorm weights are not decayed); the method
    # does not use ``self``, so it can be called on the class.
    return transformers.Trainer.get_decay_parameter_names(None, model)


def _build(
    model: nn.Module,
    args: transformers.TrainingArguments,
    galore_settings: dict[str, Any],
    decay_names: Iterable[str],
    optimizer_cls: type | str | None = None,
    optimizer_kwargs: dict[str, Any] | None = None,
) -> GaLoreAdamW:
    cls = _optimizer_class(optimizer_cls)
    _check_keys(galore_settings, "galore_settings", cls)
    extra = dict(optimizer_kwargs or {})
    if "num_iterations" in inspect.signature(cls).parameters and "num_iterations" not in extra:
        if args.max_steps is None or args.max_steps <= 0:
            raise ValueError(
                f"{cls.__name__} needs num_iterations: set TrainingArguments.max_steps or pass "
                "optimizer_kwargs={'num_iterations': N}"
            )
        extra["num_iterations"] = args.max_steps
    settings = {
        "rank": default_rank(cls),
        **parse_optim_args(args.optim_args, cls),
        **galore_settings,
    }
    target = settings.pop(TARGET_MODULES, None)
    if target is None:
        target = args.optim_target_modules
    # GaLore's own options go on the projected groups; every other option (the loop's, the
    # moment rule's, constructor switches) applies to the whole optimizer.
    projected_keys = {o.name for o in GaLore.options}
    optimizer_wide = {k: settings.pop(k) for k in list(settings) if k not in projected_keys}

    names = target_module_names(model, target)
    # An anchored alternation of the exact names: param_groups then picks exactly these
    # modules and does the rest (trainable, ≥2-D, tied parameters once, settings checked).
    exact = "^(?:" + "|".join(map(re.escape, names)) + ")$"
    decay = set(decay_names)
    name_of = {id(p): n for n, p in model.named_parameters()}
    groups = []
    for group in param_groups(model, exact, **settings):
        for wd, decayed in (
            (optimizer_wide.get("weight_decay", args.weight_decay), True),
            (0.0, False),
        ):
            params = [p for p in group["params"] if (name_of[id(p)] in decay) == decayed]
            if params:
                groups.append({**group, "params": params, "weight_decay": wd})
    # Adam's betas / eps only for Adam-family classes (GaLoreAdafactor's eps is another pair)
    adam = {"betas": (args.adam_beta1, args.adam_beta2), "eps": args.adam_epsilon}
    if cls.declared_options().get("betas") is not BETAS:  # not Adam-form (GaLoreAdafactor)
        adam = {}
    kwargs = {"lr": args.learning_rate, **adam, "weight_decay": args.weight_decay}
    return cls(groups, **{**kwargs, **optimizer_wide, **extra})


def create_optimizer(
    model: nn.Module,
    args: transformers.TrainingArguments,
    *,
    optimizer_cls: type | str | None = None,
    optimizer_kwargs: dict[str, Any] | None = None,
    **galore_settings: Any,
) -> GaLoreAdamW:
    """A :class:`~galore2.GaLoreAdamW` for ``Trainer(model, args, optimizers=(opt, None))``.

    From ``args``: ``learning_rate``, ``weight_decay``, ``adam_beta1``/``adam_beta2``,
    ``adam_epsilon``, ``optim_target_modules`` (HF's matching rules; ``None``: every
    ``nn.Linear`` but the output head, see :func:`target_module_names`) and ``optim_args`` (``"rank=128,update_proj_gap=200"``).
    ``galore_settings`` override both. Any option of the optimizer is accepted (the list:
    :func:`allowed_settings`, from the optimizer's own declarations): GaLore's options
    (``rank`` — default :func:`~galore2.groups.default_rank` —, ``update_proj_gap``, ``scale``,
    ``projector``…) go on the projected groups; every other option (``state_dtype``,
    ``nonfinite``, the moment rule's, a preset's constructor switches) applies to the whole
    optimizer; ``target_modules`` replaces ``args.optim_target_modules``. Any other key raises
    ``ValueError``.

    Up to four groups (projected/plain × decayed/not): parameters the Trainer would not
    decay (biases, norm weights; ``Trainer.get_decay_parameter_names``) get
    ``weight_decay=0``. Only trainable parameters are included.

    ``optimizer_cls`` picks another galore2 optimizer taking GaLore param groups, by class
    or by its name in :data:`galore2.presets.PRESETS` (``"galore_adamw8bit"``…; e.g.
    :class:`~galore2.GaLoreAdamW8bit`, :class:`~galore2.GaLoreAdafactor` — which gets no
    Adam betas / eps —, :class:`~galore2.GaLoreRanger21`, whose ``num_iterations`` defaults
    to ``args.max_steps``, :class:`~galore2.Fira`, :class:`~galore2.APOLLO`,
    :class:`~galore2.APOLLOMini` — default rank 1, :func:`~galore2.groups.default_rank` —,
    :class:`~galore2.GaLoreMuon`); ``optimizer_kwargs`` go to its constructor.
    """
    return _build(
        model,
        args,
        galore_settings,
        _decay_parameter_names(model),
        optimizer_cls,
        optimizer_kwargs,
    )


class OptimizerFactory:
    """The factory half of :func:`optimizer_cls_and_kwargs`.

    The Trainer treats anything that is not a ``torch.optim.Optimizer`` subclass as a
    factory: in its ``create_optimizer`` it calls ``OptimizerFactory()(model, **kwargs)``
    with its own model, which runs :func:`create_optimizer`. Under FSDP2 that is the
    unsharded model; accelerate swaps the sharded parameters in before the first step.
    """

    def __call__(self, model: nn.Module, **kwargs: Any) -> ChainOptimizer:
        """:func:`create_optimizer` on the Trainer's ``model`` with the helper's ``kwargs``."""
        return create_optimizer(model, **kwargs)


def optimizer_cls_and_kwargs(
    model: nn.Module | None,
    args: transformers.TrainingArguments,
    *,
    optimizer_cls: type | str | None = None,
    optimizer_kwargs: dict[str, Any] | None = None,
    **galore_settings: Any,
) -> tuple[type, dict[str, Any]]:
    """``(factory, kwargs)`` for ``Trainer(model, args, optimizer_cls_and_kwargs=...)``.

    Arguments as :func:`create_optimizer`, which builds the optimizer when the Trainer asks
    for it (:class:`OptimizerFactory`), from the Trainer's own model: the same groups, the
    same weight decay rule and hyperparameters from ``args`` as the other two paths. Pass
    the ``args`` you give the Trainer: the factory does not see the Trainer's.

    Everything is checked now, before the Trainer exists: with a ``model``, by building
    (and discarding) the optimizer on it; with ``model=None`` (a ``model_init`` Trainer),
    the keys and values of ``galore_settings`` and of ``args.optim_args``, and
    ``optimizer_cls``. The returned
    ``kwargs`` are plain (``args``, ``optimizer_cls``, ``optimizer_kwargs``, then the
    settings) and are not consumed, so the pair may be given to several Trainers.
    """
    kwargs = {
        "args": args,
        "optimizer_cls": _optimizer_class(optimizer_cls),
        "optimizer_kwargs": dict(optimizer_kwargs or {}),
        **galore_settings,
    }
    if model is None:  # what can be checked without a model: every setting from both places
        cls = kwargs["optimizer_cls"]
        _check_settings(galore_settings, "galore_settings", cls)
        parse_optim_args(getattr(args, "optim_args", None), cls)
    else:
        OptimizerFactory()(model, **kwargs)
    return OptimizerFactory, kwargs


class GaLoreTrainer(transformers.Trainer):
    """``transformers.Trainer`` whose optimizer is a :class:`~galore2.GaLoreAdamW`.

    ``galore_settings`` are those of :func:`create_optimizer` (checked here, before any
    training). The optimizer is built in :meth:`create_optimizer`, so this also works where
    the Trainer refuses ``optimizers=`` (FSDP). An optimizer passed in ``optimizers=`` is
    kept as is; ``args.optim`` is not used. ``optimizer_cls`` / ``optimizer_kwargs`` as in
    :func:`create_optimizer` (e.g. ``optimizer_cls=galore2.GaLoreRanger21``). Passing
    ``optimizer_cls_and_kwargs`` too is a TypeError (it would be ignored).
    """

    def __init__(
        self,
        *args: Any,
        galore_settings: dict[str, Any] | None = None,
        optimizer_cls: type | str | None = None,
        optimizer_kwargs: dict[str, Any] | None = None,
        **kwargs: Any,
    ):
        if kwargs.get("optimizer_cls_and_kwargs") is not None:
            raise TypeError(
                "GaLoreTrainer builds its own optimizer from galore_settings; pass "
                "optimizer_cls_and_kwargs to transformers.Trainer instead"
            )
        cls = _optimizer_class(optimizer_cls)
        self.galore_settings = _settings_dict(galore_settings)
        self.galore_optimizer = (cls, dict(optimizer_kwargs or {}))
        _check_settings(self.galore_settings, "galore_settings", cls)
        super().__init__(*args, **kwargs)

    def create_optimizer(self, model: nn.Module | None = None) -> GaLoreAdamW:
        """Build the galore2 optimizer for ``model`` (default: the Trainer's) unless one exists.

        The Trainer calls it; the groups follow :func:`create_optimizer`, with the Trainer's
        own decay parameter names. Returns the optimizer (``self.optimizer``).
        """
        opt_model = self.model if model is None else model
        if self.optimizer is None:
            self.optimizer = _build(
                opt_model,
                self.args,
                self.galore_settings,
                self.get_decay_parameter_names(opt_model),
                *self.galore_optimizer,
            )
        return self.optimizer
