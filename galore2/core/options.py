"""Options: each module declares the group keys it reads, once, and everything derives from that.

An :class:`Option` is a name, a default, a :class:`Check` and a one-line doc. A module
(transform, gradient / weight module, projector, storage format) lists its options in
its ``options`` class attribute; :class:`~galore2.core.optimizer.ChainOptimizer` collects
them from its modules to build its defaults and to validate every parameter group (an
unknown key is an error naming it). ``param_groups``, the Hugging Face integration
(``optim_args`` strings), the recipe's ``--optim.KEY`` flags and the docs' options
table read the same declarations (:func:`describe` renders one row per option).

A check normalizes a value or raises ``ValueError``; ``parse`` turns the string form
(command lines, ``optim_args``) into a value the check accepts. A check that involves
several keys (``power_iters`` depends on ``projector``) is a :class:`CrossCheck`, listed by
its owner (a module's ``checks``) with every key it reads: :func:`resolve` runs it after
every single-key check has passed, on a view of the group holding only those keys
(:class:`Seen`), so a check cannot depend on another owner's option without saying so.
"""

from __future__ import annotations

import difflib
import math
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch


class Check:
    """A value check: ``__call__`` returns the normalized value or raises ``ValueError``."""

    #: what is allowed, as it reads after "KEY must be"
    describe: str = "valid"

    def ok(self, value: Any) -> bool:
        raise NotImplementedError

    def __call__(self, value: Any) -> Any:
        if not self.ok(value):
            raise ValueError(self.describe)
        return self.normalize(value)

    def normalize(self, value: Any) -> Any:
        return value

    def parse(self, text: str) -> Any:
        """The value written as ``text`` (a command line or ``optim_args`` entry)."""
        return text

    def alternative(self, default: Any) -> Any:
        """A valid value other than ``default`` (used by tests that set every option)."""
        raise NotImplementedError


def is_real(x: Any) -> bool:
    """A finite int or float that is not a bool."""
    return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x)


def is_int(x: Any) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def _num(x: float) -> str:
    if is_int(x) and x >= 2**20 and x & (x - 1) == 0:
        return f"2**{x.bit_length() - 1}"
    return str(x) if is_int(x) else f"{x:g}"


def _interval(low: float | None, high: float | None, low_open: bool, high_open: bool) -> str:
    if low is not None and high is not None:
        lo, hi = _num(low), _num(high)
        return f"in {'(' if low_open else '['}{lo}, {hi}{')' if high_open else ']'}"
    if low is not None:
        return f"{'>' if low_open else '>='} {_num(low)}"
    if high is not None:
        return f"{'<' if high_open else '<='} {_num(high)}"
    return ""


@dataclass(frozen=True)
class Real(Check):
    """A finite float, optionally bounded (``low_open``: strictly above ``low``)."""

    low: float | None = None
    high: float | None = None
    low_open: bool = False
    high_open: bool = False

    @property
    def describe(self) -> str:  # type: ignore[override]
        bounds = _interval(self.low, self.high, self.low_open, self.high_open)
        return f"a finite float {bounds}".rstrip()

    def ok(self, value: Any) -> bool:
        if not is_real(value):
            return False
        if self.low is not None and (value <= self.low if self.low_open else value < self.low):
            return False
        return self.high is None or (value < self.high if self.high_open else value <= self.high)

    def parse(self, text: str) -> Any:
        return float(text)

    def alternative(self, default: Any) -> Any:
        for x in (default * 0.5 if default else None, 0.5, 2.0, 1.5, 0.0, -1.0):
            if x is not None and x != default and self.ok(x):
                return x
        raise ValueError("no alternative")


@dataclass(frozen=True)
class Int(Check):
    """An int (not a bool), optionally bounded below/above (inclusive)."""

    low: int | None = None
    high: int | None = None

    @property
    def describe(self) -> str:  # type: ignore[override]
        return f"an int {_interval(self.low, self.high, False, True)}".rstrip()

    def ok(self, value: Any) -> bool:
        return (
            is_int(value)
            and (self.low is None or value >= self.low)
            and (self.high is None or value < self.high)
        )

    def parse(self, text: str) -> Any:
        return int(text)

    def alternative(self, default: Any) -> Any:
        base = default if is_int(default) else (self.low or 1)
        for x in (base + 1, base * 2, base + 3):
            if x != default and self.ok(x):
                return x
        raise ValueError("no alternative")


