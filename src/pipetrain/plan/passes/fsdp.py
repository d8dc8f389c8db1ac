"""The FSDP pass: UNSHARD a stage shortly before it computes, RESHARD it when it must make room.

Each rank walks its compute actions. A stage is gathered from ``prefetch`` compute actions before
each use through that use (its *window*), and freed right after its last use of the step. Between
two uses it stays gathered while the rank has room: at most ``max_unsharded`` stages at once
(torch's ``max_active_stages``, 3 by default there and here). When a gather would exceed that,
the idle stage (not in its window) used furthest in the future is freed, right after its last
use (Belady's rule, optimal for a plain cache; a heuristic here, where windows overlap). Stages
whose windows overlap are gathered together even beyond the limit. With ``max_unsharded=1`` a
stage is freed as soon as its window ends, so at every compute action exactly the stages used in
the next ``prefetch + 1`` are gathered; with at least as many as the rank holds, each stage is
gathered once per step. Linear in the number of actions for a given limit (torch 2.13's pass
rescans the rest of the list per action: quadratic).
"""

from __future__ import annotations

from collections.abc import Sequence

from pipetrain.plan._graph import RECV_B, RECV_F, REDUCE_GRAD, RESHARD, SEND_B, SEND_F, UNSHARD
from pipetrain.plan.actions import Action, make_action
from pipetrain.plan.errors import ScheduleError
from pipetrain.plan.passes._insert import compute_actions, insert_around_compute, refuse_existing
from pipetrain.plan.schedule import Schedule

_SKIP_AFTER = frozenset({SEND_F, RECV_F, SEND_B, RECV_B, REDUCE_GRAD})

DEFAULT_MAX_UNSHARDED = 3
"""Stages a rank keeps gathered at once by default (torch's ``max_active_stages``)."""

Slots = list[list[Action] | None]


def add_fsdp(schedule: Schedule, prefetch: int = 1, max_unsharded: int | None = DEFAULT_MAX_UNSHARDED) -> Schedule:
    """Return ``schedule`` with UNSHARD/RESHARD for every stage (see the module docstring)."""
    check_fsdp_options(prefetch, max_unsharded)
    refuse_existing(schedule, frozenset({UNSHARD, RESHARD}), "UNSHARD/RESHARD actions")
    return fsdp_pass(schedule, prefetch, max_unsharded)


def check_fsdp_options(prefetch: object, max_unsharded: object) -> None:
    """Raise naming the bad option: ``prefetch`` an integer >= 0, ``max_unsharded`` one >= 1 or None."""
    if isinstance(prefetch, bool) or not isinstance(prefetch, int) or prefetch < 0:
        raise ScheduleError(f"FSDP prefetch must be an integer >= 0 (compute actions ahead), got {prefetch!r}")
    if max_unsharded is not None and (
        isinstance(max_unsharded, bool) or not isinstance(max_unsharded, int) or max_unsharded < 1
    ):
        raise ScheduleError(
            f"FSDP max_unsharded must be an integer >= 1 (stages gathered at once per rank) or None "
            f"(no limit), got {max_unsharded!r}"
        )


def fsdp_pass(schedule: Schedule, prefetch: int, max_unsharded: int | None) -> Schedule:
    """:func:`add_fsdp` without the argument and repeat checks (for ``lower``)."""
    out: dict[int, list[Action | None]] = {}
    unshard, reshard = fsdp_actions(schedule.num_stages)
    for r in range(schedule.num_ranks):
        program = schedule.actions[r]
        before, after = fsdp_slots(compute_actions(program), prefetch, max_unsharded, unshard, reshard)
        out[r] = insert_around_compute(program, before, after, _SKIP_AFTER)
    return schedule._derived(out)


def fsdp_actions(num_stages: int) -> tuple[list[Action], list[Action]]:
    """One UNSHARD and one RESHARD per stage, shared by every place that needs it (actions are
    immutable; building tens of thousands of equal ones would only cost time)."""
    return (
        [make_action(s, UNSHARD) for s in range(num_stages)],
        [make_action(s, RESHARD) for s in range(num_stages)],
    )


