"""Validation: broken schedules are rejected naming rank, step, action and rule; good ones pass.

The deadlock verdict is cross-checked against a deliberately naive reference executor of the
docs/semantics.md model (fixed-point iteration, quadratic, obviously faithful) on random
mutations of valid schedules.
"""

from __future__ import annotations

import random
import re
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pipetrain.plan import Action, ActionKind, Costs, Schedule, ScheduleError, build_schedule, schedule_names, simulate

K = ActionKind


def sched(*rows: str, **kwargs: object) -> Schedule:
    """A schedule from one whitespace-separated row of actions per rank ('.' is an idle step)."""
    return Schedule(
        {r: [None if c == "." else Action.parse(c) for c in row.split()] for r, row in enumerate(rows)},
        **kwargs,  # type: ignore[arg-type]
    )


def rejected(schedule: Schedule) -> str:
    with pytest.raises(ScheduleError) as info:
        schedule.validate()
    return str(info.value)


WHERE = re.compile(r"^rank \d+, step \d+, action \S+: ")


# ------------------------------------------------------------------ hand-written broken schedules
BROKEN = {
    "missing B": (("0F0 0F1 0B0", "1F0 1F1 1B0 1B1"), "rank 0, step 1, action 0F1: has no backward"),
    "duplicate F": (("0F0 0F0 0B0", "1F0 1B0"), "rank 0, step 1, action 0F0: duplicate 0F0"),
    "B with I": (("0F0 0I0 0B0 0W0",), "rank 0, step 2, action 0B0: stage 0 microbatch 0 already has 0I0"),
    "B with W": (("0F0 0B0 0W0",), "rank 0, step 2, action 0W0: stage 0 microbatch 0 already has a full backward"),
    "I without W": (("0F0 0I0",), "rank 0, step 1, action 0I0: has no matching 0W0"),
    "W without I": (("0F0 0W0",), "rank 0, step 1, action 0W0: needs 0I0, which is missing"),
    "B without F": (("0B0 0F1 0B1",), "rank 0, step 0, action 0B0: its forward 0F0 is missing"),
    "W before I": (("0F0 0W0 0I0", "1F0 1I0 1W0"), "rank 0, step 1, action 0W0: needs 0I0, which rank 0 runs later"),
    "B before F": (("0B0 0F0",), "rank 0, step 0, action 0B0: needs 0F0, which rank 0 runs later"),
    "cross-rank cycle": (
        ("0F0 0B0 0F1 0B1", "1F1 1B1 1F0 1B0"),
        "rank 0, step 1, action 0B0: deadlock: waits for 1B0 (rank 1, step 3), which never runs; "
        "also rank 1, step 0, action 1F1: waits for 0F1 (rank 0, step 2)",
    ),
    "SEND without RECV": (("0F0 0SEND_F0", "1F0"), "rank 1, step 0, action 1F0: needs the output of 0F0 from rank 0"),
    "RECV without SEND": (("0F0", "1RECV_F0 1F0"), "rank 0, step 0, action 0F0: its output goes to stage 1 on rank 1"),
    "RECV after consumer": (("0F0 0SEND_F0", "1F0 1RECV_F0"), "rank 1, step 1, action 1RECV_F0: receives for 1F0"),
    "SEND before producer": (("0SEND_F0 0F0", "1RECV_F0 1F0"), "rank 0, step 0, action 0SEND_F0: sends the output"),
    "duplicate SEND": (("0F0 0SEND_F0 0SEND_F0", "1RECV_F0 1F0"), "rank 0, step 2, action 0SEND_F0: duplicate"),
    "FIFO mismatch": (
        ("0F0 0F1 0SEND_F0 0SEND_F1", "1RECV_F1 1RECV_F0 1F0 1F1"),
        "rank 1, step 0, action 1RECV_F1: FIFO order mismatch: message 1 from rank 0 to rank 1 is 0SEND_F0",
    ),
    "NCCL group deadlock": (
        (
            "0F0 0SEND_F0 0F1 0SEND_F1 0RECV_B0 0F2 0SEND_F2 0B0 0RECV_B1 0B1 0RECV_B2 0B2",
            "1RECV_F0 1RECV_F1 1F0 1B0 1RECV_F2 1F1 1SEND_B0 1B1 1SEND_B1 1F2 1B2 1SEND_B2",
        ),
        "rank 0, step 7, action 0B0: deadlock: waits for its 0RECV_B0 (step 4), which never completes: the matching "
        "1SEND_B0 (rank 1, step 6) never starts, as rank 1's earlier communication group at step 4",
    ),
    "last stage sends forward": (("0F0 0SEND_F0 0B0",), "there is no forward message"),
    "gradient in forward-only": (("0F0 0SEND_F0", "1RECV_F0 1F0 1SEND_B0"), "forward-only schedule sends no gradients"),
    "REDUCE_GRAD too early": (("0F0 0REDUCE_GRAD 0B0",), "rank 0, step 2, action 0B0: backward of stage 0 after its"),
    "REDUCE_GRAD twice": (("0F0 0B0 0REDUCE_GRAD 0REDUCE_GRAD",), "rank 0, step 3, action 0REDUCE_GRAD: duplicate"),
    "REDUCE_GRAD forward-only": (("0F0 0REDUCE_GRAD",), "forward-only schedule has no gradients to reduce"),
    "compute while resharded": (("0UNSHARD 0F0 0RESHARD 0B0",), "rank 0, step 3, action 0B0: stage 0 is sharded here"),
    "compute before UNSHARD": (("0F0 0UNSHARD 0B0 0RESHARD",), "rank 0, step 0, action 0F0: stage 0 is sharded here"),
    "UNSHARD twice": (("0UNSHARD 0F0 0UNSHARD 0B0",), "rank 0, step 2, action 0UNSHARD: stage 0 is already unsharded"),
    "RESHARD without UNSHARD": (
        ("0F0 0RESHARD 0B0",),
        "rank 0, step 1, action 0RESHARD: stage 0 is not unsharded here",
    ),
}


