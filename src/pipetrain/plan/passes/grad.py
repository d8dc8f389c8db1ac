"""The gradient-reduction pass: REDUCE_GRAD right after each stage's last backward (B or W)."""

from __future__ import annotations

from collections.abc import Sequence

from pipetrain.plan.actions import Action, make_action
from pipetrain.plan.errors import ScheduleError
from pipetrain.plan.passes._graph import RECV_B, RECV_F, REDUCE_GRAD, SEND_B, SEND_F, B, W
from pipetrain.plan.passes._insert import compute_actions, insert_around_compute, refuse_existing
from pipetrain.plan.schedule import Schedule

_SKIP_AFTER = frozenset({SEND_F, RECV_F, SEND_B, RECV_B})
FORWARD_ONLY = "a forward-only schedule has no gradients to reduce (REDUCE_GRAD needs B or W)"


def add_grad_reduction(schedule: Schedule) -> Schedule:
    """Return ``schedule`` with one REDUCE_GRAD per stage after its last B or W.

    It goes after the SEND/RECV run that follows that action, if any, so that run stays one
    communication group. A forward-only schedule has no gradients: ScheduleError.
    """
    refuse_existing(schedule, frozenset({REDUCE_GRAD}), "REDUCE_GRAD actions")
    return grad_reduction_pass(schedule)


def grad_reduction_pass(schedule: Schedule) -> Schedule:
    """:func:`add_grad_reduction` without the repeat check (for ``lower``)."""
    out: dict[int, list[Action | None]] = {}
    any_backward = False
    for r in range(schedule.num_ranks):
        program = schedule.actions[r]
        computes = compute_actions(program)
        after = reduce_slots(computes)
        any_backward = any_backward or any(after)
        out[r] = insert_around_compute(program, [None] * len(computes), after, _SKIP_AFTER)
    if not any_backward:
        raise ScheduleError(FORWARD_ONLY)
    return schedule._derived(out)


def reduce_slots(computes: Sequence[Action]) -> list[list[Action] | None]:
    """The REDUCE_GRAD actions after each compute action of one rank (indexed like ``computes``)."""
    last: dict[int, int] = {}
    for k, action in enumerate(computes):
        subs = action.sub_actions
        if subs is None:
            kind = action.kind
            if kind is B or kind is W:
                last[action.stage] = k
        else:
            for part in subs:
                if part.kind is B or part.kind is W:
                    last[part.stage] = k
    after: list[list[Action] | None] = [None] * len(computes)
    for s in sorted(last):
        k = last[s]
        bucket = after[k]
        if bucket is None:
            after[k] = [make_action(s, REDUCE_GRAD)]
        else:
            bucket.append(make_action(s, REDUCE_GRAD))
    return after