def fsdp_slots(
    computes: Sequence[Action],
    prefetch: int,
    max_unsharded: int | None,
    unshard: list[Action],
    reshard: list[Action],
) -> tuple[Slots, Slots]:
    """What goes before and after each compute action of one rank (indexed like ``computes``)."""
    n = len(computes)
    before: Slots = [None] * n
    after: Slots = [None] * n
    if not n:
        return before, after
    stages, _, _, subs = zip(*computes, strict=True)  # (columns, in C: this runs once per rank)
    if subs.count(None) == n:  # no OVERLAP_F_B: one stage per action
        first = {s: stages.index(s) for s in set(stages)}
        if max_unsharded is None or len(first) <= max_unsharded:
            # Room for every stage: gathered once, ``prefetch`` actions before its first use,
            # freed after its last.
            backwards = stages[::-1]
            for s in sorted(first, key=first.__getitem__):
                _add(before, max(0, first[s] - prefetch), unshard[s])
                _add(after, n - 1 - backwards.index(s), reshard[s])
            return before, after
    # Each stage's uses, in order (an OVERLAP_F_B uses the stages of its parts).
    uses: dict[int, list[int]] = {}
    for k, action in enumerate(computes):
        parts = action.sub_actions
        for s in dict.fromkeys(p.stage for p in parts) if parts is not None else (action.stage,):
            row = uses.get(s)
            if row is None:
                uses[s] = [k]
            else:
                row.append(k)
    if max_unsharded is None or len(uses) <= max_unsharded:  # (as above)
        for s, row in uses.items():
            _add(before, max(0, row[0] - prefetch), unshard[s])
            _add(after, row[-1], reshard[s])
        return before, after
    _bounded(computes, uses, prefetch, max_unsharded, before, after, unshard, reshard)
    return before, after


def _bounded(
    computes: Sequence[Action],
    uses: dict[int, list[int]],
    prefetch: int,
    limit: int,
    before: Slots,
    after: Slots,
    unshard: list[Action],
    reshard: list[Action],
) -> None:
    """:func:`fsdp_slots` when the rank holds more stages than ``limit``: the walk of the module
    docstring. ``held`` maps each gathered stage to its latest use so far. At compute action ``k``,
    whose gathers go in slot ``t``, a held stage is idle if its latest use came before ``t`` and its
    next use comes after ``k`` (a use at ``k`` has its window open at ``t``: freeing the stage would
    gather it straight back); freeing it means a RESHARD right after its latest use."""
    held: dict[int, int] = {}
    seen = dict.fromkeys(uses, 0)  # per stage, how many of its uses have been walked
    never = len(computes)

    def next_use(s: int) -> int:
        row = uses[s]
        return row[seen[s]] if seen[s] < len(row) else never

    def free_idle(t: int, k: int, room: int) -> None:
        """Free idle stages, furthest next use first (done ones first), until at most ``room`` are held."""
        while len(held) > room:
            idle = [s for s, last in held.items() if last < t and next_use(s) > k]
            if not idle:
                return
            s = max(idle, key=next_use)
            _add(after, held.pop(s), reshard[s])

    for k, action in enumerate(computes):
        t = max(0, k - prefetch)  # the slot where a gather for this use goes
        free_idle(t, k, limit)
        parts = action.sub_actions
        for s in dict.fromkeys(p.stage for p in parts) if parts is not None else (action.stage,):
            if s not in held:
                free_idle(t, k, limit - 1)
                _add(before, t, unshard[s])
            held[s] = k
            seen[s] += 1
    # A stage past its last use that never had to make room is freed right after that use too.
    for s, last in held.items():
        _add(after, last, reshard[s])


def _add(slots: Slots, k: int, action: Action) -> None:
    bucket = slots[k]
    if bucket is None:
        slots[k] = [action]
    else:
        bucket.append(action)
