"""Named schedules and random edits of them, for the planning layer's property tests."""

from __future__ import annotations

from hypothesis import strategies as st

from pipetrain.plan import Schedule, ScheduleError, build_schedule
from pipetrain.plan.generators import family


def build_or_none(name: str, ranks: int, microbatches: int) -> Schedule | None:
    """``name`` at this size with its family's stages per rank (else 2), or None for a
    configuration the family does not support."""
    spr = family(name).stages_per_rank
    try:
        return build_schedule(name, ranks, microbatches, spr if spr else 2)
    except ScheduleError:
        return None


def mutate(schedule: Schedule, data: st.DataObject, *, idle: bool = False) -> Schedule:
    """The schedule with a few random edits within ranks (so placement holds and only order and
    completeness break): swaps, moves to the end, deletions, duplicates; with ``idle``, idle steps
    too (which split communication groups), else idle steps are dropped first."""
    programs = {r: [a for a in schedule.actions[r] if idle or a is not None] for r in range(schedule.num_ranks)}
    edits = (
        ["swap", "swap", "to_end", "delete", "duplicate", "idle"]
        if idle
        else ["swap", "swap", "swap", "to_end", "delete", "duplicate"]
    )
    for _ in range(data.draw(st.integers(1, 3), label="edits")):
        r = data.draw(st.sampled_from([r for r, p in programs.items() if p]), label="rank")
        program = programs[r]
        i = data.draw(st.integers(0, len(program) - 1), label="i")
        j = data.draw(st.integers(0, len(program) - 1), label="j")
        edit = data.draw(st.sampled_from(edits), label="edit")
        if edit == "swap":
            program[i], program[j] = program[j], program[i]
        elif edit == "to_end":
            program.append(program.pop(i))
        elif edit == "delete" and len(program) > 1:
            del program[i]
        elif edit == "duplicate":
            program.insert(j, program[i])
        elif edit == "idle":
            program.insert(j, None)
    return schedule._derived(programs)  # type: ignore[arg-type]
