"""The gradient-reduction pass: REDUCE_GRAD right after each stage's last backward (B or W)."""

from __future__ import annotations

from pipetrain.plan.actions import Action, make_action
from pipetrain.plan.errors import ScheduleError
from pipetrain.plan.passes._graph import RECV_B, RECV_F, REDUCE_GRAD, SEND_B, SEND_F, B, W
from pipetrain.plan.passes._insert import compute_parts, insert_around_compute, refuse_existing
from pipetrain.plan.schedule import Schedule

_SKIP_AFTER = frozenset({SEND_F, RECV_F, SEND_B, RECV_B})


def add_grad_reduction(schedule: Schedule) -> Schedule:
    """Return ``schedule`` with one REDUCE_GRAD per stage after its last B or W.

    It goes after the SEND/RECV run that follows that action, if any, so that run stays one
    communication group. A forward-only schedule has no gradients: ScheduleError.
    """
    refuse_existing(schedule, frozenset({REDUCE_GRAD}), "REDUCE_GRAD actions")
    return grad_reduction_pass(schedule)


def grad_reduction_pass(schedule: Schedule) -> Schedule:
    """:func:`add_grad_reduction` without the repeat check (for ``lower``)."""
    programs = [schedule.actions[r] for r in range(schedule.num_ranks)]
    out: dict[int, list[Action | None]] = {}
    any_backward = False
    for r, program in enumerate(programs):
        parts = compute_parts(program)
        last: dict[int, int] = {}
        for k, group in enumerate(parts):
            for part in group:
                if part.kind is B or part.kind is W:
                    last[part.stage] = k
        any_backward = any_backward or bool(last)
        after: list[list[Action] | None] = [None] * len(parts)
        for s in sorted(last):
            k = last[s]
            bucket = after[k]
            if bucket is None:
                after[k] = [make_action(s, REDUCE_GRAD)]
            else:
                bucket.append(make_action(s, REDUCE_GRAD))
        out[r] = insert_around_compute(program, [None] * len(parts), after, _SKIP_AFTER)
    if not any_backward:
        raise ScheduleError("a forward-only schedule has no gradients to reduce (REDUCE_GRAD needs B or W)")
    return schedule._derived(out)
