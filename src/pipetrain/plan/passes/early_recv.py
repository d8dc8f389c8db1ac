"""Early receives: a lowering option that moves RECV actions ahead of their place.

A receive posted before its peer posts the matching send lets the data go out at once; posted
where the communication pass places it (often after the send), the data waits for a round trip
(gloo sends once the receiver has announced its buffer). This pass moves receives earlier, at
most ``ahead`` beyond their place, so the price (a buffer per receive, from the moment it is
posted) stays bounded whatever the number of microbatches.

Which receives: all of those from a peer that sends this rank gradients, and none from other
peers (measured on 2 gloo ranks, also moving a last stage's activation receives made 1F1B about
1.9x slower, while moving gradient receives made every schedule faster). All of a peer's
receives move or none, in program order, so the order of the receives per peer is unchanged.

Backends differ in what that order means (docs/semantics.md, "Matching"): where operations match
per peer and tag (gloo), the result matches and completes exactly as the input did. Where they
match in posting order within groups (NCCL), a receive moved into an earlier group can wait for a
send its peer makes only after this rank's later groups: the pass is for per-tag backends.
"""

from __future__ import annotations

from pipetrain.plan.actions import Action, ActionKind
from pipetrain.plan.dependencies import Dependencies
from pipetrain.plan.errors import ScheduleError
from pipetrain.plan.schedule import Schedule

__all__ = ["early_receives", "post_receives_early"]

_RECV_F, _RECV_B = ActionKind.RECV_F, ActionKind.RECV_B


def post_receives_early(schedule: Schedule, ahead: int) -> Schedule:
    """``schedule`` (lowered) with each rank's early receives moved up to ``ahead`` groups' worth ahead.

    The first ``ahead`` of them go at the start of the program; at each later communication group
    the rank posts its own other actions, then early receives until ``ahead`` are posted beyond
    those whose place is this group or earlier. ``ahead=0`` returns the schedule unchanged.
    """
    if isinstance(ahead, bool) or not isinstance(ahead, int) or ahead < 0:
        raise ScheduleError(f"recv_ahead (the receive window) must be an integer >= 0, got {ahead!r}")
    if ahead == 0 or not schedule.is_lowered:
        return schedule
    where = schedule.stage_to_rank
    out: dict[int, list[Action | None]] = {}
    for rank in range(schedule.num_ranks):
        out[rank] = _rank(schedule.actions[rank], where, ahead)
    return schedule._derived(out)


def early_receives(program: list[Action | None], where: dict[int, int]) -> list[Action]:
    """The receives of ``program`` that may move: all of those from peers that send it gradients."""
    stages = len(where)
    # Who sends what a receive receives is the core's route (the microbatch count does not matter).
    routes = Dependencies(stages, 1, [where[s] for s in range(stages)], lowered=True)
    recvs = [a for a in program if a is not None and (a.kind is _RECV_F or a.kind is _RECV_B)]
    sender = {a: where[routes.route(a)[1]] for a in recvs}
    peers = {sender[a] for a in recvs if a.kind is _RECV_B}
    return [a for a in recvs if sender[a] in peers]


def _rank(program: list[Action | None], where: dict[int, int], ahead: int) -> list[Action | None]:
    early = early_receives(program, where)
    if not early:
        return list(program)
    moved = set(early)  # an action occurs once in a valid program
    out: list[Action | None] = list(early[:ahead])
    posted = len(out)
    due = 0  # early receives whose own place has been reached
    i, n = 0, len(program)
    while i < n:
        action = program[i]
        if action is None or not action.kind.is_comm:
            out.append(action)
            i += 1
            continue
        while i < n:
            a = program[i]
            if a is None or not a.kind.is_comm:
                break
            if a in moved:
                due += 1
            else:
                out.append(a)
            i += 1
        target = min(due + ahead, len(early))
        if target > posted:
            out.extend(early[posted:target])
            posted = target
    return out
