"""The communication pass: a SEND after each producer and a RECV before each consumer on another rank.

Placement, which makes the result deadlock-free under the strict (NCCL) model of docs/semantics.md:
run the compute schedule in unit time (:func:`unit_time_starts`). A message produced by an action
ending at time T is sent right after the producer and received on the consumer's rank in the gap
holding time T (after the actions that started before T, before those starting at T or later), so
the receive is posted as early as the data can exist and before its consumer. Within a gap the
messages are sorted by (T, message id) on both ranks, so the k-th SEND from a to b matches the
k-th RECV on b from a.

Why it cannot deadlock: by induction on T, every group holding a time-T message starts once the
messages before T completed (its rank has reached it: the compute before it needs only messages
of earlier times; the group before it holds only earlier messages), and both ends of every
time-T message are in such groups, so all of them complete.
"""

# ruff: noqa: N806 - S, M, SM, R: stages, microbatches, their product, ranks (the papers' notation)

from __future__ import annotations

from pipetrain.plan.actions import Action, make_action
from pipetrain.plan.passes._graph import RECV_B, RECV_F, SEND_B, SEND_F, B, F, I, Ids, cross_rank_flags
from pipetrain.plan.passes._insert import refuse_existing
from pipetrain.plan.passes._timing import unit_time_starts
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
    programs = [schedule.actions[r] for r in range(schedule.num_ranks)]
    ids = Ids(schedule.num_stages, schedule.num_microbatches)
    M, SM = ids.M, ids.SM
    width = 2 * SM
    rank_of = [schedule.stage_to_rank[s] for s in range(ids.S)]
    prev_cross, next_cross = cross_rank_flags(rank_of)
    starts = unit_time_starts(schedule)

    # Where each stage's forward output / input-gradient goes, or -1 when it stays on the rank.
    f_dst = [rank_of[s + 1] if next_cross[s] else -1 for s in range(ids.S)]
    b_dst = [rank_of[s - 1] if prev_cross[s] else -1 for s in range(ids.S)]
    events: list[list[int]] = [[] for _ in programs]
    for r, program in enumerate(programs):
        mine = events[r]
        for a, st in zip(program, starts[r], strict=True):
            if st < 0:
                continue
            assert a is not None
            base = (st + 1) * width
            for part in (a,) if a.sub_actions is None else a.sub_actions:
                k, s = part.kind, part.stage
                if k is F:
                    d = f_dst[s]
                    if d >= 0:
                        key = base + s * M + part.microbatch  # type: ignore[operator]
                        mine.append(key)
                        events[d].append(key)
                elif k is B or k is I:
                    d = b_dst[s]
                    if d >= 0:
                        key = base + SM + s * M + part.microbatch  # type: ignore[operator]
                        mine.append(key)
                        events[d].append(key)

    lowered: dict[int, list[Action | None]] = {}
    for r, program in enumerate(programs):
        ev = events[r]
        ev.sort()
        row = starts[r]
        # Bounds: the events of the gap after the j-th compute action are those with a time up to
        # the next compute action's start; before the first compute, those up to its start.
        bounds = [(st + 1) * width for st in row if st >= 0]
        bounds.append(1 << 62)
        out: list[Action | None] = []
        append = out.append
        p = 0
        n_ev = len(ev)
        j = 0
        bound = bounds[0]
        emit_now = True  # at the start of the program and right after each compute action
        for i, a in enumerate(program):
            if emit_now:
                while p < n_ev and ev[p] < bound:
                    msg = ev[p] % width
                    grad, rest = divmod(msg, SM)
                    s, m = divmod(rest, M)
                    if grad:
                        append(make_action(s, SEND_B, m) if rank_of[s] == r else make_action(s - 1, RECV_B, m))
                    else:
                        append(make_action(s, SEND_F, m) if rank_of[s] == r else make_action(s + 1, RECV_F, m))
                    p += 1
                emit_now = False
            if a is None:
                continue
            append(a)
            if row[i] >= 0:
                j += 1
                bound = bounds[j]
                emit_now = True
        while p < n_ev:
            msg = ev[p] % width
            grad, rest = divmod(msg, SM)
            s, m = divmod(rest, M)
            if grad:
                append(make_action(s, SEND_B, m) if rank_of[s] == r else make_action(s - 1, RECV_B, m))
            else:
                append(make_action(s, SEND_F, m) if rank_of[s] == r else make_action(s + 1, RECV_F, m))
            p += 1
        lowered[r] = out
    return schedule._derived(lowered)
