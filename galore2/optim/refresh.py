"""GaLore's refresh schedule: when a projected parameter's basis is found again.

A pure schedule over a parameter's host counters (``galore.step``, ``galore.next_refresh``,
``galore.refreshes``; with ``adaptive_refresh`` also ``galore.gap``, ``galore.streak``,
``galore.similarity``) and the options declared here, which
:class:`~galore2.optim.galore.GaLore` lists among its own. It finds no basis and touches no
gradient: GaLore asks :func:`due` before a step, and after a successful refresh calls
:func:`refreshed`, which plans the next one.

At the parameter's first step and then every ``update_proj_gap`` steps (steps 0, T, 2T, …
when every step is usable; ``refresh_schedule="staggered"``: each parameter at its own
:func:`phase` of the gap, so refreshes spread over the steps). A refresh whose gradient is
non-finite or all zero leaves the schedule untouched, so it is retried at the next step.
``adaptive_refresh`` lengthens a parameter's gap while its subspace stays put
(:func:`next_gap`). An edit of a schedule option (:data:`WATCHED`) — on resume, or of
``param_groups`` between steps — re-plans the next refresh (:func:`replan`).
"""

from __future__ import annotations

from typing import Any

import torch

from ..core.options import Bool, Choice, CrossCheck, Int, Option, Optional, Real
from ..core.state import counter
from ..core.transform import Group, State

UPDATE_PROJ_GAP = Option("update_proj_gap", 200, Int(low=1), "steps T between subspace refreshes")
REFRESH_SCHEDULE = Option(
    "refresh_schedule",
    "together",
    Choice(("together", "staggered")),
    "refresh every matrix at the same steps, or each at its own phase of the gap (no stall)",
)
ADAPTIVE_REFRESH = Option(
    "adaptive_refresh", False, Bool(), "lengthen a parameter's gap while its subspace stays put"
)
REFRESH_THRESHOLD = Option(
    "refresh_threshold",
    0.4,
    Real(low=0.0, high=1.0, low_open=True),
    "subspace overlap at or above which a refresh counts as 'stable' (adaptive refresh)",
)
REFRESH_PATIENCE = Option(
    "refresh_patience", 3, Int(low=1), "stable refreshes in a row before the gap doubles"
)
MAX_UPDATE_PROJ_GAP = Option(
    "max_update_proj_gap",
    None,
    Optional(Int(low=1), "8 x update_proj_gap"),
    "the longest gap adaptive refresh may reach",
)
OPTIONS = (
    UPDATE_PROJ_GAP,
    REFRESH_SCHEDULE,
    ADAPTIVE_REFRESH,
    REFRESH_THRESHOLD,
    REFRESH_PATIENCE,
    MAX_UPDATE_PROJ_GAP,
)
#: the options whose change :func:`replan` must see (the schedule caches them in
#: ``galore.next_refresh``; every other option is read afresh at each step)
WATCHED = frozenset(
    o.name for o in (UPDATE_PROJ_GAP, REFRESH_SCHEDULE, ADAPTIVE_REFRESH, MAX_UPDATE_PROJ_GAP)
)
#: the schedule's state, all host counters but the last overlap
KINDS = dict.fromkeys(
    ("galore.step", "galore.next_refresh", "galore.refreshes", "galore.gap", "galore.streak",
     "galore.similarity"), "other",
)  # fmt: skip
#: state made on demand (``adaptive_refresh``): a checkpoint may lack it
OPTIONAL_KEYS = frozenset({"galore.gap", "galore.streak", "galore.similarity"})


def validate(group: Group) -> None:
    """``max_update_proj_gap ≥ update_proj_gap`` (single-key checks ran already)."""
    cap, gap = group["max_update_proj_gap"], group["update_proj_gap"]
    if cap is not None and cap < gap:
        raise ValueError(
            f"max_update_proj_gap must be None (8 x update_proj_gap) or an int >= "
            f"update_proj_gap ({gap}), got {cap!r}"
        )


