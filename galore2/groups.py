"""``param_groups``: split a model's parameters into a GaLore group and a plain group
(:func:`select`: which parameters are projected, for callers that build their own groups;
:func:`default_rank`: their rank when GaLore is asked for without one)."""

from __future__ import annotations

import re
import sys
import warnings
from collections.abc import Sequence
from typing import Any

from torch import nn

from .presets import PRESETS

__all__ = ["DEFAULT_RANK", "default_rank", "is_linear", "param_groups", "select"]

#: The rank of a projected group when GaLore is asked for without one (the Hugging Face
#: Trainer's ``optim="galore_adamw"``, :mod:`galore2.integrations.transformers`, the
#: recipe's ``--optimizer galore_adamw``). GaLore's ``rank`` option itself defaults to
#: None (nothing projected), as ``torch.optim.AdamW``; a preset with its own
#: ``projected_rank`` (APOLLOMini: 1) uses that: :func:`default_rank`.
DEFAULT_RANK = 128

_OUTPUT_HEADS = ("lm_head", "output", "classifier", "score", "head")


def is_linear(module: nn.Module) -> bool:
    """Whether ``module`` is a linear layer: an ``nn.Linear`` (weight out×in) or a
    ``transformers`` ``Conv1D`` (GPT-2's linear layers, weight stored transposed, in×out).

    GaLore's side rule works on any matrix, so both are projected alike. ``transformers``
    is not imported here: a ``Conv1D`` can only exist once it has been."""
    if isinstance(module, nn.Linear):
        return True
    conv1d = getattr(sys.modules.get("transformers.pytorch_utils"), "Conv1D", None)
    return conv1d is not None and isinstance(module, conv1d)


def default_rank(optimizer_cls: type) -> int:
    """The projected groups' rank when none is given: ``optimizer_cls``'s own
    ``projected_rank`` (APOLLOMini: 1, its definition) if it has one, else
    :data:`DEFAULT_RANK`."""
    rank = getattr(optimizer_cls, "projected_rank", None)
    return DEFAULT_RANK if rank is None else rank


def _output_head_names(model: nn.Module) -> set[str]:
    """Names of linear modules that are the model's output head (skipped by ``all-linear``)."""
    heads: set[str] = set()
    get_out = getattr(model, "get_output_embeddings", None)
    if callable(get_out):
        try:
            out = get_out()
        except (NotImplementedError, AttributeError):
            out = None
        if out is not None:
            heads.update(name for name, mod in model.named_modules() if mod is out)
    # By name only outside repeated blocks: ``layers.0.output`` (BERT) is not a head.
    in_blocks = {
        f"{name}.{child}" if name else child
        for name, mod in model.named_modules()
        if isinstance(mod, (nn.ModuleList, nn.ModuleDict))
        for child, _ in mod.named_modules()
        if child
    }
    heads.update(
        name
        for name, mod in model.named_modules()
        if is_linear(mod) and name not in in_blocks and name.split(".")[-1] in _OUTPUT_HEADS
    )
    return heads


def _matcher(target_modules: str | Sequence[str]) -> tuple[list[str], Any]:
    if isinstance(target_modules, str):
        if target_modules == "all-linear":
            return [], None
        try:
            pattern = re.compile(target_modules)
        except re.error as e:
            raise ValueError(
                f"target_modules is not a valid regex ({e}): {target_modules!r}"
            ) from e
        return [target_modules], lambda name, t: pattern.fullmatch(name) or pattern.search(name)
    if not isinstance(target_modules, (list, tuple)):
        raise ValueError(
            "target_modules must be 'all-linear', a regex string, or a list of module-name "
            f"substrings; got {target_modules!r}"
        )
    targets = list(target_modules)
    if not targets or not all(isinstance(t, str) and t for t in targets):
        raise ValueError(
            "target_modules must be 'all-linear', a regex string, or a non-empty list of "
            f"non-empty module-name substrings; got {target_modules!r}"
        )
    return targets, lambda name, t: t in name


