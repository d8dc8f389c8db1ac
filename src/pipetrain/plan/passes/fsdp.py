"""The FSDP pass: UNSHARD a stage shortly before it computes, RESHARD it when not needed soon.

A sliding window over each rank's compute actions: stage s is unsharded at the gap before compute
action k when s is used by one of actions k .. k + prefetch. So UNSHARD comes ``prefetch`` compute
actions ahead of a use, and RESHARD right after a use when the next use is further away than the
window. Linear in the number of actions (torch 2.13's pass rescans the rest of the list per
action: quadratic).
"""

from __future__ import annotations

from collections.abc import Sequence

from pipetrain.plan._graph import RECV_B, RECV_F, REDUCE_GRAD, RESHARD, SEND_B, SEND_F, UNSHARD
from pipetrain.plan.actions import Action, make_action
from pipetrain.plan.errors import ScheduleError
from pipetrain.plan.passes._insert import compute_actions, insert_around_compute, refuse_existing
from pipetrain.plan.schedule import Schedule

_SKIP_AFTER = frozenset({SEND_F, RECV_F, SEND_B, RECV_B, REDUCE_GRAD})

Slots = list[list[Action] | None]


def add_fsdp(schedule: Schedule, prefetch: int = 1) -> Schedule:
    """Return ``schedule`` with UNSHARD/RESHARD for every stage (see the module docstring)."""
    check_prefetch(prefetch)
    refuse_existing(schedule, frozenset({UNSHARD, RESHARD}), "UNSHARD/RESHARD actions")
    return fsdp_pass(schedule, prefetch)


def check_prefetch(prefetch: object) -> None:
    if isinstance(prefetch, bool) or not isinstance(prefetch, int) or prefetch < 0:
        raise ScheduleError(f"FSDP prefetch must be an integer >= 0 (compute actions ahead), got {prefetch!r}")


def fsdp_pass(schedule: Schedule, prefetch: int) -> Schedule:
    """:func:`add_fsdp` without the argument and repeat checks (for ``lower``)."""
    out: dict[int, list[Action | None]] = {}
    unshard, reshard = fsdp_actions(schedule.num_stages)
    for r in range(schedule.num_ranks):
        program = schedule.actions[r]
        before, after = fsdp_slots(compute_actions(program), prefetch, unshard, reshard)
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
    computes: Sequence[Action], prefetch: int, unshard: list[Action], reshard: list[Action]
) -> tuple[Slots, Slots]:
    """What goes before and after each compute action of one rank (indexed like ``computes``).

    A list indexed by stage holds each stage's last use, and a plain action (no sub-actions)
    takes no tuple of parts: this runs once per compute action of the schedule.
    """
    n = len(computes)
    before: Slots = [None] * n
    after: Slots = [None] * n
    last_use = [-1] * len(unshard)
    first_seen: list[int] = []  # stages in order of first use
    window = prefetch + 1

    def use(s: int, k: int) -> None:
        prev = last_use[s]
        if prev >= 0 and k - prev <= window:  # still unsharded from the last use (or this one)
            last_use[s] = k
            return
        if prev >= 0:
            _add(after, prev, reshard[s])
            _add(before, k - prefetch, unshard[s])
        else:
            first_seen.append(s)
            _add(before, max(0, k - prefetch), unshard[s])
        last_use[s] = k

    for k, action in enumerate(computes):
        s, _, _, subs = action
        if subs is not None:
            for part in subs:
                use(part.stage, k)
            continue
        # use(s, k), inline: this runs once per compute action of the schedule.
        prev = last_use[s]
        last_use[s] = k
        if prev >= 0:
            if k - prev <= window:
                continue
            slot = after[prev]
            if slot is None:
                after[prev] = [reshard[s]]
            else:
                slot.append(reshard[s])
            k_before = k - prefetch
        else:
            first_seen.append(s)
            k_before = max(0, k - prefetch)
        slot = before[k_before]
        if slot is None:
            before[k_before] = [unshard[s]]
        else:
            slot.append(unshard[s])
    for s in first_seen:
        _add(after, last_use[s], reshard[s])
    return before, after


def _add(slots: Slots, k: int, action: Action) -> None:
    bucket = slots[k]
    if bucket is None:
        slots[k] = [action]
    else:
        bucket.append(action)
