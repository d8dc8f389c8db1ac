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

from itertools import accumulate

from pipetrain.plan._graph import OVERLAP, RECV_B, RECV_F, SEND_B, SEND_F, B, F, I, W
from pipetrain.plan.actions import Action, new_action
from pipetrain.plan.dependencies import CODE, Dependencies
from pipetrain.plan.passes._insert import refuse_existing
from pipetrain.plan.passes._timing import UnitRun, unit_time_run
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
    cuts, acts = place_messages(schedule, unit_time_run(schedule))
    lowered: dict[int, list[Action | None]] = {}
    for r in range(schedule.num_ranks):
        comm, cut = acts[r], cuts[r]
        out: list[Action | None] = comm[: cut[0]]
        append = out.append
        p, j = cut[0], 0
        for a in schedule.actions[r]:
            if a is None:
                continue
            append(a)
            kind = a.kind
            if kind is F or kind is I or kind is W or kind is B or kind is OVERLAP:
                j += 1
                q = cut[j]
                if q > p:
                    out.extend(comm[p:q])
                    p = q
        lowered[r] = out
    return schedule._derived(lowered)


def place_messages(schedule: Schedule, run: UnitRun) -> tuple[list[list[int]], list[list[Action | None]]]:
    """Per rank, the SEND/RECV of every cross-rank message in time order, and where they go.

    ``cuts[r][k]`` counts rank r's messages that arrive by the start of its compute action k, so
    the gap after action k holds ``acts[r][cuts[r][k] : cuts[r][k + 1]]`` (the last entry is all
    of them). The producers are visited in order of start time (buckets of the unit-time run:
    linear) and each message goes to both its ranks at once: every rank's list is then in time
    order, and two ranks see the messages between them in the same order (FIFO), without sorting.
    """
    rank_of = [schedule.stage_to_rank[s] for s in range(schedule.num_stages)]
    horizon = run.makespan + 1
    arrivals = [[0] * (horizon + 1) for _ in range(schedule.num_ranks)]  # messages per arrival time
    acts: list[list[Action | None]] = [[] for _ in range(schedule.num_ranks)]
    new = new_action  # hundreds of thousands of actions: one C call each
    outgoing = Dependencies(schedule.num_stages, schedule.num_microbatches, rank_of, lowered=True).outgoing
    codes = CODE
    for st, bucket in enumerate(run.by_time):
        end_time = st + 1
        for part in bucket:
            s = part.stage
            m = part.microbatch
            r = rank_of[s]
            send_kind, recv_kind, to = outgoing[codes[part.kind]][s]  # type: ignore[misc]
            d = rank_of[to]
            send = new(Action, (s, send_kind, m, None))
            recv = new(Action, (to, recv_kind, m, None))
            arrivals[r][end_time] += 1
            acts[r].append(send)
            arrivals[d][end_time] += 1
            acts[d].append(recv)
    cuts = []
    for r in range(schedule.num_ranks):
        upto = list(accumulate(arrivals[r]))  # messages arrived by each time
        cut = [upto[t] for t in run.starts[r]]
        cut.append(len(acts[r]))
        cuts.append(cut)
    return cuts, acts
