"""Small helpers shared by the generator modules."""

from __future__ import annotations

from pipetrain.plan.actions import Action, ActionKind, new_action
from pipetrain.plan.errors import ScheduleError
from pipetrain.plan.schedule import Schedule

Program = list[Action | None]


def require(condition: bool, schedule: str, constraint: str) -> None:
    """Raise ScheduleError naming the schedule and the constraint it needs."""
    if not condition:
        raise ScheduleError(f"{schedule}: {constraint}")


class VRank:
    """One rank of a V (ZB-V, DualPipe-V): its stages by chunk (0 on the way down, 1 on the way
    back), the next microbatch each chunk forwards and backwards, and the program so far."""

    def __init__(self, rank: int, num_ranks: int) -> None:
        self.stages = (rank, 2 * num_ranks - 1 - rank)
        self.next_f = [0, 0]
        self.next_b = [0, 0]
        self.program: Program = []

    def take_f(self, chunk: int) -> Action:
        """The chunk's next forward (counted as issued)."""
        action = F(self.stages[chunk], self.next_f[chunk])
        self.next_f[chunk] += 1
        return action

    def take_b(self, chunk: int) -> tuple[int, int]:
        """(stage, microbatch) of the chunk's next backward (counted as issued)."""
        mb = self.next_b[chunk]
        self.next_b[chunk] += 1
        return self.stages[chunk], mb


def loop_placement(num_ranks: int, stages_per_rank: int) -> dict[int, int]:
    """Stage s on rank s mod P (GPipe, 1F1B, interleaved, looped BFS)."""
    return {s: s % num_ranks for s in range(num_ranks * stages_per_rank)}


def loop_stages(rank: int, num_ranks: int, stages_per_rank: int) -> list[int]:
    """The stages rank ``rank`` holds under loop placement, in pipeline order."""
    return [rank + chunk * num_ranks for chunk in range(stages_per_rank)]


def microbatch_groups(num_ranks: int, num_microbatches: int) -> list[range]:
    """Consecutive microbatch groups (Megatron's rounds of about P), for the interleaved schedules.

    ``m // p`` groups (at least one) whose sizes differ by at most one, larger groups first, so
    any number of microbatches works without a short trailing group.
    """
    count = max(1, num_microbatches // num_ranks)
    size, extra = divmod(num_microbatches, count)
    groups: list[range] = []
    start = 0
    for index in range(count):
        length = size + (1 if index < extra else 0)
        groups.append(range(start, start + length))
        start += length
    return groups


def v_placement(num_ranks: int) -> dict[int, int]:
    """Rank r holds stages r and 2P-1-r (ZB-V, DualPipe-V)."""
    placement = {r: r for r in range(num_ranks)}
    placement.update({2 * num_ranks - 1 - r: r for r in range(num_ranks)})
    return dict(sorted(placement.items()))


# The generators call these hundreds of thousands of times with indices they computed: the
# unchecked constructor keeps building cheap; every schedule is checked by the Schedule
# constructor (placement, ranges) and validate() (the rest) anyway.
def F(stage: int, mb: int) -> Action:  # noqa: N802 - reads like the papers
    return new_action(Action, (stage, _F, mb, None))


def B(stage: int, mb: int) -> Action:  # noqa: N802
    return new_action(Action, (stage, _B, mb, None))


def I(stage: int, mb: int) -> Action:  # noqa: N802, E743
    return new_action(Action, (stage, _I, mb, None))


def W(stage: int, mb: int) -> Action:  # noqa: N802
    return new_action(Action, (stage, _W, mb, None))


_F, _B, _I, _W = ActionKind.F, ActionKind.B, ActionKind.I, ActionKind.W


def make_schedule(programs: dict[int, Program], placement: dict[int, int], num_microbatches: int) -> Schedule:
    return Schedule(
        programs,
        num_stages=len(placement),
        num_microbatches=num_microbatches,
        stage_to_rank=placement,
    )
