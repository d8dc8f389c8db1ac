"""The communication pass: a SEND after each producer and a RECV before each consumer on another rank.

Placement, which makes the result deadlock-free under the strict (NCCL) model of docs/semantics.md:
run the compute schedule in unit time (:func:`~pipetrain.plan.passes._timing.unit_time_run`). A message produced by an action
ending at time T is sent right after the producer and received on the consumer's rank in the gap
holding time T (after the actions that started before T, before those starting at T or later), so
the receive is posted as early as the data can exist and before its consumer. Both ends of every
message are listed in one sweep over time, so the k-th SEND from a to b matches the k-th RECV on
b from a (FIFO), with no sorting: the pass is linear.

Why it cannot deadlock: by induction on T, every group holding a time-T message starts once the
messages before T completed (its rank has reached it: the compute before it needs only messages
of earlier times; the group before it holds only earlier messages), and both ends of every
time-T message are in such groups, so all of them complete.
"""

from __future__ import annotations

from bisect import bisect_right

from pipetrain.plan.actions import Action, new_action
from pipetrain.plan.passes._graph import OVERLAP, RECV_B, RECV_F, SEND_B, SEND_F, B, F, I, W
from pipetrain.plan.passes._insert import refuse_existing
from pipetrain.plan.passes._timing import unit_time_run
from pipetrain.plan.schedule import Schedule

_COMM_KINDS = frozenset({SEND_F, RECV_F, SEND_B, RECV_B})


def add_communication(schedule: Schedule) -> Schedule:
    """Return ``schedule`` with SEND/RECV for every dependency between stages on different ranks.

    Stages on the same rank (V placement) exchange nothing. Idle steps are dropped: a lowered
    schedule's timing comes from its messages. Raises ScheduleError if the schedule already has
    SEND/RECV or cannot run.
    """
    refuse_existing(schedule, _COMM_KINDS, "SEND/RECV actions (it is already lowered)")
    return communication_pass(schedule)


def communication_pass(schedule: Schedule) -> Schedule:
    """:func:`add_communication` without the check for existing SEND/RECV (for ``lower``)."""
    starts, by_time, makespan, _ = unit_time_run(schedule)
    times, acts = collect_messages(schedule, by_time)
    lowered: dict[int, list[Action | None]] = {}
    for r in range(schedule.num_ranks):
        program = schedule.actions[r]
        row = starts[r]
        ev, comm = times[r], acts[r]
        out: list[Action | None] = []
        append = out.append
        # The messages of the gap after a compute action (placed right after it) are those that
        # arrive by the next compute action's start; before the first compute, by its start.
        bounds = [*row, makespan + 1]
        p = bisect_right(ev, bounds[0])
        out.extend(comm[:p])
        j = 0
        for a in program:
            if a is None:
                continue
            append(a)
            kind = a.kind
            if kind is F or kind is I or kind is W or kind is B or kind is OVERLAP:
                j += 1
                q = bisect_right(ev, bounds[j], p)
                if q > p:
                    out.extend(comm[p:q])
                    p = q
        lowered[r] = out
    return schedule._derived(lowered)


def collect_messages(schedule: Schedule, by_time: list[list[Action]]) -> tuple[list[list[int]], list[list[Action]]]:
    """Per rank, the SEND/RECV of every cross-rank message and the time each arrives, in time order.

    ``by_time`` holds the message producers bucketed by start time (from
    :func:`~pipetrain.plan.passes._timing.unit_time_run`): visiting them in order (linear) and
    giving each message to both its ranks at once puts every rank's list in time order, and two
    ranks see the messages between them in the same order (FIFO), without sorting.
    """
    num_ranks, num_stages = schedule.num_ranks, schedule.num_stages
    rank_of = [schedule.stage_to_rank[s] for s in range(num_stages)]
    times: list[list[int]] = [[] for _ in range(num_ranks)]  # arrival time of each message, per rank
    acts: list[list[Action]] = [[] for _ in range(num_ranks)]
    new = new_action  # hundreds of thousands of actions: one C call each
    for st, bucket in enumerate(by_time):
        end_time = st + 1
        for part in bucket:
            s = part.stage
            m = part.microbatch
            r = rank_of[s]
            if part.kind is F:
                d = rank_of[s + 1]
                send = new(Action, (s, SEND_F, m, None))
                recv = new(Action, (s + 1, RECV_F, m, None))
            else:  # B or I: the input gradient goes back
                d = rank_of[s - 1]
                send = new(Action, (s, SEND_B, m, None))
                recv = new(Action, (s - 1, RECV_B, m, None))
            times[r].append(end_time)
            acts[r].append(send)
            times[d].append(end_time)
            acts[d].append(recv)
    return times, acts
