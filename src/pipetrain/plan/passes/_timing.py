"""Unit-time abstract execution of a compute schedule: when would each action start?

Every compute action takes one unit; an action starts once its rank is free and everything it
needs has ended. The result is a global order of the compute actions that respects every
dependency, which the communication pass uses to place sends and receives.
"""

# ruff: noqa: N806 - S, M, SM, R: stages, microbatches, their product, ranks (the papers' notation)

from __future__ import annotations

from pipetrain.plan.actions import Action
from pipetrain.plan.errors import ScheduleError
from pipetrain.plan.passes._graph import OVERLAP, B, F, I, Ids, W
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


def unit_time_run(schedule: Schedule) -> tuple[list[list[int]], list[list[tuple[int, Action]]]]:
    """Per rank, the start time of each compute action in program order; and the compute parts
    (an OVERLAP_F_B's parts, or the action) bucketed by start time as ``(rank, part)`` pairs (the
    order within a time unit is that of the run: deterministic).

    Raises :class:`ScheduleError` (from :func:`~pipetrain.plan.validate.validate`, which names the
    stuck ranks) when the compute schedule cannot run to the end.
    """
    ids = Ids(schedule.num_stages, schedule.num_microbatches)
    M, SM, S = ids.M, ids.SM, ids.S
    R = schedule.num_ranks
    programs = [schedule.actions[r] for r in range(R)]
    starts: list[list[int]] = [[] for _ in programs]
    by_time: list[list[tuple[int, Action]]] = []
    end = [-1] * (3 * SM)
    free = [0] * R
    pc = [0] * R
    waiting: dict[int, list[int]] = {}
    queue = list(range(R))
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
            if k is F:
                s = a.stage
                node = s * M + a.microbatch  # type: ignore[operator]
                if s:
                    e = end[node - M]
                    if e < 0:
                        waiting.setdefault(node - M, []).append(r)
                        break
                    if e > t0:
                        t0 = e
            elif k is I or k is B:
                s = a.stage
                sm = s * M + a.microbatch  # type: ignore[operator]
                node = SM + sm
                e = end[sm]
                if e < 0:
                    waiting.setdefault(sm, []).append(r)
                    break
                if e > t0:
                    t0 = e
                if s < S - 1:
                    e = end[node + M]
                    if e < 0:
                        waiting.setdefault(node + M, []).append(r)
                        break
                    if e > t0:
                        t0 = e
            elif k is W:
                sm = a.stage * M + a.microbatch  # type: ignore[operator]
                node = 2 * SM + sm
                e = end[SM + sm]
                if e < 0:
                    waiting.setdefault(SM + sm, []).append(r)
                    break
                if e > t0:
                    t0 = e
            elif k is OVERLAP:
                parts = a.parts
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
                    waiting.setdefault(missing, []).append(r)
                    break
                row.append(t0)
                while len(by_time) <= t0:
                    by_time.append([])
                by_time[t0].extend([(r, p) for p in parts])
                t0 += 1
                for node in own:
                    end[node] = t0
                    woken = waiting.pop(node, None)
                    if woken:
                        queue.extend(woken)
                i += 1
                continue
            else:
                i += 1
                continue
            row.append(t0)
            if t0 < len(by_time):
                by_time[t0].append((r, a))
            else:
                while len(by_time) < t0:
                    by_time.append([])
                by_time.append([(r, a)])
            t0 += 1
            end[node] = t0
            if waiting:
                woken = waiting.pop(node, None)
                if woken:
                    queue.extend(woken)
            i += 1
        pc[r] = i
        free[r] = t0
    if any(pc[r] < len(programs[r]) for r in range(R)):
        from pipetrain.plan.validate import validate

        validate(schedule)
        raise ScheduleError("the compute schedule cannot run to the end; validate() it for details")
    return starts, by_time