@pytest.mark.parametrize("case", list(BROKEN))
def test_broken_schedule_is_rejected_naming_rank_step_action(case: str) -> None:
    rows, expected = BROKEN[case]
    message = rejected(sched(*rows))
    assert expected in message
    assert WHERE.match(message) or message.startswith("rank "), message


def test_same_rank_stage_pairs_exchange_no_messages() -> None:
    s = Schedule({0: [Action.parse(x) for x in "0F0 0SEND_F0 1RECV_F0 1F0 1B0 0B0".split()]})
    assert "stages 0 and 1 both live on rank 0" in rejected(s)


def test_stage_on_two_ranks() -> None:
    with pytest.raises(ScheduleError, match="rank 1, step 1, action 0B0: stage 0 already runs on rank 0"):
        sched("0F0", "1F0 0B0 1B0")
    # Programs are plain lists; a stage added later to another rank is caught by validate().
    s = sched("0F0 0B0", "1F0 1B0")
    s.actions[1].insert(0, Action(0, K.F, 1))
    assert "rank 1, step 0, action 0F1: stage 0 lives on rank 0" in rejected(s)


def test_out_of_range_after_edit() -> None:
    s = sched("0F0 0B0", "1F0 1B0")
    s.actions[0].append(Action(0, K.F, 5))
    assert "rank 0, step 2, action 0F5: microbatch 5 is out of range" in rejected(s)
    s = sched("0F0 0B0", "1F0 1B0")
    s.actions[0].append(Action(9, K.F, 0))
    assert "stage 9 does not exist" in rejected(s)


@pytest.mark.parametrize(
    ("old", "new", "where"),
    [
        ("0B7", "0B9", "rank 0, step 15, action 0B9: microbatch 9"),  # the case: 8 microbatches, a stray 9
        ("0B0", "0B8", "rank 0, step 2, action 0B8: microbatch 8"),  # one past the last: 0..8 named, no forward of 8
        ("1F3", "1F12", "rank 1, step 6, action 1F12: microbatch 12"),  # a stray forward
    ],
)
def test_a_stray_microbatch_in_a_csv_is_named(tmp_path: Path, old: str, new: str, where: str) -> None:
    """The number of microbatches of a CSV is its largest plus one: a stray 0B9 among 8 made it 10,
    and the error named an innocent cell ("0F0: has no backward"). It names the stray cell."""
    path = tmp_path / "stray.csv"
    path.write_text(build_schedule("1F1B", 2, 8).to_csv_text().replace(old, new, 1))
    schedule = Schedule.from_csv(path)
    message = rejected(schedule)
    assert message.startswith(f"{where} is outside 0..7 (no stage has a forward of microbatch 8)"), message
    for lowering in ({}, {"comms": False}, {"merge_iw": True}):
        with pytest.raises(ScheduleError) as by_lower:
            schedule.lower(**lowering)
        assert str(by_lower.value) == message