@dataclass(frozen=True)
class Bool(Check):
    describe = "a bool"

    def ok(self, value: Any) -> bool:
        return isinstance(value, bool)

    def parse(self, text: str) -> Any:
        low = text.strip().lower()
        if low in ("true", "1", "yes"):
            return True
        if low in ("false", "0", "no"):
            return False
        raise ValueError(f"{text!r} is not a bool (true/false)")

    def alternative(self, default: Any) -> Any:
        return not default


@dataclass(frozen=True)
class Choice(Check):
    """One of ``values``; ``aliases`` (alias → value, may include torch dtypes) normalize."""

    values: tuple[Any, ...]
    aliases: Mapping[Any, Any] = field(default_factory=dict)

    @property
    def describe(self) -> str:  # type: ignore[override]
        return f"one of {self.values}"

    def ok(self, value: Any) -> bool:
        try:
            return value in self.values or value in self.aliases
        except TypeError:  # unhashable
            return False

    def normalize(self, value: Any) -> Any:
        return value if value in self.values else self.aliases[value]

    def parse(self, text: str) -> Any:
        return text

    def alternative(self, default: Any) -> Any:
        return next(v for v in self.values if v != default)


@dataclass(frozen=True)
class Optional(Check):
    """None or a value ``inner`` accepts."""

    inner: Check
    none_means: str = ""

    @property
    def describe(self) -> str:  # type: ignore[override]
        why = f" ({self.none_means})" if self.none_means else ""
        return f"None{why} or {self.inner.describe}"

    def ok(self, value: Any) -> bool:
        return value is None or self.inner.ok(value)

    def normalize(self, value: Any) -> Any:
        return None if value is None else self.inner.normalize(value)

    def parse(self, text: str) -> Any:
        return None if text.strip().lower() in ("none", "null", "") else self.inner.parse(text)

    def alternative(self, default: Any) -> Any:
        return self.inner.alternative(default) if default is None else None


@dataclass(frozen=True)
class Pair(Check):
    """A pair ``(first, second)`` given as a tuple or list; normalized to a tuple."""

    first: Check
    second: Check

    @property
    def describe(self) -> str:  # type: ignore[override]
        return f"a pair ({self.first.describe}, {self.second.describe})"

    def ok(self, value: Any) -> bool:
        return (
            isinstance(value, (tuple, list))
            and len(value) == 2
            and self.first.ok(value[0])
            and self.second.ok(value[1])
        )

    def normalize(self, value: Any) -> Any:
        return (self.first.normalize(value[0]), self.second.normalize(value[1]))

    def parse(self, text: str) -> Any:
        parts = [p.strip() for p in text.strip("()[] ").split(",")]
        if len(parts) != 2:
            raise ValueError(f"{text!r} is not a pair a,b")
        return (self.first.parse(parts[0]), self.second.parse(parts[1]))

    def alternative(self, default: Any) -> Any:
        return (self.first.alternative(default[0]), default[1])


@dataclass(frozen=True)
class LearningRate(Check):
    """A finite float >= 0, or a one-element tensor holding one (as torch.optim takes)."""

    describe = "a finite float >= 0 (or a one-element tensor)"

    def ok(self, value: Any) -> bool:
        if isinstance(value, torch.Tensor):
            return value.numel() == 1 and math.isfinite(float(value)) and float(value) >= 0
        return is_real(value) and value >= 0

    def parse(self, text: str) -> Any:
        return float(text)

    def alternative(self, default: Any) -> Any:
        return float(default) * 0.5 if float(default) else 1e-3


@dataclass(frozen=True)
class Option:
    """One group key: its name, default, check and a one-line doc.

    ``resumable=False`` marks a key whose value shapes the stored state or its meaning
    (rank, projection side, basis storage, seeds...): a checkpoint written with one value
    cannot continue under another, so loading refuses the change, naming the key. Every
    other key may change on resume (the new value applies from then on, and is reported).
    """

    name: str
    default: Any
    check: Check
    doc: str
    resumable: bool = True

    def validate(self, value: Any) -> Any:
        """The normalized value; ``ValueError`` naming this option and what is allowed."""
        try:
            return self.check(value)
        except ValueError:
            raise ValueError(f"{self.name} must be {self.check.describe}, got {value!r}") from None

    def parse(self, text: str) -> Any:
        """The value written as ``text``, validated; errors name the option."""
        try:
            value = self.check.parse(text)
        except (TypeError, ValueError):
            raise ValueError(f"{self.name} must be {self.check.describe}, got {text!r}") from None
        return self.validate(value)

    def of(self, group: Mapping[str, Any]) -> Any:
        """This option's value in ``group`` (its default when absent: a module applied by
        hand to a partial group; the optimizer always fills every option in)."""
        return group.get(self.name, self.default)

    def example(self) -> Any:
        """A valid value that differs from the default."""
        return self.check.alternative(self.default)


