"""A rank's program: what the runtime's executor runs, compiled from a lowered schedule.

The executor interprets a :class:`RankProgram` and decides nothing: every choice of order was
made by the schedule (and its lowering passes) and every choice of grouping is made here, by the
one rule ``validate()`` and ``docs/semantics.md`` use: a communication group is a maximal run of
consecutive SEND/RECV actions, and an idle step or any other action ends it.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from pipetrain.plan.actions import Action, ActionKind
from pipetrain.plan.delivery import confirmed_sends
from pipetrain.plan.schedule import Schedule

__all__ = ["ProgramStep", "RankProgram", "compile_program", "split_cells", "split_stages"]


@dataclass(frozen=True)
class ProgramStep:
    """One thing the executor does: post a communication group, or run one action.

    ``index`` is the position of the step's first action in the rank's list (for messages);
    ``comm`` tells a group of SEND/RECV actions (posted together) from a single other action.
    """

    index: int
    actions: tuple[Action, ...]
    comm: bool


@dataclass(frozen=True)
class RankProgram:
    """One rank's compiled program and the facts about it the executor needs.

    ``split_stages``: the stages whose backward this rank runs as separate I and W;
    ``split_cells``: the (stage, microbatch) pairs it does so for (only their forwards keep track of
    saved tensors: a B frees what autograd saved by itself, and tracking costs a Python call per
    saved tensor). ``sends``: ``(step number, action)`` of every SEND,
    in order, so a failing rank can tell which messages it still owes. ``confirms``: step number
    -> this rank's SENDs surely delivered once that step's inputs arrived
    (:mod:`pipetrain.plan.delivery`), whose buffers the executor then releases.
    """

    rank: int
    steps: tuple[ProgramStep, ...]
    split_stages: frozenset[int]
    sends: tuple[tuple[int, Action], ...]
    confirms: dict[int, tuple[Action, ...]] = field(default_factory=dict)
    split_cells: frozenset[tuple[int, int]] = frozenset()


def split_stages(actions: list[Action | None]) -> frozenset[int]:
    """The stages ``actions`` runs I or W for (a split backward)."""
    return frozenset(stage for stage, _ in split_cells(actions))


def split_cells(actions: list[Action | None]) -> frozenset[tuple[int, int]]:
    """The (stage, microbatch) pairs ``actions`` runs I or W for (a split backward)."""
    return frozenset(
        (part.stage, part.microbatch or 0)
        for action in actions
        if action is not None
        for part in action.parts
        if part.kind is ActionKind.I or part.kind is ActionKind.W
    )


def compile_program(
    schedule: Schedule, rank: int, confirmed: dict[int, dict[Action, list[Action]]] | None = None
) -> RankProgram:
    """``rank``'s program of ``schedule`` as the executor runs it (linear in its length);
    ``confirmed``: the schedule's :func:`~pipetrain.plan.delivery.confirmed_sends`, when known."""
    actions = schedule.actions[rank]
    steps: list[ProgramStep] = []
    sends: list[tuple[int, Action]] = []
    group: list[Action] = []
    start = 0
    for i, action in enumerate(actions):
        if action is not None and action.kind.is_comm:
            if not group:
                start = i
            group.append(action)
            if action.kind is ActionKind.SEND_F or action.kind is ActionKind.SEND_B:
                sends.append((len(steps), action))
            continue
        if group:
            steps.append(ProgramStep(start, tuple(group), True))
            group = []
        if action is not None:
            steps.append(ProgramStep(i, (action,), False))
    if group:
        steps.append(ProgramStep(start, tuple(group), True))
    mine = (confirmed_sends(schedule) if confirmed is None else confirmed).get(rank, {})
    confirms = {
        k: tuple(mine[step.actions[0]]) for k, step in enumerate(steps) if not step.comm and step.actions[0] in mine
    }
    cells = split_cells(actions)
    stages = frozenset(stage for stage, _ in cells)
    return RankProgram(rank, tuple(steps), stages, tuple(sends), confirms, cells)
