"""Compiled rank programs (pipetrain.plan.program): what the executor runs, grouped by the one rule."""

from __future__ import annotations

from pipetrain.plan import Action, Schedule, build_schedule
from pipetrain.plan.program import compile_program


def _program(cells: list[str | None]) -> list[Action | None]:
    return [None if c is None else Action.parse(c) for c in cells]


def test_an_idle_step_ends_a_communication_group() -> None:
    """As validate() and docs/semantics.md say: consecutive SEND/RECV form a group, an idle step ends it."""
    actions = {
        0: _program(["0F0", "0SEND_F0", None, "0RECV_B0", "0B0"]),
        1: _program(["1RECV_F0", "1F0", "1B0", "1SEND_B0"]),
    }
    schedule = Schedule(actions, num_stages=2, num_microbatches=1)
    program = compile_program(schedule, 0)
    assert [(s.comm, [str(a) for a in s.actions]) for s in program.steps] == [
        (False, ["0F0"]),
        (True, ["0SEND_F0"]),
        (True, ["0RECV_B0"]),
        (False, ["0B0"]),
    ]
    assert [(pos, str(a)) for pos, a in program.sends] == [(1, "0SEND_F0")]
    joined = compile_program(schedule.replace({0: [a for a in actions[0] if a is not None], 1: actions[1]}), 0)
    assert [str(a) for a in joined.steps[1].actions] == ["0SEND_F0", "0RECV_B0"]


def test_split_stages_are_those_with_a_separate_weight_backward() -> None:
    lowered = build_schedule("ZBVZeroBubble", 2, 4, 2).lower()
    assert compile_program(lowered, 0).split_stages == {0, 3}
    assert compile_program(build_schedule("1F1B", 2, 4).lower(), 1).split_stages == frozenset()
    # Every action of the rank is in exactly one step, in order.
    for rank in range(2):
        program = compile_program(lowered, rank)
        flat = [a for step in program.steps for a in step.actions]
        assert flat == [a for a in lowered.actions[rank] if a is not None]


def test_split_cells_name_each_microbatch_whose_backward_is_split() -> None:
    """A stage that runs B for some microbatches and I, W for others tracks saved tensors only for the latter."""
    actions = {
        0: _program(["0F0", "0F1", "0B0", "0I1", "0W1"]),
    }
    program = compile_program(Schedule(actions, num_stages=1, num_microbatches=2), 0)
    assert program.split_cells == {(0, 1)}
    assert program.split_stages == {0}
