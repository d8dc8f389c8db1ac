"""Insert non-compute actions around a rank's compute actions without splitting comm groups."""

from __future__ import annotations

from collections.abc import Sequence

from pipetrain.plan._graph import OVERLAP, B, F, I, W
from pipetrain.plan.actions import Action, ActionKind
from pipetrain.plan.errors import ScheduleError
from pipetrain.plan.schedule import Schedule


def insert_around_compute(
    program: Sequence[Action | None],
    before: Sequence[list[Action] | None],
    after: Sequence[list[Action] | None],
    skip_after: frozenset[ActionKind],
) -> list[Action | None]:
    """``before[k]`` goes right before the k-th compute action; ``after[k]`` right after it and
    after the actions of kinds ``skip_after`` that directly follow it (a SEND/RECV run stays one
    run, so one communication group). ``after[-1]`` style indices are not used: lengths equal the
    number of compute actions."""
    out: list[Action | None] = []
    pending: list[Action] | None = None
    k = 0
    for item in program:
        if pending is not None and (item is None or item.kind not in skip_after):
            out.extend(pending)
            pending = None
        kind = None if item is None else item.kind
        if kind is F or kind is I or kind is W or kind is B or kind is OVERLAP:
            extra = before[k]
            if extra:
                out.extend(extra)
            out.append(item)
            pending = after[k]
            k += 1
            continue
        out.append(item)
    if pending:
        out.extend(pending)
    return out


def compute_actions(program: Sequence[Action | None]) -> list[Action]:
    """The compute actions of ``program`` (F, B, I, W, OVERLAP_F_B), in order."""
    out: list[Action] = []
    for a in program:
        if a is None:
            continue
        kind = a.kind
        if kind is F or kind is I or kind is W or kind is B or kind is OVERLAP:
            out.append(a)
    return out


def refuse_existing(schedule: Schedule, kinds: frozenset[ActionKind], what: str) -> None:
    """Raise if ``schedule`` already holds actions of ``kinds`` (a pass must not run twice)."""
    for rank in range(schedule.num_ranks):
        for step, a in enumerate(schedule.actions[rank]):
            if a is None:
                continue
            kind = a.kind
            if not (kind is F or kind is I or kind is W or kind is B or kind is OVERLAP) and kind in kinds:
                raise ScheduleError(f"rank {rank}, step {step}, action {a}: the schedule already has {what}")


def refuse_lowered(schedule: Schedule) -> None:
    """Raise naming the first action that is not compute (lowering twice is refused)."""
    for rank in range(schedule.num_ranks):
        for step, action in enumerate(schedule.actions[rank]):
            if action is None:
                continue
            kind = action.kind
            if not (kind is F or kind is I or kind is W or kind is B or kind is OVERLAP):
                raise ScheduleError(
                    f"rank {rank}, step {step}, action {action}: the schedule is already lowered; "
                    "lower() takes a compute-only schedule (F, B, I, W, OVERLAP_F_B)"
                )
