"""Forwards only: the inference schedule derived from a training schedule (for ``eval``)."""

from __future__ import annotations

from pipetrain.plan.actions import Action, ActionKind
from pipetrain.plan.errors import ScheduleError
from pipetrain.plan.schedule import Schedule

__all__ = ["forwards_only"]


def forwards_only(schedule: Schedule) -> Schedule:
    """The forwards of ``schedule`` in the order it runs them, for eval on any schedule."""
    programs: dict[int, list[Action | None]] = {}
    for rank in range(schedule.num_ranks):
        programs[rank] = [
            part
            for action in schedule.actions[rank]
            if action is not None
            for part in action.parts
            if part.kind is ActionKind.F
        ]
    out = Schedule(
        programs,
        num_stages=schedule.num_stages,
        num_microbatches=schedule.num_microbatches,
        stage_to_rank=schedule.stage_to_rank,
        name=f"{schedule.name} (forward only)".strip(),
    )
    try:
        out.validate()
    except ScheduleError:
        # Fall back to every rank running its stages in order, breadth-first: always deadlock-free.
        for rank in range(schedule.num_ranks):
            programs[rank] = [
                Action(s, ActionKind.F, m) for s in schedule.stages_of(rank) for m in range(schedule.num_microbatches)
            ]
        out = out.replace(programs)
    return out
