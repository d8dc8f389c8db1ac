"""The FSDP pass: UNSHARD a stage shortly before it computes, RESHARD it when not needed soon.

A sliding window over each rank's compute actions: stage s is unsharded at the gap before compute
action k when s is used by one of actions k .. k + prefetch. So UNSHARD comes ``prefetch`` compute
actions ahead of a use, and RESHARD right after a use when the next use is further away than the
window. Linear in the number of actions (torch 2.13's pass rescans the rest of the list per
action: quadratic).
"""

from __future__ import annotations

from pipetrain.plan.actions import Action, make_action
from pipetrain.plan.errors import ScheduleError
from pipetrain.plan.passes._graph import RECV_B, RECV_F, REDUCE_GRAD, RESHARD, SEND_B, SEND_F, UNSHARD
from pipetrain.plan.passes._insert import compute_parts, insert_around_compute, refuse_existing
from pipetrain.plan.schedule import Schedule

_SKIP_AFTER = frozenset({SEND_F, RECV_F, SEND_B, RECV_B, REDUCE_GRAD})


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
    programs = [schedule.actions[r] for r in range(schedule.num_ranks)]
    out: dict[int, list[Action | None]] = {}
    for r, program in enumerate(programs):
        parts = compute_parts(program)
        n = len(parts)
        before: list[list[Action] | None] = [None] * n
        after: list[list[Action] | None] = [None] * n
        last_use: dict[int, int] = {}
        for k, group in enumerate(parts):
            for part in group:
                s = part.stage
                prev = last_use.get(s)
                if prev == k:
                    continue
                if prev is None or k - prev > prefetch + 1:
                    if prev is not None:
                        _add(after, prev, make_action(s, RESHARD))
                    _add(before, max(0, k - prefetch) if prev is None else k - prefetch, make_action(s, UNSHARD))
                last_use[s] = k
        for s, k in last_use.items():
            _add(after, k, make_action(s, RESHARD))
        out[r] = insert_around_compute(program, before, after, _SKIP_AFTER)
    return schedule._derived(out)


def _add(slots: list[list[Action] | None], k: int, action: Action) -> None:
    bucket = slots[k]
    if bucket is None:
        slots[k] = [action]
    else:
        bucket.append(action)
