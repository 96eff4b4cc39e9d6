"""What :meth:`ChainOptimizer.load_state_dict` checks before it changes anything.

torch's ``Optimizer.load_state_dict`` replaces every group value by the checkpoint's and
copies whatever state it finds; the mistakes that lets through show up later, or never
(a resumed run silently at the checkpoint's rank, another optimizer's state failing
with a bare ``KeyError`` at the first step, fp32 moments kept in an 8-bit optimizer).
Here, per group and then per parameter:

**Options** (:func:`compare_groups`). ``lr`` follows torch (LR schedulers own it: the
checkpoint's value is restored, ``initial_lr`` and the other non-option keys likewise).
An option declared ``resumable=False`` (it shapes the stored state: ``rank``,
``proj_type``, ``state_dtype``…) that differs is refused: ``ValueError`` naming each key
with both values. Any other option that differs takes this optimizer's value (the
constructor's: what the resumed run asked for), reported in one warning. An option the
checkpoint lacks (written by an older release) keeps this optimizer's value.

**State** (:func:`compare_state`). Each parameter's saved state (old key names mapped
through the modules' ``renamed_keys``) is compared with the state its first step would
create here (built on the meta device, one parameter at a time): keys, global shapes,
dtypes. Refused, naming the parameter's index (and name), shape and the keys: keys of
modules this optimizer does not have (another optimizer's state), missing keys, another
shape (the parameter changed) or dtype (e.g. 8-bit moments on one side only). Extra keys
of this optimizer's own modules are kept (``adafactor.exp_avg`` after ``beta1`` was
switched off); keys a module creates on demand (its ``optional_keys``) may be missing. A
DTensor is compared by its global shape; a plain tensor saved for a DTensor state (or the
reverse) by key and dtype only.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any

from torch import Tensor

from ..fsdp.detect import is_dtensor
from .options import Option

#: group options owned by LR schedulers: the checkpoint's value is restored (torch's rule)
SCHEDULED = frozenset({"lr"})
_SHOWN = 6  # problems listed in a refusal before "... and N more"


def _same(a: Any, b: Any) -> bool:
    try:
        return bool(a == b)
    except (RuntimeError, TypeError, ValueError):  # tensors with several elements...
        return a is b


def _normalized(option: Option, value: Any) -> Any:
    try:
        return option.validate(value)
    except (TypeError, ValueError):
        return value


def compare_groups(
    declared: Mapping[str, Option],
    groups: Sequence[Mapping[str, Any]],
    saved_groups: Sequence[Mapping[str, Any]],
) -> tuple[list[str], list[str]]:
    """(refused, changed): the lines of the refusal (non-resumable options that differ)
    and of the warning (resumable ones, which take this optimizer's value)."""
    refused, changed = [], []
    for i, (group, saved) in enumerate(zip(groups, saved_groups, strict=True)):
        for name, option in declared.items():
            if name in SCHEDULED or name not in saved:
                continue
            old, new = _normalized(option, saved[name]), group[name]
            if _same(old, new):
                continue
            if option.resumable:
                changed.append(f"group {i}: {name} {old!r} → {new!r}")
            else:
                refused.append(f"group {i}: {name}: checkpoint {old!r}, this optimizer {new!r}")
    return refused, changed


def _prefix(key: str) -> str:
    return key.split(".", 1)[0] + ".*" if "." in key else key


def _dtype(t: Tensor) -> str:
    return str(t.dtype).removeprefix("torch.")


def _param_problems(
    saved: Mapping[str, Any], expected: Mapping[str, Tensor], optional: set[str]
) -> list[str]:
    problems = []
    missing = sorted(set(expected) - set(saved) - optional)
    if missing:
        problems.append(f"missing {', '.join(missing)}")
    for key in sorted(set(expected) & set(saved)):
        got, want = saved[key], expected[key]
        if not isinstance(got, Tensor):
            problems.append(f"{key} is a {type(got).__name__}, not a tensor")
            continue
        if got.dtype != want.dtype:
            problems.append(f"{key} is {_dtype(got)} in the checkpoint, {_dtype(want)} here")
        elif is_dtensor(got) == is_dtensor(want) and got.shape != want.shape:
            problems.append(
                f"{key} has shape {tuple(got.shape)} in the checkpoint, {tuple(want.shape)} here"
            )
    if any("uint8" in p for p in problems):
        problems.append(
            "8-bit moments resume only into an optimizer that stores them 8-bit "
            "(GaLoreAdamW8bit, moments_8bit=True), other moments only into one that does not"
        )
    return problems


def known_prefixes(modules: Iterable[Any]) -> set[str]:
    """``adam.*``, ``galore.*``…: the state-key prefixes ``modules`` write (from their
    ``kinds``)."""
    return {_prefix(k) for m in modules for k in getattr(m, "kinds", {})}


def optional_keys(modules: Iterable[Any]) -> set[str]:
    """The state keys ``modules`` create on demand (their ``optional_keys``): a checkpoint
    may lack them (they are made at the next step)."""
    return {k for m in modules for k in getattr(m, "optional_keys", ())}


def compare_state(
    owner: str,
    known: set[str],
    optional: set[str],
    items: Iterable[
        tuple[Callable[[], str], Mapping[str, Any], Callable[[], Mapping[str, Tensor]]]
    ],
) -> list[str]:
    """The lines of a refusal for the parameters ``items``: (its description, saved state with
    today's key names, a function building the state this optimizer would create);
    ``known``: the key prefixes of this optimizer's modules (:func:`known_prefixes`),
    ``optional``: the keys they create on demand (:func:`optional_keys`)."""
    foreign: set[str] = set()
    foreign_params: list[str] = []
    lines: list[str] = []
    for what, saved, make in items:
        if not saved:
            continue
        theirs = {_prefix(k) for k in saved} - known
        if theirs:
            foreign |= theirs
            foreign_params.append(what())
            continue
        expected = make()
        problems = _param_problems(saved, expected, optional)
        if problems:
            lines.append(f"{what()}: {'; '.join(problems)}")
    if foreign:
        more = f" and {len(foreign_params) - 1} more" if len(foreign_params) > 1 else ""
        lines.insert(
            0,
            f"the checkpoint's state has {', '.join(sorted(foreign))} keys, which {owner} "
            f"never writes (was it saved by another optimizer?); {owner} keeps "
            f"{', '.join(sorted(known))} keys ({foreign_params[0]}{more})",
        )
    return lines


def refusal(owner: str, lines: list[str]) -> ValueError:
    """One ``ValueError`` listing ``lines`` (the first few)."""
    shown = lines[:_SHOWN]
    if len(lines) > _SHOWN:
        shown.append(f"... and {len(lines) - _SHOWN} more")
    return ValueError(
        f"{owner}.load_state_dict: the checkpoint does not fit this optimizer (nothing was "
        "loaded):\n  " + "\n  ".join(shown)
    )


class Settings:
    """The option values each parameter group's state was made with, checked between steps.

    torch lets a user edit ``param_groups`` between steps; most options are read afresh at
    every step and simply apply from the next one. Two kinds cannot: an option declared
    ``resumable=False`` (``rank``, ``proj_type``…) shapes the stored state, so a change is
    refused — ``ValueError`` naming the group, the key and both values, raised by
    :meth:`check` before anything changes — exactly as :func:`compare_groups` refuses it on
    resume; and an option a module caches in its state (GaLore's ``update_proj_gap``, which
    sets ``galore.next_refresh``) is listed in the module's ``watched`` set, and the module's
    ``options_changed(old, group, states)`` re-plans that state. After ``load_state_dict``
    the checkpoint's values are recorded (:meth:`loaded`), so a resume that changes the gap
    goes through the same path.

    Args:
        declared: the optimizer's options.
        modules: its modules (wrappers' inner modules included, see ``walk``).
    """

    def __init__(self, declared: Mapping[str, Option], modules: Iterable[Any]) -> None:
        self.declared = declared
        self.frozen = tuple(n for n, o in declared.items() if not o.resumable)
        self.watchers = [
            (m, frozenset(m.watched) & set(declared))
            for m in modules
            if getattr(m, "watched", None)
        ]
        watched = set().union(*(keys for _, keys in self.watchers)) if self.watchers else set()
        self.keys = (*self.frozen, *sorted(watched - set(self.frozen)))
        self._seen: dict[int, tuple[Mapping[str, Any], dict[str, Any]]] = {}

    def _values(self, group: Mapping[str, Any]) -> dict[str, Any]:
        return {k: group[k] for k in self.keys if k in group}

    def loaded(self, group: Mapping[str, Any], saved: Mapping[str, Any]) -> None:
        """Record that ``group``'s state was made with the checkpoint group ``saved``'s
        values (normalized; this group's own where the checkpoint lacks a key)."""
        values = self._values(group)
        for k in values:
            if k in saved:
                values[k] = _normalized(self.declared[k], saved[k])
        self._seen[id(group)] = (group, values)

    def reset(self) -> None:
        """Forget every group (before :meth:`loaded` records a checkpoint's)."""
        self._seen.clear()

    def check(
        self,
        owner: str,
        groups: Sequence[Mapping[str, Any]],
        states_of: Callable[[Mapping[str, Any]], list[tuple[int, Any]]],
    ) -> None:
        """Refuse a changed ``resumable=False`` option (nothing changes), then tell the
        watching modules of changed watched options; record ``groups``' values as seen.
        A group seen for the first time is recorded (its state is made with these values)."""
        pending = []
        for i, group in enumerate(groups):
            seen = self._seen.get(id(group))
            now = self._values(group)
            if seen is None or seen[0] is not group:
                self._seen[id(group)] = (group, now)
                continue
            old = seen[1]
            diff = {k for k in self.keys if not _same(old.get(k), now.get(k))}
            for k in sorted(diff):  # an edited value is checked as the constructor checks it
                try:
                    self.declared[k].validate(now.get(k))
                except ValueError as e:
                    raise ValueError(f"{owner}: param_groups[{i}]: {e}") from None
            bad = [k for k in self.frozen if k in diff]
            if bad:
                k = bad[0]
                raise ValueError(
                    f"{owner}: param_groups[{i}][{k!r}] changed from {old.get(k)!r} to "
                    f"{now.get(k)!r} after the optimizer state was made; {k} shapes that "
                    f"state and cannot change mid-run (it is refused on resume too): put "
                    f"{old.get(k)!r} back, or build a new optimizer"
                )
            if diff:
                pending.append((group, old, now, diff))
        for group, old, now, diff in pending:
            states = None
            for module, keys in self.watchers:
                if keys & diff:
                    states = states_of(group) if states is None else states
                    module.options_changed({k: old[k] for k in keys if k in old}, group, states)
            self._seen[id(group)] = (group, now)