def test_a_microbatch_past_a_given_count_is_named() -> None:
    with pytest.raises(
        ScheduleError, match=r"^rank 0, step 3, action 0B9: microbatch 9 is outside 0\.\.1 \(the schedule"
    ):
        sched("0F0 0F1 0B0 0B9", num_microbatches=2)


def test_a_missing_microbatch_is_not_blamed_on_a_stray_one() -> None:
    """Microbatch 1 left out on every stage, 2 complete: the gap is the error, not 2. Likewise a
    count given larger than any microbatch named."""
    assert "rank 0: stage 0 microbatch 1 has no forward 0F1" in rejected(sched("0F0 0B0 0F2 0B2", "1F0 1B0 1F2 1B2"))
    assert "stage 0 microbatch 1 has no forward 0F1" in rejected(sched("0F0 0B0", num_microbatches=2))


def test_non_action_cell() -> None:
    s = sched("0F0 0B0")
    s.actions[0].append("0F1")  # type: ignore[arg-type]
    assert "rank 0, step 2: expected an Action or None" in rejected(s)


def test_missing_microbatch_everywhere() -> None:
    s = sched("0F0 0B0", "1F0 1B0", num_microbatches=2)
    assert "stage 0 microbatch 1 has no forward 0F1" in rejected(s)


def test_group_order_fixed_is_accepted() -> None:
    # The NCCL case above with rank 1's 1RECV_F2 posted together with 1SEND_B0: one group, no cycle.
    sched(
        "0F0 0SEND_F0 0F1 0SEND_F1 0RECV_B0 0F2 0SEND_F2 0B0 0RECV_B1 0B1 0RECV_B2 0B2",
        "1RECV_F0 1RECV_F1 1F0 1B0 1F1 1SEND_B0 1RECV_F2 1B1 1SEND_B1 1F2 1B2 1SEND_B2",
    ).validate()


def test_idle_step_splits_a_group() -> None:
    # One group [0RECV_B0 0SEND_F0] is fine; an idle step between them makes two groups, and the
    # receive's group then waits for a send that waits for the send's group: deadlock.
    rows = ("0F0 0RECV_B0 0SEND_F0 0B0", "1RECV_F0 1F0 1B0 1SEND_B0")
    sched(*rows).validate()
    message = rejected(sched("0F0 0RECV_B0 . 0SEND_F0 0B0", rows[1]))
    assert "deadlock" in message


def test_overlap_f_b_dependencies() -> None:
    # A part may use an earlier part of the same OVERLAP_F_B; two ranks each overlapping forward
    # and backward of different microbatches validate compute-only and lowered.
    s = sched("0F0 0F1 (0F2;0B0)OVERLAP_F_B 0B1 0B2", "1F0 (1F1;1B0)OVERLAP_F_B (1F2;1B1)OVERLAP_F_B 1B2")
    s.validate()
    s.lower().validate()
    sched("(0F0;0B0)OVERLAP_F_B").validate()
    assert "deadlock" in rejected(sched("(0F0;0B0)OVERLAP_F_B", "(1F0;1B0)OVERLAP_F_B"))


@pytest.mark.parametrize(
    ("rows", "part", "needs", "maker"),
    [
        (("(0B0;0F0)OVERLAP_F_B",), "0B0", "0F0", "0F0"),
        (("0F0 (0W0;0I0)OVERLAP_F_B",), "0W0", "0I0", "0I0"),
        (("(1F0;0F0)OVERLAP_F_B 1B0 0B0",), "1F0", "0F0", "0F0"),
        (("0F0 (0W0;0I0)OVERLAP_F_B", "1F0 1I0 1W0"), "0W0", "0I0", "0I0"),
        (("0F0 0SEND_F0 0RECV_B0 (0W0;0I0)OVERLAP_F_B", "1RECV_F0 1F0 1I0 1SEND_B0 1W0"), "0W0", "0I0", "0I0"),
    ],
)
def test_an_overlap_part_cannot_use_a_later_part(rows: tuple[str, ...], part: str, needs: str, maker: str) -> None:
    """The parts of an OVERLAP_F_B run in order (the runtime runs them one after another): a part
    that needs what a later part makes can never run. helper-22's fuzzing found these accepted.
    lower() and simulate() refuse them with validate's words."""
    message = rejected(sched(*rows))
    assert WHERE.match(message), message
    assert f"its part {part} needs {needs}, which its later part {maker} makes" in message
    schedule = sched(*rows)
    if not schedule.is_lowered:
        with pytest.raises(ScheduleError, match="later part"):
            schedule.lower()
    with pytest.raises(ScheduleError, match="later part"):
        simulate(schedule, Costs())


