"""Insert non-compute actions around a rank's compute actions without splitting comm groups."""

from __future__ import annotations

from collections.abc import Sequence

from pipetrain.plan.actions import Action, ActionKind


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
        if item is not None and item.kind.is_compute:
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


def compute_parts(program: Sequence[Action | None]) -> list[tuple[Action, ...]]:
    """The parts of each compute action of ``program``, in order."""
    return [a.parts for a in program if a is not None and a.kind.is_compute]


def refuse_existing(programs: Sequence[Sequence[Action | None]], kinds: frozenset[ActionKind], what: str) -> None:
    from pipetrain.plan.errors import ScheduleError

    for rank, program in enumerate(programs):
        for step, a in enumerate(program):
            if a is not None and a.kind in kinds:
                raise ScheduleError(f"rank {rank}, step {step}, action {a}: the schedule already has {what}")