def _warn_unprojected(
    model: nn.Module, galore_ids: set[int], heads: set[str], stacklevel: int
) -> None:
    """Name the ≥2-D trainable weights ``"all-linear"`` leaves unprojected that are not an
    embedding's or an output head's (a convolution, a raw ``nn.Parameter``)."""
    skipped = {id(p) for n, m in model.named_modules() if isinstance(m, nn.Embedding) or n in heads
               for p in m.parameters(recurse=False)}  # fmt: skip
    left = [n for n, p in model.named_parameters()
            if p.requires_grad and p.dim() >= 2 and id(p) not in galore_ids | skipped]  # fmt: skip
    if left:
        warnings.warn(
            f"galore2.param_groups: target_modules='all-linear' projects linear layers only; "
            f"these ≥2-D weights stay full rank: {left[:8]}{' …' if len(left) > 8 else ''} "
            "(name their modules in target_modules to project them)",
            stacklevel=stacklevel,
        )


def select(
    model: nn.Module, target_modules: str | Sequence[str] = "all-linear", *, stacklevel: int = 2
) -> tuple[list[nn.Parameter], list[nn.Parameter]]:
    """(projected, other): every trainable parameter of ``model`` once, the ≥2-D weights of
    the modules ``target_modules`` selects (see :func:`param_groups`) first. Targets that
    match nothing, and an empty selection, are named in warnings (``stacklevel``: as
    :func:`warnings.warn`'s, counted from the caller of this function)."""
    targets, match = _matcher(target_modules)
    heads = _output_head_names(model) if match is None else set()

    galore_ids: set[int] = set()
    hits = dict.fromkeys(targets, 0)
    for mod_name, module in model.named_modules():
        if match is None:
            chosen = is_linear(module) and mod_name not in heads
        else:
            matched = [t for t in targets if match(mod_name, t)]
            for t in matched:
                hits[t] += 1
            chosen = bool(matched)
        if not chosen:
            continue
        for _, p in module.named_parameters(recurse=False):
            if p.requires_grad and p.dim() >= 2:
                galore_ids.add(id(p))
    if match is None:
        _warn_unprojected(model, galore_ids, heads, stacklevel + 1)
    missing = [t for t, n in hits.items() if n == 0]
    if missing:
        warnings.warn(
            f"galore2.param_groups: target_modules {missing} matched no module",
            stacklevel=stacklevel,
        )

    galore_params, other_params, seen = [], [], set()
    for _, p in model.named_parameters():
        if not p.requires_grad or id(p) in seen:
            continue
        seen.add(id(p))
        (galore_params if id(p) in galore_ids else other_params).append(p)
    if not galore_params:
        warnings.warn(
            "galore2.param_groups: no parameter was selected for GaLore", stacklevel=stacklevel
        )
    return galore_params, other_params


def param_groups(
    model: nn.Module,
    target_modules: str | Sequence[str] = "all-linear",
    *,
    no_galore: dict[str, Any] | None = None,
    **galore_settings: Any,
) -> list[dict[str, Any]]:
    """Parameter groups for a galore2 optimizer.

    ``target_modules`` selects modules whose ≥2-D weights are projected:
    ``"all-linear"`` (every linear layer except the output head, as PEFT's
    ``target_modules="all-linear"``; the Trainer's ``optim_target_modules="all-linear"``
    includes the head; linear layers are ``nn.Linear`` and ``transformers``' ``Conv1D``,
    GPT-2's, :func:`is_linear`), a regex searched in module names, or a list of substrings
    of module names. With ``"all-linear"``, a ≥2-D weight of any other module but an
    ``nn.Embedding`` (a convolution, a raw ``nn.Parameter``) stays unprojected and is named
    in a warning. Every trainable parameter
    lands in exactly one group: ``[galore_group, other_group]`` (empty groups are
    dropped). ``galore_settings`` (``rank`` required, plus ``update_proj_gap``,
    ``scale``, ``proj_type``, ``projector``…) go on the GaLore group;
    ``no_galore`` holds extra keys for the plain group (e.g. its own
    ``weight_decay``). Targets that match nothing are named in a warning.
    """
    known = {name for cls in PRESETS.values() for name in cls.declared_options()}
    unknown = set(galore_settings) - known
    if unknown:
        raise ValueError(
            f"unknown GaLore settings {sorted(unknown)}; group options of galore2's "
            f"optimizers: {sorted(known)}"
        )
    if galore_settings.get("rank") is None:
        raise ValueError("param_groups needs rank=<int >= 1> for the GaLore group")
    galore_params, other_params = select(model, target_modules, stacklevel=3)
    groups = [
        {"params": galore_params, **galore_settings},
        {"params": other_params, **(no_galore or {})},
    ]
    return [g for g in groups if g["params"]]