@dataclass(frozen=True)
class CrossCheck:
    """A check across keys of a parameter group: ``fn(group)`` raises ``ValueError`` naming
    them. ``keys`` are every key it reads (its owner's options, others' it depends on,
    ``"params"``); it is handed the group through :class:`Seen`, which refuses any other."""

    keys: tuple[str, ...]
    fn: Callable[[Mapping[str, Any]], None]


class Seen(Mapping[str, Any]):
    """A parameter group as a :class:`CrossCheck` sees it: only its declared ``keys``.

    Reading any other key (``[]``, ``get``, ``in``) raises ``KeyError`` naming the check
    and the key: a check's dependence on another owner's option is declared, never found."""

    __slots__ = ("_group", "_keys", "_owner")

    def __init__(self, group: Mapping[str, Any], keys: Iterable[str], owner: str) -> None:
        self._group, self._keys, self._owner = group, frozenset(keys), owner

    def _declared(self, key: str) -> None:
        if key not in self._keys:
            raise KeyError(
                f"{self._owner} reads {key!r}, which its CrossCheck does not declare "
                f"(its keys: {sorted(self._keys)})"
            )

    def __getitem__(self, key: str) -> Any:
        self._declared(key)
        return self._group[key]

    def get(self, key: str, default: Any = None) -> Any:
        self._declared(key)
        return self._group.get(key, default)

    def __contains__(self, key: object) -> bool:
        self._declared(key)  # type: ignore[arg-type]
        return key in self._group

    def __iter__(self) -> Iterator[str]:
        return (k for k in self._group if k in self._keys)

    def __len__(self) -> int:
        return sum(1 for k in self._group if k in self._keys)


def check_across(checks: Iterable[CrossCheck], group: Mapping[str, Any]) -> None:
    """Run ``checks`` on ``group``, each seeing only its keys (the views are made first)."""
    seen = [(c.fn, Seen(group, c.keys, c.fn.__qualname__)) for c in checks]
    for fn, view in seen:
        fn(view)


def collect(sources: Iterable[Sequence[Option]]) -> dict[str, Option]:
    """Merge option lists; one name must always mean one declaration (the same object)."""
    out: dict[str, Option] = {}
    for options in sources:
        for opt in options:
            known = out.get(opt.name)
            if known is not None and known is not opt:
                raise TypeError(
                    f"option {opt.name!r} is declared twice with different meanings "
                    f"({known.doc!r} / {opt.doc!r}); declare it once and share the object"
                )
            out[opt.name] = opt
    return out


def hints(option_hints: Mapping[str, str], unknown: Iterable[str]) -> str:
    """``". HINT"`` for the unknown keys that have a hint (a preset's ``option_hints``), each
    distinct hint once (Ranger21 says "GaLore options ... need GaLoreRanger21" once for
    ``rank`` and ``update_proj_gap``)."""
    found = dict.fromkeys(option_hints[k] for k in unknown if k in option_hints)
    return "".join(f". {hint}" for hint in found)


def closest(unknown: Iterable[str], known: Iterable[str]) -> str:
    """The hint \", did you mean 'rank' (for 'rnak')?\" for unknown keys with a close match."""
    known = list(known)
    hits = []
    for key in unknown:
        match = difflib.get_close_matches(key, known, n=1)
        if match:
            hits.append(f"{match[0]!r} (for {key!r})")
    return f", did you mean {', '.join(hits)}?" if hits else ""


def resolve(
    options: Mapping[str, Option],
    group: Mapping[str, Any],
    defaults: Mapping[str, Any] | None = None,
    *,
    passthrough: Iterable[str] = (),
    owner: str = "the optimizer",
    checks: Iterable[CrossCheck] = (),
) -> dict[str, Any]:
    """``group`` with every option filled in (from ``defaults``, else the declared default)
    and validated, then ``checks`` run on it (:func:`check_across`); keys that are neither
    options nor ``passthrough`` raise ``ValueError``."""
    unknown = sorted(set(group) - set(options) - set(passthrough))
    if unknown:
        raise ValueError(
            f"unknown parameter group key(s) {unknown} for {owner}{closest(unknown, options)}; "
            f"its options are {sorted(options)}"
        )
    out = dict(group)
    for name, option in options.items():
        value = out.get(name, (defaults or {}).get(name, option.default))
        out[name] = option.validate(value)
    check_across(checks, out)
    return out
