"""Unit-time abstract execution of a compute schedule: when would each action start?

Every compute action takes one unit; an action starts once its rank is free and everything it
needs has ended. The result is a global order of the compute actions that respects every
dependency, which the communication pass uses to place sends and receives.

The run doubles as the check of a compute schedule (what :func:`~pipetrain.plan.validate.validate`
checks of one, at a fraction of a separate scan's cost): every compute part on its stage's rank
with its microbatch in range, none twice, each (stage, microbatch) complete, and every program
run to its end. On any breach it hands the schedule to ``validate()``, whose message names the
rank, step, action and rule.
"""

# ruff: noqa: N806 - S, M, SM, R: stages, microbatches, their product, ranks (the papers' notation)

from __future__ import annotations

from typing import NamedTuple, NoReturn

from pipetrain.plan.actions import Action
from pipetrain.plan.errors import ScheduleError
from pipetrain.plan.passes._graph import OVERLAP, B, F, I, Ids, W, cross_rank_flags
from pipetrain.plan.schedule import Schedule


def part_node(part: Action, ids: Ids) -> int:
    sm = part.stage * ids.M + part.microbatch  # type: ignore[operator]
    kind = part.kind
    return sm if kind is F else (2 * ids.SM + sm if kind is W else ids.SM + sm)


def part_needs(part: Action, ids: Ids) -> list[int]:
    """Nodes ``part`` depends on (docs/semantics.md, Dependencies)."""
    s, M, SM = part.stage, ids.M, ids.SM
    sm = s * M + part.microbatch  # type: ignore[operator]
    kind = part.kind
    if kind is F:
        return [sm - M] if s else []
    if kind is W:
        return [SM + sm]
    return [sm, SM + sm + M] if s < ids.S - 1 else [sm]


class UnitRun(NamedTuple):
    """What :func:`unit_time_run` learns."""

    starts: list[list[int]]
    """Per rank, the start time of each compute action, in program order."""
    by_time: list[list[Action]]
    """The message producers (compute parts whose result goes to a stage on another rank), by start time."""
    makespan: int
    lowered_actions: int
    """How many actions are not compute (SEND/RECV, UNSHARD/RESHARD, REDUCE_GRAD): skipped."""


class _BreachError(Exception):
    """A compute part off its stage's rank, out of range, or a W after a full B."""


