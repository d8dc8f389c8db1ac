"""Small helpers shared by the generator modules."""

from __future__ import annotations

from pipetrain.plan.actions import Action, ActionKind
from pipetrain.plan.errors import ScheduleError
from pipetrain.plan.schedule import Schedule

Program = list[Action | None]


def require(condition: bool, schedule: str, constraint: str) -> None:
    """Raise ScheduleError naming the schedule and the constraint it needs."""
    if not condition:
        raise ScheduleError(f"{schedule}: {constraint}")


def loop_placement(num_ranks: int, stages_per_rank: int) -> dict[int, int]:
    """Stage s on rank s mod P (GPipe, 1F1B, interleaved, looped BFS)."""
    return {s: s % num_ranks for s in range(num_ranks * stages_per_rank)}


def v_placement(num_ranks: int) -> dict[int, int]:
    """Rank r holds stages r and 2P-1-r (ZB-V, DualPipe-V)."""
    placement = {r: r for r in range(num_ranks)}
    placement.update({2 * num_ranks - 1 - r: r for r in range(num_ranks)})
    return dict(sorted(placement.items()))


def F(stage: int, mb: int) -> Action:  # noqa: N802 - reads like the papers
    return Action(stage, ActionKind.F, mb)


def B(stage: int, mb: int) -> Action:  # noqa: N802
    return Action(stage, ActionKind.B, mb)


def I(stage: int, mb: int) -> Action:  # noqa: N802, E743
    return Action(stage, ActionKind.I, mb)


def W(stage: int, mb: int) -> Action:  # noqa: N802
    return Action(stage, ActionKind.W, mb)


def make_schedule(programs: dict[int, Program], placement: dict[int, int], num_microbatches: int) -> Schedule:
    return Schedule(
        programs,
        num_stages=len(placement),
        num_microbatches=num_microbatches,
        stage_to_rank=placement,
    )
