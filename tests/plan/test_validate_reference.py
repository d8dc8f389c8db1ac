"""validate agrees with a second, independent validator on schedules broken at random.

:mod:`support.reference_validator` is written from docs/semantics.md alone. Every generator's
schedules, compute-only and lowered several ways, are edited at random (seeded: the same cases
every run) by the edits that break schedules in practice: two actions swapped, one moved,
deleted, doubled, renumbered, a SEND/RECV moved across a compute action or out of its group, an
idle step inserted, an OVERLAP_F_B's parts reversed, two neighbouring compute actions made one OVERLAP_F_B. Each result is judged by both, under both
matching models: accepting what the reference rejects would let a broken schedule run (a hang or
a wrong gradient), and rejecting what it accepts would refuse a sound one. Both must agree.
"""

from __future__ import annotations

import random
from collections.abc import Callable

import pytest

from pipetrain.plan import Action, Schedule, ScheduleError, build_schedule, schedule_names
from pipetrain.plan.validate import validate
from support.reference_validator import COMM, accepts

LOWERINGS: list[dict[str, object]] = [
    {},
    {"fsdp": True, "grad_reduce": True},
    {"fsdp": True, "max_unsharded": 1, "prefetch": 2},
    {"merge_iw": True},
    {"recv_ahead": 2},
    {"comms": False, "fsdp": True, "grad_reduce": True},
]
EDITS_PER_SCHEDULE = 30


def _bases() -> list[tuple[str, Schedule]]:
    out = []
    for name in schedule_names():
        for ranks, v, m in ((2, None, 3), (3, None, 4), (2, 2, 2), (4, 2, 5)):
            try:
                schedule = build_schedule(name, ranks, m, v)
            except ScheduleError:
                continue
            out.append((f"{name} {ranks}x{schedule.num_stages // ranks}x{m}", schedule))
            for options in LOWERINGS:
                if not schedule.has_backward and any(k in options for k in ("grad_reduce", "merge_iw", "recv_ahead")):
                    continue
                try:
                    out.append((f"{name} {ranks}x{m} lowered {options}", schedule.lower(**options)))  # type: ignore[arg-type]
                except ScheduleError:
                    continue
    return out


def _edit(rng: random.Random, schedule: Schedule) -> dict[int, list[Action | None]]:
    programs = {r: list(schedule.actions[r]) for r in range(schedule.num_ranks)}
    for _ in range(rng.choice((1, 1, 2, 3))):
        row = programs[rng.randrange(schedule.num_ranks)]
        if not row:
            continue
        i = rng.randrange(len(row))
        action = row[i]
        edit = rng.choice(EDITS)
        edit(rng, row, i, action, schedule.num_microbatches)
    return programs


def _swap_neighbours(rng: random.Random, row: list[Action | None], i: int, a: Action | None, m: int) -> None:
    j = min(i + 1, len(row) - 1)
    row[i], row[j] = row[j], row[i]


def _move(rng: random.Random, row: list[Action | None], i: int, a: Action | None, m: int) -> None:
    row.insert(rng.randrange(len(row)), row.pop(i))


def _delete(rng: random.Random, row: list[Action | None], i: int, a: Action | None, m: int) -> None:
    del row[i]


def _double(rng: random.Random, row: list[Action | None], i: int, a: Action | None, m: int) -> None:
    row.insert(rng.randrange(len(row) + 1), a)


def _renumber(rng: random.Random, row: list[Action | None], i: int, a: Action | None, m: int) -> None:
    if a is not None and a.microbatch is not None:
        row[i] = Action(a.stage, a.kind, rng.randrange(m))


def _move_message(rng: random.Random, row: list[Action | None], i: int, a: Action | None, m: int) -> None:
    ops = [k for k, x in enumerate(row) if x is not None and x.kind in COMM]
    if ops:
        k = rng.choice(ops)
        row.insert(max(0, min(len(row), k + rng.choice((-3, -2, -1, 1, 2, 3)))), row.pop(k))


def _idle(rng: random.Random, row: list[Action | None], i: int, a: Action | None, m: int) -> None:
    row.insert(i, None)


def _reverse_overlap(rng: random.Random, row: list[Action | None], i: int, a: Action | None, m: int) -> None:
    overlaps = [k for k, x in enumerate(row) if x is not None and x.sub_actions]
    if overlaps:
        k = rng.choice(overlaps)
        parts = row[k].parts  # type: ignore[union-attr]
        row[k] = Action.overlap(*reversed(parts))


def _overlap_neighbours(rng: random.Random, row: list[Action | None], i: int, a: Action | None, m: int) -> None:
    """Two neighbouring compute actions become one OVERLAP_F_B, in either order (I then W of
    one microbatch, reversed, is one that can never run)."""
    plain = [
        k
        for k in range(len(row) - 1)
        if all(x is not None and x.kind.is_compute and not x.sub_actions for x in row[k : k + 2])
    ]
    if plain:
        k = rng.choice(plain)
        first, second = row[k], row[k + 1]
        assert first is not None and second is not None
        pair = (first, second) if rng.random() < 0.5 else (second, first)
        row[k : k + 2] = [Action.overlap(*pair)]


EDITS: list[Callable[[random.Random, list[Action | None], int, Action | None, int], None]] = [
    _swap_neighbours,
    _swap_neighbours,
    _move,
    _delete,
    _double,
    _renumber,
    _move_message,
    _move_message,
    _idle,
    _reverse_overlap,
    _overlap_neighbours,
]


def _verdict(schedule: Schedule, matching: str) -> str:
    try:
        validate(schedule, matching=matching)
    except ScheduleError as err:
        return f"rejected: {err}"
    return "accepted"


@pytest.mark.parametrize("matching", ["nccl", "gloo"])
def test_validate_agrees_with_the_reference_on_edited_schedules(matching: str) -> None:
    rng = random.Random(f"reference-{matching}")
    checked = rejected = 0
    disagreements = []
    for label, base in _bases():
        if matching == "gloo" or "recv_ahead" not in label:  # (early receives need gloo's matching)
            assert accepts(base, matching), f"the reference rejects {label} as generated"
        for k in range(EDITS_PER_SCHEDULE + 1):
            try:
                edited = Schedule(
                    _edit(rng, base) if k else base.actions,
                    num_stages=base.num_stages,
                    num_microbatches=base.num_microbatches,
                    stage_to_rank=base.stage_to_rank,
                )
            except ScheduleError:
                continue  # refused when built (a stage on two ranks): nothing to validate
            ours, theirs = _verdict(edited, matching), accepts(edited, matching)
            checked += 1
            rejected += not theirs
            if (ours == "accepted") != theirs:
                rows = [
                    " ".join("." if a is None else str(a) for a in edited.actions[r]) for r in range(edited.num_ranks)
                ]
                disagreements.append(
                    f"{label}: validate {ours}; reference {'accepts' if theirs else 'rejects'}: {rows}"
                )
    assert not disagreements, "\n".join(disagreements[:5])
    assert checked > 5000 and 0.3 < rejected / checked < 0.95, (checked, rejected)