def unit_time_run(schedule: Schedule) -> UnitRun:
    """Run ``schedule`` in unit time (see the module docstring).

    The message producers are bucketed by start time, within a time unit in the order of the run
    (deterministic). Only producers are bucketed because the buckets exist for the communication
    pass; leaving out the weight gradients and same-rank hand-overs keeps the run cheap.

    Raises :class:`ScheduleError` (from :func:`~pipetrain.plan.validate.validate`) when the
    compute schedule breaks a rule or cannot run to the end.
    """
    ids = Ids(schedule.num_stages, schedule.num_microbatches)
    M, SM, S = ids.M, ids.SM, ids.S
    R = schedule.num_ranks
    rank_of = [schedule.stage_to_rank.get(s, -1) for s in range(S)]
    prev_cross, next_cross = cross_rank_flags(rank_of)
    is_i = bytearray(SM)  # which backwards are split (I, to be followed by a W)
    overlap_extra = 0  # parts of OVERLAP_F_B actions beyond the first, for the duplicate count
    lowered = 0
    programs = [schedule.actions[r] for r in range(R)]
    starts: list[list[int]] = [[] for _ in programs]
    by_time: list[list[Action]] = []
    end = [-1] * (3 * SM)
    free = [0] * R
    pc = [0] * R
    waiting: list[list[int] | None] = [None] * (3 * SM)  # ranks blocked on each node

    def block(node: int, rank: int) -> None:
        ranks = waiting[node]
        if ranks is None:
            waiting[node] = [rank]
        else:
            ranks.append(rank)

    queue = list(range(R))
    try:
        while queue:
            r = queue.pop()
            program = programs[r]
            row = starts[r]
            n = len(program)
            i = pc[r]
            t0 = free[r]
            while i < n:
                a = program[i]
                if a is None:
                    i += 1
                    continue
                k = a.kind
                s = a.stage
                m = a.microbatch
                if k is F:
                    node = s * M + m  # type: ignore[operator]
                    if s:
                        e = end[node - M]
                        if e < 0:
                            block(node - M, r)
                            break
                        if e > t0:
                            t0 = e
                    sends = next_cross[s]
                elif k is I or k is B:
                    sm = s * M + m  # type: ignore[operator]
                    node = SM + sm
                    e = end[sm]
                    if e < 0:
                        block(sm, r)
                        break
                    if e > t0:
                        t0 = e
                    if s < S - 1:
                        e = end[node + M]
                        if e < 0:
                            block(node + M, r)
                            break
                        if e > t0:
                            t0 = e
                    sends = prev_cross[s]
                    if k is I:
                        is_i[sm] = 1
                elif k is W:
                    sm = s * M + m  # type: ignore[operator]
                    node = 2 * SM + sm
                    e = end[SM + sm]
                    if e < 0:
                        block(SM + sm, r)
                        break
                    if not is_i[sm]:  # a W needs an I, never a full B
                        raise _BreachError
                    if e > t0:
                        t0 = e
                    sends = False
                elif k is OVERLAP:
                    parts = a.parts
                    for p in parts:
                        if rank_of[p.stage] != r or p.microbatch >= M:  # type: ignore[operator]
                            raise _BreachError
                    own = {part_node(p, ids) for p in parts}
                    missing = -1
                    for p in parts:
                        for need in part_needs(p, ids):
                            if need in own:
                                continue
                            e = end[need]
                            if e < 0:
                                missing = need
                                break
                            if e > t0:
                                t0 = e
                        if missing >= 0:
                            break
                    if missing >= 0:
                        block(missing, r)
                        break
                    for p in parts:
                        if p.kind is I:
                            is_i[p.stage * M + p.microbatch] = 1  # type: ignore[operator]
                        elif p.kind is W and not is_i[p.stage * M + p.microbatch]:  # type: ignore[operator]
                            raise _BreachError
                    overlap_extra += len(parts) - 1
                    row.append(t0)
                    while len(by_time) <= t0:
                        by_time.append([])
                    by_time[t0].extend(
                        [
                            p
                            for p in parts
                            if (next_cross[p.stage] if p.kind is F else p.kind is not W and prev_cross[p.stage])
                        ]
                    )
                    t0 += 1
                    for node in own:
                        end[node] = t0
                        woken = waiting[node]
                        if woken is not None:
                            waiting[node] = None
                            queue.extend(woken)
                    i += 1
                    continue
                else:
                    lowered += 1
                    i += 1
                    continue
                # Placement and range are checked once the action can run: one that breaks them and
                # blocks instead (on a node its wrong indices name) leaves the run stuck, and either
                # way validate() names it.
                if rank_of[s] != r or m >= M:  # type: ignore[operator]
                    raise _BreachError
                row.append(t0)
                if sends:
                    if t0 < len(by_time):
                        by_time[t0].append(a)
                    else:
                        while len(by_time) < t0:
                            by_time.append([])
                        by_time.append([a])
                t0 += 1
                end[node] = t0
                woken = waiting[node]
                if woken is not None:
                    waiting[node] = None
                    queue.extend(woken)
                i += 1
            pc[r] = i
            free[r] = t0
    except (_BreachError, AttributeError, IndexError, TypeError):
        _fail(schedule, "a compute action is off its stage's rank or out of range, or a W follows a full B")
    if any(pc[r] < len(programs[r]) for r in range(R)):
        _fail(schedule, "the compute schedule cannot run to the end")
    # Every part ran once (as many distinct nodes ended as parts ran), every forward ran, and
    # with any backward every (stage, microbatch) has one and each I its W.
    ran = sum(len(row) for row in starts) + overlap_extra
    if M < 1 or 3 * SM - end.count(-1) != ran or -1 in end[:SM]:
        _fail(schedule, "the compute schedule is incomplete or runs an action twice")
    if ran > SM and (-1 in end[SM : 2 * SM] or SM - end[2 * SM :].count(-1) != sum(is_i)):
        _fail(schedule, "the compute schedule is incomplete")
    return UnitRun(starts, by_time, max(free, default=0), lowered)


def _fail(schedule: Schedule, what: str) -> NoReturn:
    """Raise validate()'s message for ``schedule`` (``what`` only if it finds nothing)."""
    from pipetrain.plan.validate import validate

    validate(schedule)
    raise ScheduleError(f"{what}; validate() it for details")