# ------------------------------------------------------------------------ every generator, a grid
def grid(name: str, samples: int = 16) -> list[tuple[int, int, int | None]]:
    """Corners plus a seeded sample of ranks 1-16, stages per rank 1-4, microbatches 1-64."""
    rng = random.Random(f"grid-{name}")
    configs: list[tuple[int, int, int | None]] = [(1, 1, None), (2, 1, None), (4, 8, None), (16, 64, None)]
    configs += [(p, m, v) for p, m, v in [(1, 1, 2), (2, 3, 2), (4, 8, 2), (3, 7, 3), (16, 64, 2), (5, 9, 4)]]
    configs += [(rng.randint(1, 16), rng.randint(1, 64), rng.choice([None, 1, 2, 3, 4])) for _ in range(samples)]
    return configs


@pytest.mark.parametrize("name", schedule_names())
def test_every_generator_validates_compute_and_lowered(name: str) -> None:
    built = 0
    for p, m, v in grid(name):
        try:
            s = build_schedule(name, p, m, v)
        except ScheduleError:
            continue
        built += 1
        s.validate()
        low = s.lower()
        low.validate()
        backward = any(a is not None and a.kind is not K.F for a in s.iter_actions())
        full = s.lower(fsdp=True, grad_reduce=backward, prefetch=(p + m) % 3)
        full.validate()
    assert built >= 5, f"{name} built only {built} grid configurations"


