"""All lowering passes in one sweep per rank, for ``lower`` with communication.

``lower(comms=True, ...)`` produces exactly what the separate passes produce one after another
(gradient reduction, then FSDP, then communication; see their modules for the rules): around
compute action k of a rank come its UNSHARDs, the action, the messages of the gap after it,
its REDUCE_GRADs, then its RESHARDs; the messages arriving before the first compute action
open the program. Doing it in one sweep saves building, scanning and freeing two intermediate
schedules of hundreds of thousands of actions. The input is a compute-only schedule; the
unit-time run checks it on the way (see :mod:`~pipetrain.plan.passes._timing`).
"""

from __future__ import annotations

from pipetrain.plan.actions import Action
from pipetrain.plan.errors import ScheduleError
from pipetrain.plan.passes._insert import refuse_lowered
from pipetrain.plan.passes._timing import unit_time_run
from pipetrain.plan.passes.communication import place_messages
from pipetrain.plan.passes.fsdp import Slots, fsdp_actions, fsdp_slots
from pipetrain.plan.passes.grad import FORWARD_ONLY, reduce_slots, stage_counts
from pipetrain.plan.schedule import Schedule


def lower_compute(
    schedule: Schedule, *, grad_reduce: bool, fsdp: bool, prefetch: int, max_unsharded: int | None
) -> Schedule:
    """``schedule`` (compute-only) with SEND/RECV, and REDUCE_GRAD / FSDP actions if asked.

    Raises :class:`ScheduleError` if the schedule is not valid (the unit-time run checks it and
    asks ``validate()`` for the details), is already lowered, or, with ``grad_reduce``, has no
    backward.
    """
    run = unit_time_run(schedule)
    if run.lowered_actions:
        refuse_lowered(schedule)
    cuts, acts = place_messages(schedule, run)
    unshard, reshard = fsdp_actions(schedule.num_stages) if fsdp else ([], [])
    any_backward = False
    counts = stage_counts(schedule)
    lowered: dict[int, list[Action | None]] = {}
    for r in range(schedule.num_ranks):
        computes = [a for a in schedule.actions[r] if a is not None]
        # The gap after compute action k holds comm[cut[k] : cut[k + 1]] (see place_messages).
        comm, cut = acts[r], cuts[r]
        out: list[Action | None] = comm[: cut[0]]
        append, extend = out.append, out.extend
        if not (grad_reduce or fsdp):
            p = cut[0]
            for action, q in zip(computes, cut[1:], strict=True):
                append(action)
                if q > p:
                    extend(comm[p:q])
                    p = q
            lowered[r] = out
            continue
        n = len(computes)
        none: Slots = [None] * n
        before, after = fsdp_slots(computes, prefetch, max_unsharded, unshard, reshard) if fsdp else (none, list(none))
        if grad_reduce:
            # REDUCE_GRAD comes before the RESHARDs after the same action.
            for k, reduce in enumerate(reduce_slots(computes, counts[r])):
                if reduce:
                    any_backward = True
                    after[k] = reduce + (after[k] or [])
        p = cut[0]
        for action, first, q, last in zip(computes, before, cut[1:], after, strict=True):
            if first:
                extend(first)
            append(action)
            if q > p:
                extend(comm[p:q])
                p = q
            if last:
                extend(last)
        lowered[r] = out
    if grad_reduce and not any_backward:
        raise ScheduleError(FORWARD_ONLY)
    return schedule._derived(lowered)
