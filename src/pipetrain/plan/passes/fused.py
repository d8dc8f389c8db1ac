"""All lowering passes in one sweep per rank, for ``lower`` with communication.

``lower(comms=True, ...)`` produces exactly what the separate passes produce one after another
(gradient reduction, then FSDP, then communication; see their modules for the rules): around
compute action k of a rank come its UNSHARDs, the action, the messages of the gap after it,
its REDUCE_GRADs, then its RESHARDs; the messages arriving before the first compute action
open the program. Doing it in one sweep saves building, scanning and freeing two intermediate
schedules of hundreds of thousands of actions. The input is a validated compute-only schedule.
"""

from __future__ import annotations

from bisect import bisect_right

from pipetrain.plan.actions import Action
from pipetrain.plan.errors import ScheduleError
from pipetrain.plan.passes._insert import refuse_lowered
from pipetrain.plan.passes._timing import unit_time_run
from pipetrain.plan.passes.communication import collect_messages
from pipetrain.plan.passes.fsdp import Slots, fsdp_actions, fsdp_slots
from pipetrain.plan.passes.grad import FORWARD_ONLY, reduce_slots, stage_counts
from pipetrain.plan.schedule import Schedule


def lower_compute(schedule: Schedule, *, grad_reduce: bool, fsdp: bool, prefetch: int) -> Schedule:
    """``schedule`` (compute-only) with SEND/RECV, and REDUCE_GRAD / FSDP actions if asked.

    Raises :class:`ScheduleError` if the schedule is not valid (the unit-time run checks it and
    asks ``validate()`` for the details), is already lowered, or, with ``grad_reduce``, has no
    backward.
    """
    starts, by_time, makespan, not_compute = unit_time_run(schedule)
    if not_compute:
        refuse_lowered(schedule)
    times, acts = collect_messages(schedule, by_time)
    unshard, reshard = fsdp_actions(schedule.num_stages) if fsdp else ([], [])
    any_backward = False
    counts = stage_counts(schedule)
    lowered: dict[int, list[Action | None]] = {}
    for r in range(schedule.num_ranks):
        computes = [a for a in schedule.actions[r] if a is not None]
        n = len(computes)
        empty: Slots = [None] * n
        before, after = empty, empty
        reduce = empty
        if grad_reduce or fsdp:
            if grad_reduce:
                reduce = reduce_slots(computes, counts[r])
                any_backward = any_backward or any(reduce)
            if fsdp:
                before, after = fsdp_slots(computes, prefetch, unshard, reshard)
        # A message goes into the gap after compute action k when it arrives by the start of
        # action k + 1 (by the start of the first one: before it; past the end: after the last).
        bounds = starts[r]
        bounds.append(makespan + 1)
        ev, comm = times[r], acts[r]
        p = bisect_right(ev, bounds[0])
        out: list[Action | None] = []
        append, extend = out.append, out.extend
        extend(comm[:p])
        for action, first, bound, second, third in zip(computes, before, bounds[1:], reduce, after, strict=True):
            if first:
                extend(first)
            append(action)
            q = bisect_right(ev, bound, p)
            if q > p:
                extend(comm[p:q])
                p = q
            if second:
                extend(second)
            if third:
                extend(third)
        lowered[r] = out
    if grad_reduce and not any_backward:
        raise ScheduleError(FORWARD_ONLY)
    return schedule._derived(lowered)