#: the schedule's check across keys (GaLore runs it)
CHECKS = (CrossCheck(("max_update_proj_gap", "update_proj_gap"), validate),)


def init_state(state: State, group: Group) -> None:
    """A projected parameter's schedule counters: its first refresh due at its first step
    (then :func:`init_adaptive`)."""
    state["galore.step"] = counter()
    state["galore.next_refresh"] = counter()
    state["galore.refreshes"] = counter()


def init_adaptive(state: State, group: Group) -> None:
    """The adaptive gap's state (``galore.gap``, ``galore.streak``, ``galore.similarity``)
    where ``adaptive_refresh`` is on (else it is made on demand: :func:`_next_gap`)."""
    if group["adaptive_refresh"]:
        _init_adaptive(state, group)


def is_due(step: int, next_refresh: int) -> bool:
    """Does a parameter at its GaLore ``step`` refresh, its next refresh planned at
    ``next_refresh``? From then on, until a refresh succeeds (a failed one is retried)."""
    return step >= next_refresh


def due(state: State) -> bool:
    """Is a projected parameter due for a refresh at its next step (:func:`is_due` of its
    host counters)? False for a parameter without a schedule (not projected)."""
    nxt = state.get("galore.next_refresh")
    return nxt is not None and is_due(int(state["galore.step"]), int(nxt))


#: 2**64 / golden ratio: consecutive indices land far apart in every window (Fibonacci hashing)
_GOLDEN = 0x9E3779B97F4A7C15


def phase(index: int, gap: int) -> int:
    """The step within each ``gap``-step window at which parameter ``index`` refreshes under
    ``refresh_schedule="staggered"``: ⌊frac(index·φ⁻¹)·gap⌋ in exact integer arithmetic
    (Fibonacci hashing), so any set of n parameters — consecutive, or every k-th — puts
    about ⌈n/gap⌉ refreshes on each step. A pure function of the index: the same after a
    resume, on every rank."""
    return (((index * _GOLDEN) % 2**64) * gap) >> 64


def _at_phase(start: int, gap: int, index: int) -> int:
    """The first step ≥ ``start`` at parameter ``index``'s phase."""
    return start + (phase(index, gap) - start) % gap