# --------------------------------------------------------------- reference executor, mutations
def reference_finishes(schedule: Schedule) -> bool:
    """Naive fixed-point execution of docs/semantics.md (only for schedules that pass structure)."""
    R, S = schedule.num_ranks, schedule.num_stages
    rank_of = schedule.stage_to_rank
    progs = [schedule.actions[r] for r in range(R)]
    lowered = any(a is not None and a.kind.is_comm for a in schedule.iter_actions())
    # groups: maximal runs of consecutive SEND/RECV
    groups: list[list[tuple[int, int]]] = []  # (rank, step)
    group_of: dict[tuple[int, int], int] = {}
    for r, prog in enumerate(progs):
        for i, a in enumerate(prog):
            if a is not None and a.kind.is_comm:
                if i > 0 and (r, i - 1) in group_of:
                    groups[group_of[(r, i - 1)]].append((r, i))
                else:
                    groups.append([(r, i)])
                group_of[(r, i)] = len(groups) - 1

    def msg(a: Action) -> tuple[str, int, int]:
        if a.kind in (K.SEND_F, K.SEND_B):
            return (a.kind.value[-1], a.stage, a.microbatch)  # type: ignore[return-value]
        src = a.stage - 1 if a.kind is K.RECV_F else a.stage + 1
        return (a.kind.value[-1], src, a.microbatch)  # type: ignore[return-value]

    peer: dict[tuple[int, int], tuple[int, int]] = {}
    by_msg: dict[tuple[str, int, int], tuple[int, int]] = {}
    for r, i in group_of:
        a = progs[r][i]
        assert a is not None
        if a.kind in (K.SEND_F, K.SEND_B):
            by_msg[msg(a)] = (r, i)
    for r, i in group_of:
        a = progs[r][i]
        assert a is not None
        if a.kind in (K.RECV_F, K.RECV_B):
            peer[(r, i)] = by_msg[msg(a)]
            peer[by_msg[msg(a)]] = (r, i)
    done: set[tuple[str, int, int]] = set()
    recv_done: set[tuple[str, int, int]] = set()
    pc = [0] * R
    issued = [False] * len(groups)
    started = [False] * len(groups)
    completed: set[tuple[int, int]] = set()

    def ready(part: Action, r: int) -> bool:
        s, m = part.stage, part.microbatch
        assert m is not None
        need: list[tuple[tuple[str, int, int], bool]] = []
        if part.kind is K.F and s > 0:
            need.append((("F", s - 1, m), rank_of[s - 1] != r))
        if part.kind in (K.B, K.I):
            need.append((("F", s, m), False))
            if s < S - 1:
                need.append((("X", s + 1, m), rank_of[s + 1] != r))
        if part.kind is K.W:
            need.append((("X", s, m), False))
        for key, cross in need:
            if lowered and cross:
                if ("F" if key[0] == "F" else "B", key[1], key[2]) not in recv_done:
                    return False
            elif key not in done:
                return False
        return True

    changed = True
    while changed:
        changed = False
        for r in range(R):
            while pc[r] < len(progs[r]):
                a = progs[r][pc[r]]
                if a is None or a.kind in (K.UNSHARD, K.RESHARD, K.REDUCE_GRAD):
                    pc[r] += 1
                elif a.kind.is_comm:
                    issued[group_of[(r, pc[r])]] = True
                    pc[r] += 1
                else:
                    finished = set()
                    ok = True
                    for part in a.parts:
                        key = (
                            "F" if part.kind is K.F else "X" if part.kind in (K.B, K.I) else "W",
                            part.stage,
                            part.microbatch,
                        )
                        saved = set(done)
                        done.update(finished)
                        ok = ready(part, r)
                        done.clear()
                        done.update(saved)
                        if not ok:
                            break
                        finished.add(key)  # type: ignore[arg-type]
                    if not ok:
                        break
                    done.update(finished)
                    pc[r] += 1
                changed = True
        for g, members in enumerate(groups):
            r = members[0][0]
            earlier = [h for h in range(g) if groups[h][0][0] == r]
            if issued[g] and not started[g] and all(all(x in completed for x in groups[h]) for h in earlier):
                started[g] = True
                changed = True
        for op in group_of:
            if op not in completed and started[group_of[op]] and started[group_of[peer[op]]]:
                completed.add(op)
                a = progs[op[0]][op[1]]
                assert a is not None
                if a.kind in (K.RECV_F, K.RECV_B):
                    recv_done.add(msg(a))
                changed = True
    return all(pc[r] == len(progs[r]) for r in range(R)) and len(completed) == len(group_of)


MUTABLE = [n for n in schedule_names()]


@settings(max_examples=150, deadline=None)
@given(
    name=st.sampled_from(MUTABLE),
    p=st.integers(2, 3),
    m=st.integers(1, 4),
    lowered=st.booleans(),
    seed=st.integers(0, 2**32 - 1),
    moves=st.integers(1, 3),
)
def test_deadlock_verdict_matches_reference(name: str, p: int, m: int, lowered: bool, seed: int, moves: int) -> None:
    """Move random actions within their rank; validate() and the naive executor must agree."""
    try:
        base = build_schedule(name, p, m)
    except ScheduleError:
        return
    if lowered:
        base = base.lower()
    rng = random.Random(seed)
    programs = {r: list(base.actions[r]) for r in range(base.num_ranks)}
    for _ in range(moves):
        r = rng.randrange(base.num_ranks)
        prog = programs[r]
        if len(prog) < 2:
            continue
        item = prog.pop(rng.randrange(len(prog)))
        prog.insert(rng.randrange(len(prog) + 1), item)
    mutated = base.replace(programs)
    try:
        mutated.validate()
    except ScheduleError as err:
        if "deadlock" in str(err):
            assert not reference_finishes(mutated), str(err)
        return
    assert reference_finishes(mutated)


def test_reference_agrees_on_hand_cases() -> None:
    nccl, _ = BROKEN["NCCL group deadlock"]
    assert not reference_finishes(sched(*nccl))
    cycle, _ = BROKEN["cross-rank cycle"]
    assert not reference_finishes(sched(*cycle))
    assert reference_finishes(build_schedule("1F1B", 3, 5).lower())


def test_schedule_without_compute() -> None:
    assert "at least one microbatch" in rejected(sched("0UNSHARD 0RESHARD"))
