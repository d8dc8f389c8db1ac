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
from pipetrain.plan.dependencies import C_I, C_OVERLAP, C_W, CODE, Dependencies
from pipetrain.plan.errors import ScheduleError
from pipetrain.plan.execution import Walk
from pipetrain.plan.schedule import Schedule
from pipetrain.plan.validate import validate


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
    M, S = schedule.num_microbatches, schedule.num_stages
    SM = S * M
    R = schedule.num_ranks
    rank_of = [schedule.stage_to_rank.get(s, -1) for s in range(S)]
    deps = Dependencies(S, M, rank_of, lowered=False)
    need_keys, make_key, sends_of = deps.need_keys, deps.make_key, deps.sends
    is_i = bytearray(SM)  # which backwards are split (I, to be followed by a W)
    overlap_extra = 0  # parts of OVERLAP_F_B actions beyond the first, for the duplicate count
    lowered = 0
    starts: list[list[int]] = [[] for _ in range(R)]
    by_time: list[list[Action]] = []
    # A part's end time per node; then M entries that have always ended: the keys of a need that
    # is not there (base ``NONE``), so that every part reads two needs without a loop.
    NONE = 3 * SM
    end = [-1] * (3 * SM) + [0] * M
    free = [0] * R
    codes = CODE
    walk = Walk.of(schedule.actions, R)
    programs, pc, queue = walk.programs, walk.pc, walk.queue
    # The rank waiting for each key (-1: none). One suffices: a product has at most one user on
    # another rank, and a user on the producer's rank never waits in a sound schedule (its producer
    # comes first in the program, or the schedule deadlocks and validate() names it).
    waiter = [-1] * len(end)

    # Per kind code and stage: (its two needs' bases, what it makes, whether that leaves the rank).
    rules = [
        [(*(need_keys[code][s] + (NONE, NONE))[:2], make_key[code][s], sends_of[code][s]) for s in range(S)]
        for code in range(C_OVERLAP)
    ]
    assert all(len(keys) <= 2 for rows in need_keys for keys in rows), "unlowered parts need at most two keys"
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
                s, kind, m, _ = a
                code = codes[kind]
                if code < C_OVERLAP:  # a plain compute part: the common case, inline
                    need1, need2, node, sends = rules[code][s]
                    e1 = end[need1 + m]  # type: ignore[operator]
                    e2 = end[need2 + m]  # type: ignore[operator]
                    if e1 < 0 or e2 < 0:
                        waiter[need1 + m if e1 < 0 else need2 + m] = r  # type: ignore[operator]
                        break
                    if e1 > t0:
                        t0 = e1
                    if e2 > t0:
                        t0 = e2
                    # Placement, range and the W-after-I rule are checked once the action can run:
                    # one that breaks them and blocks instead (on a node its wrong indices name)
                    # leaves the run stuck, and either way validate() names it.
                    if rank_of[s] != r or m >= M:  # type: ignore[operator]
                        raise _BreachError
                    if code == C_I:
                        is_i[s * M + m] = 1  # type: ignore[operator]
                    elif code == C_W and not is_i[s * M + m]:  # type: ignore[operator]
                        raise _BreachError  # a W needs an I, never a full B
                    row.append(t0)
                    if sends:
                        while len(by_time) <= t0:
                            by_time.append([])
                        by_time[t0].append(a)
                    node += m  # type: ignore[operator]
                    t0 += 1
                    end[node] = t0
                    if waiter[node] >= 0:
                        queue.append(waiter[node])
                    i += 1
                    continue
                if code > C_OVERLAP:
                    lowered += 1
                    i += 1
                    continue
                parts = a.parts
                missing, t0 = _overlap_ready(parts, deps, end, t0)
                if missing >= 0:
                    waiter[missing] = r
                    break
                row.append(t0)
                t1 = t0 + 1
                for p in parts:
                    pcode = codes[p.kind]
                    s, m = p.stage, p.microbatch
                    if rank_of[s] != r or m >= M:  # type: ignore[operator]
                        raise _BreachError
                    if pcode == C_I:
                        is_i[s * M + m] = 1  # type: ignore[operator]
                    elif pcode == C_W and not is_i[s * M + m]:  # type: ignore[operator]
                        raise _BreachError
                    if sends_of[pcode][s]:
                        while len(by_time) <= t0:
                            by_time.append([])
                        by_time[t0].append(p)
                    node = make_key[pcode][s] + m  # type: ignore[operator]
                    end[node] = t1
                    if waiter[node] >= 0:
                        queue.append(waiter[node])
                overlap_extra += len(parts) - 1
                t0 = t1
                i += 1
            pc[r] = i
            free[r] = t0
    except (_BreachError, AttributeError, IndexError, TypeError):
        _fail(schedule, "a compute action is off its stage's rank or out of range, or a W follows a full B")
    if walk.stuck():
        _fail(schedule, "the compute schedule cannot run to the end")
    # Every part ran once (as many distinct nodes ended as parts ran), every forward ran, and
    # with any backward every (stage, microbatch) has one and each I its W.
    ran = sum(len(row) for row in starts) + overlap_extra
    if M < 1 or 3 * SM - end.count(-1) != ran or -1 in end[:SM]:
        _fail(schedule, "the compute schedule is incomplete or runs an action twice")
    if ran > SM and (-1 in end[SM : 2 * SM] or SM - end[2 * SM : 3 * SM].count(-1) != sum(is_i)):
        _fail(schedule, "the compute schedule is incomplete")
    return UnitRun(starts, by_time, max(free, default=0), lowered)


def _overlap_ready(parts: tuple[Action, ...], deps: Dependencies, end: list[int], t0: int) -> tuple[int, int]:
    """(-1, start) if every part of an OVERLAP_F_B has its inputs (its own earlier parts count:
    the parts run in order), else (a key it waits for, t0). A part that needs a later part's
    product is a breach."""
    own = [deps.part_makes(p)[0] for p in parts]
    for k, p in enumerate(parts):
        for key in deps.part_needs(p):
            e = end[key]
            if e < 0:
                if key in own[:k]:
                    continue
                if key in own:
                    raise _BreachError
                return key, t0
            if e > t0:
                t0 = e
    return -1, t0


def _fail(schedule: Schedule, what: str) -> NoReturn:
    """Raise validate()'s message for ``schedule`` (``what`` only if it finds nothing)."""
    validate(schedule)
    raise ScheduleError(f"{what}; validate() it for details")