def next_refresh(step: int, gap: int, schedule: str, index: int) -> int:
    """The step of the next refresh after one at ``step``. ``together``: ``step + gap``
    (every parameter refreshed at its first step then every gap: steps 0, T, 2T…).
    ``staggered``: the first step at the parameter's :func:`phase` at least half a gap
    later — exactly ``step + gap`` once on its phase; after the first refresh (step 0),
    a retried one or a changed gap, within [gap/2, 3·gap/2), which brings it back on
    its phase."""
    if schedule == "together":
        return step + gap
    return _at_phase(step + (gap + 1) // 2, gap, index)


def _current_gap(state: State, group: Group) -> int:
    """The gap the parameter's schedule runs on (the adaptive one where it has one)."""
    if group["adaptive_refresh"] and "galore.gap" in state:
        return max(int(state["galore.gap"]), group["update_proj_gap"])
    return group["update_proj_gap"]


def _init_adaptive(state: State, group: Group) -> None:
    state["galore.gap"] = counter(group["update_proj_gap"])
    state["galore.streak"] = counter()
    state["galore.similarity"] = torch.tensor(float("nan"), dtype=torch.float32)


def _next_gap(state: State, group: Group, similarity: float | None) -> int:
    """Steps until the next refresh. Fixed (``update_proj_gap``) unless ``adaptive_refresh``:
    then, after ``refresh_patience`` refreshes in a row whose subspace overlap with the
    previous basis is ≥ ``refresh_threshold``, the gap doubles (up to
    ``max_update_proj_gap``, default 8·T); a refresh below the threshold halves it (never
    below T), since the subspace is moving."""
    base = group["update_proj_gap"]
    if not group["adaptive_refresh"]:
        return base
    if "galore.gap" not in state:  # adaptive refresh switched on after the state was made
        _init_adaptive(state, group)
    gap = max(int(state["galore.gap"]), base)
    if similarity is not None:
        state["galore.similarity"].fill_(similarity)
        cap = group["max_update_proj_gap"] or 8 * base
        if similarity >= group["refresh_threshold"]:
            state["galore.streak"] += 1
            if int(state["galore.streak"]) >= group["refresh_patience"]:
                gap = min(2 * gap, cap)
                state["galore.streak"].zero_()
        else:
            state["galore.streak"].zero_()
            gap = max(base, gap // 2)
    state["galore.gap"].fill_(gap)
    return gap


def wants_similarity(state: State, group: Group) -> bool:
    """Does the next successful refresh need the subspace overlap with the previous basis
    (``adaptive_refresh``, and a previous basis to compare with)?"""
    return int(state["galore.refreshes"]) > 0 and group["adaptive_refresh"]


def refreshed(
    state: State, group: Group, step: int, index: int, similarity: float | None
) -> None:
    """Count a successful refresh at ``step`` of parameter ``index`` (its phase when
    staggered) and plan the next one (``similarity``: the overlap of the new basis with
    the previous one, or None)."""
    state["galore.refreshes"] += 1
    gap = _next_gap(state, group, similarity)
    state["galore.next_refresh"].fill_(
        next_refresh(step, gap, group["refresh_schedule"], index)
    )


def stats(state: State, group: Group) -> dict[str, float] | None:
    """A parameter's refreshes so far, its current gap between refreshes (it varies with
    ``adaptive_refresh``) and the last measured subspace overlap (NaN if none); None
    without a schedule (a parameter GaLore does not project)."""
    if "galore.refreshes" not in state:
        return None
    gap = state.get("galore.gap")
    sim = state.get("galore.similarity")
    return {
        "refreshes": int(state["galore.refreshes"]),
        "gap": int(gap) if gap is not None else int(group["update_proj_gap"]),
        "similarity": float(sim) if sim is not None else float("nan"),
    }


def replan(old: dict[str, Any], group: Group, states: list[tuple[int, State]]) -> None:
    """Re-plan each projected parameter's next refresh after ``update_proj_gap`` (or the
    schedule) changed — on resume, or by an edit of ``param_groups`` between steps —
    so the new gap governs from the next step: the last refresh is placed where the old
    schedule put it (``next_refresh − old gap``), and the next one comes one new gap
    after it (at the parameter's phase when staggered); if that step has passed, the
    refresh is due at the next step (staggered: at the parameter's next phase, within
    one gap, so the change does not make every matrix refresh at once).

    A refresh already due at the next step — scheduled there, or pending after one that
    found no usable gradient (retried) — stays due there: the edit does not move it
    (the old schedule owes it, and a later one would leave the basis older than either
    gap says); the new gap counts from it. An adaptive gap is brought into the new
    range either way.

    Args:
        old: the :data:`WATCHED` options' values the state was scheduled with.
        group: the parameter group, with the new values.
        states: (parameter index, state) of the group's parameters that have state.
    """
    old_group = {**group, **old}
    for index, state in states:
        if "galore.next_refresh" not in state or int(state["galore.refreshes"]) == 0:
            continue  # not projected, or never refreshed: due at its next step anyway
        step, due = int(state["galore.step"]), int(state["galore.next_refresh"])
        last = due - _current_gap(state, old_group)
        if group["adaptive_refresh"] and "galore.gap" in state:  # keep it in the new range
            cap = group["max_update_proj_gap"] or 8 * group["update_proj_gap"]
            gap = min(max(int(state["galore.gap"]), group["update_proj_gap"]), cap)
            state["galore.gap"].fill_(gap)
        if due <= step:  # due at the next step, or pending (retried): it stays due
            continue
        gap = _current_gap(state, group)
        schedule = group["refresh_schedule"]
        due = next_refresh(last, gap, schedule, index)
        if due < step:  # overdue under the new gap
            due = step if schedule == "together" else _at_phase(step, gap, index)
        state["galore.next_refresh"].fill_(due)
