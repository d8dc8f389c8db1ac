"""The gradient-reduction pass: REDUCE_GRAD right after each stage's last backward (B or W)."""

from __future__ import annotations

from collections.abc import Sequence

from pipetrain.plan._graph import RECV_B, RECV_F, REDUCE_GRAD, SEND_B, SEND_F, B, W
from pipetrain.plan.actions import Action, make_action
from pipetrain.plan.errors import ScheduleError
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
    counts = stage_counts(schedule)
    for r in range(schedule.num_ranks):
        program = schedule.actions[r]
        computes = compute_actions(program)
        after = reduce_slots(computes, counts[r])
        any_backward = any_backward or any(after)
        out[r] = insert_around_compute(program, [None] * len(computes), after, _SKIP_AFTER)
    if not any_backward:
        raise ScheduleError(FORWARD_ONLY)
    return schedule._derived(out)


def reduce_slots(computes: Sequence[Action], num_stages_here: int) -> list[list[Action] | None]:
    """The REDUCE_GRAD actions after each compute action of one rank (indexed like ``computes``).

    The scan runs backwards and stops once each of the rank's ``num_stages_here`` stages has
    shown its last B or W: usually a few actions from the end.
    """
    last: dict[int, int] = {}
    for k in range(len(computes) - 1, -1, -1):
        action = computes[k]
        for part in action.parts:
            if (part.kind is B or part.kind is W) and part.stage not in last:
                last[part.stage] = k
        if len(last) >= num_stages_here:
            break
    after: list[list[Action] | None] = [None] * len(computes)
    for s in sorted(last):
        k = last[s]
        bucket = after[k]
        if bucket is None:
            after[k] = [make_action(s, REDUCE_GRAD)]
        else:
            bucket.append(make_action(s, REDUCE_GRAD))
    return after


def stage_counts(schedule: Schedule) -> list[int]:
    """How many stages each rank holds."""
    counts = [0] * schedule.num_ranks
    for r in schedule.stage_to_rank.values():
        counts[r] += 1
    return counts
