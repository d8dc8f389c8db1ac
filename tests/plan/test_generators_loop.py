"""Loop-placement generators: 1F1B, Interleaved1F1B, LoopedBFS, ForwardOnly.

The checks here are written from docs/semantics.md and do not use the product's validator or
simulator: ``execute`` runs the rank programs by abstract execution (an action runs once the
actions it depends on have run; stuck ranks are a deadlock), timing each action under the
simple cost model, and ``peak_activations`` counts held activations in program order.
"""

from __future__ import annotations

import math
from collections import Counter
from dataclasses import dataclass

import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st

from pipetrain.plan import Action, ActionKind, Schedule, ScheduleError, build_schedule, schedule_names

RANKS = st.integers(1, 16)
MICROBATCHES = st.integers(1, 64)
STAGES_PER_RANK = st.integers(1, 4)
FAST = settings(max_examples=40, deadline=None)

Key = tuple[str, int, int]


# --------------------------------------------------------------------------- checkers
@dataclass
class Run:
    makespan: float
    end: dict[Key, float]


def _needs(action: Action, num_stages: int) -> list[Key]:
    """What ``action`` waits for (docs/semantics.md, "Dependencies"); "G" is an input-gradient."""
    s, m = action.stage, action.microbatch
    assert m is not None
    if action.kind is ActionKind.F:
        return [("F", s - 1, m)] if s > 0 else []
    if action.kind in (ActionKind.B, ActionKind.I):
        return [("F", s, m)] + ([("G", s + 1, m)] if s < num_stages - 1 else [])
    if action.kind is ActionKind.W:
        return [("I", s, m)]
    raise AssertionError(f"unexpected action {action} in a compute-only schedule")


def execute(schedule: Schedule, f: float = 1.0, b: float = 2.0, comm: float = 0.0) -> Run:
    """Run every rank's program in order; fail naming the stuck actions if some can never run."""
    duration = {ActionKind.F: f, ActionKind.B: b, ActionKind.I: b / 2, ActionKind.W: b / 2}
    programs = {r: [a for a in acts if a is not None] for r, acts in schedule.actions.items()}
    pos = dict.fromkeys(programs, 0)
    free = dict.fromkeys(programs, 0.0)
    end: dict[Key, float] = {}
    producer_rank: dict[Key, int] = {}
    progress = True
    while progress:
        progress = False
        for rank, program in programs.items():
            while pos[rank] < len(program):
                action = program[pos[rank]]
                needs = _needs(action, schedule.num_stages)
                if any(key not in end for key in needs):
                    break
                start = max([free[rank]] + [end[k] + (0.0 if producer_rank[k] == rank else comm) for k in needs])
                finish = start + duration[action.kind]
                keys = [(action.kind.value, action.stage, action.microbatch)]
                if action.kind.is_backward:
                    keys.append(("G", action.stage, action.microbatch))
                for key in keys:
                    assert key not in end, f"rank {rank}: {action} runs twice"
                    end[key] = finish
                    producer_rank[key] = rank
                free[rank] = finish
                pos[rank] += 1
                progress = True
    stuck = {r: str(programs[r][pos[r]]) for r in programs if pos[r] < len(programs[r])}
    if stuck:
        pytest.fail(f"deadlock: ranks wait forever at {stuck}")
    return Run(max(free.values()), end)


def peak_activations(program: list[Action | None], forward_only: bool = False) -> int:
    """Peak activations held in program order (docs/semantics.md, "Memory accounting")."""
    held = peak = 0
    for action in program:
        if action is None:
            continue
        if action.kind is ActionKind.F:
            held += 1
            peak = max(peak, held)
            if forward_only:
                held -= 1
        elif action.kind in (ActionKind.B, ActionKind.W):
            held -= 1
    return peak


def check_complete(schedule: Schedule, kinds: tuple[ActionKind, ...] = (ActionKind.F, ActionKind.B)) -> None:
    counts = Counter((a.stage, a.kind, a.microbatch) for a in schedule.iter_actions() if a is not None)
    expected = {
        (s, k, m): 1 for s in range(schedule.num_stages) for m in range(schedule.num_microbatches) for k in kinds
    }
    assert dict(counts) == expected


def check_loop_placement(schedule: Schedule, num_ranks: int, stages_per_rank: int) -> None:
    assert schedule.num_ranks == num_ranks
    assert schedule.num_stages == num_ranks * stages_per_rank
    assert schedule.stage_to_rank == {s: s % num_ranks for s in range(num_ranks * stages_per_rank)}
    for rank, program in schedule.actions.items():
        assert all(a is None or a.stage % num_ranks == rank for a in program), f"rank {rank} runs a foreign stage"


def check_microbatch_order(schedule: Schedule) -> None:
    """Each stage runs its forwards in microbatch order (what a receiver expects first)."""
    for program in schedule.actions.values():
        seen: dict[tuple[int, ActionKind], list[int]] = {}
        for a in program:
            if a is not None and a.microbatch is not None:
                seen.setdefault((a.stage, a.kind), []).append(a.microbatch)
        for (_, kind), mbs in seen.items():
            if kind is ActionKind.F:
                assert mbs == sorted(mbs)


def validate_both(schedule: Schedule) -> None:
    """The product's validator accepts the schedule, compute-only and lowered."""
    schedule.validate()
    lowered = schedule.lower()
    assert lowered.is_lowered or schedule.num_ranks == 1
    lowered.validate()


def order(text: str) -> list[Action]:
    return [Action.parse(cell) for cell in text.split()]


def compute_only(schedule: Schedule, rank: int) -> list[Action]:
    return [a for a in schedule.actions[rank] if a is not None]


# ----------------------------------------------------------------------------- 1F1B
@FAST
@given(p=RANKS, m=MICROBATCHES)
@example(p=1, m=1)
@example(p=16, m=1)
@example(p=16, m=64)
def test_1f1b_properties(p: int, m: int) -> None:
    s = build_schedule("1F1B", p, m)
    validate_both(s)
    check_complete(s)
    check_loop_placement(s, p, 1)
    run = execute(s)
    # Bubble (p-1)(F+B), and not a step more, for every m (torch needs m >= p).
    assert run.makespan == 3 * (m + p - 1)
    for r in range(p):
        assert peak_activations(s.actions[r]) == min(p - r, m)
        assert [a.microbatch for a in compute_only(s, r) if a.kind is ActionKind.B] == list(range(m))


def test_1f1b_p4_m8_is_the_papers_figure() -> None:
    """PipeDream-Flush / Megatron-LM Fig. 4 (top): p - 1 - r warm-up forwards, then 1F1B."""
    s = build_schedule("1F1B", 4, 8)
    assert compute_only(s, 0) == order("0F0 0F1 0F2 0F3 0B0 0F4 0B1 0F5 0B2 0F6 0B3 0F7 0B4 0B5 0B6 0B7")
    assert compute_only(s, 1) == order("1F0 1F1 1F2 1B0 1F3 1B1 1F4 1B2 1F5 1B3 1F6 1B4 1F7 1B5 1B6 1B7")
    assert compute_only(s, 2) == order("2F0 2F1 2B0 2F2 2B1 2F3 2B2 2F4 2B3 2F5 2B4 2F6 2B5 2F7 2B6 2B7")
    assert compute_only(s, 3) == order("3F0 3B0 3F1 3B1 3F2 3B2 3F3 3B3 3F4 3B4 3F5 3B5 3F6 3B6 3F7 3B7")


def test_1f1b_fewer_microbatches_than_ranks() -> None:
    s = build_schedule("1F1B", 4, 2)
    assert compute_only(s, 0) == order("0F0 0F1 0B0 0B1")
    assert compute_only(s, 2) == order("2F0 2F1 2B0 2B1")
    assert compute_only(s, 3) == order("3F0 3B0 3F1 3B1")


def test_1f1b_rejects_several_stages_per_rank() -> None:
    with pytest.raises(ScheduleError, match=r"1F1B: one stage per rank .*stages_per_rank=2.*Interleaved1F1B"):
        build_schedule("1F1B", 4, 8, stages_per_rank=2)
    assert build_schedule("1F1B", 4, 8, stages_per_rank=1) == build_schedule("1F1B", 4, 8)


# ------------------------------------------------------------------- Interleaved1F1B
def torch_like_peak(rank: int, p: int, m: int, v: int) -> int:
    """Activations a torch-style interleaved rank holds: warm-up ``(v-1)·g + 2(p-1-r)`` forwards plus one.

    ``g`` is the round size ``m / (m // p)`` torch uses (rounded up where torch rejects m).
    """
    rounds = max(1, m // p)
    group = math.ceil(m / rounds)
    return min(m * v, (v - 1) * group + 2 * (p - 1 - rank) + 1)


@FAST
@given(p=RANKS, m=MICROBATCHES, v=STAGES_PER_RANK)
@example(p=1, m=1, v=1)
@example(p=1, m=5, v=4)
@example(p=16, m=1, v=4)
@example(p=4, m=9, v=2)
@example(p=16, m=63, v=4)
@example(p=5, m=64, v=3)
def test_interleaved_properties(p: int, m: int, v: int) -> None:
    s = build_schedule("Interleaved1F1B", p, m, stages_per_rank=v)
    check_complete(s)
    check_loop_placement(s, p, v)
    check_microbatch_order(s)
    run = execute(s)
    validate_both(s)
    if m >= p:
        # No needless bubble: one stage's fill and drain, (p-1)(F+B), for any m, divisible or not.
        assert run.makespan == 3 * (m * v + p - 1)
    for r in range(p):
        assert peak_activations(s.actions[r]) <= torch_like_peak(r, p, m, v)


@pytest.mark.parametrize(
    ("p", "m", "v"), [(4, 10, 2), (4, 12, 3), (4, 7, 2), (3, 5, 2), (8, 16, 4), (4, 3, 2), (2, 2, 1)]
)
def test_interleaved_memory_matches_torchs_where_torch_runs(p: int, m: int, v: int) -> None:
    assert m % max(1, m // p) == 0  # configurations torch 2.13 accepts
    s = build_schedule("Interleaved1F1B", p, m, stages_per_rank=v)
    assert [peak_activations(s.actions[r]) for r in range(p)] == [torch_like_peak(r, p, m, v) for r in range(p)]


def test_interleaved_p4_m8_v2_is_megatrons_figure() -> None:
    """Megatron-LM Fig. 4 (bottom): groups of p microbatches per chunk, warm-up (v-1)p + 2(p-1-r)."""
    s = build_schedule("Interleaved1F1B", 4, 8, stages_per_rank=2)
    assert compute_only(s, 0) == order(
        "0F0 0F1 0F2 0F3 4F0 4F1 4F2 4F3 0F4 0F5 "
        "0F6 4B0 0F7 4B1 4F4 4B2 4F5 4B3 4F6 0B0 4F7 0B1 "
        "0B2 0B3 4B4 4B5 4B6 4B7 0B4 0B5 0B6 0B7"
    )
    assert compute_only(s, 3) == order(
        "3F0 3F1 3F2 3F3 "
        "7F0 7B0 7F1 7B1 7F2 7B2 7F3 7B3 3F4 3B0 3F5 3B1 3F6 3B2 3F7 3B3 7F4 7B4 7F5 7B5 7F6 7B6 7F7 7B7 "
        "3B4 3B5 3B6 3B7"
    )


def test_interleaved_spreads_a_remainder_over_the_groups() -> None:
    """m = 9, p = 4: groups {0..4} and {5..8} (torch rejects 9; Megatron would leave a group of 1)."""
    s = build_schedule("Interleaved1F1B", 4, 9, stages_per_rank=2)
    forwards = [str(a) for a in compute_only(s, 3) if a.kind is ActionKind.F]
    assert forwards == "3F0 3F1 3F2 3F3 3F4 7F0 7F1 7F2 7F3 7F4 3F5 3F6 3F7 3F8 7F5 7F6 7F7 7F8".split()
    assert execute(s).makespan == 3 * (9 * 2 + 4 - 1)


def test_interleaved_one_stage_per_rank_and_defaults() -> None:
    assert build_schedule("Interleaved1F1B", 4, 8).num_stages == 8  # default: 2 stages per rank
    s = build_schedule("Interleaved1F1B", 4, 8, stages_per_rank=1)
    check_complete(s)
    execute(s)


def test_flexible_alias_and_case() -> None:
    reference = build_schedule("Interleaved1F1B", 3, 7, stages_per_rank=3)
    assert build_schedule("FlexibleInterleaved1F1B", 3, 7, stages_per_rank=3) == reference
    assert build_schedule("interleaved1f1b", 3, 7, stages_per_rank=3) == reference
    assert "FlexibleInterleaved1F1B" not in schedule_names()


# -------------------------------------------------------------------------- LoopedBFS
@FAST
@given(p=RANKS, m=MICROBATCHES, v=STAGES_PER_RANK)
@example(p=1, m=1, v=1)
@example(p=16, m=64, v=4)
def test_looped_bfs_properties(p: int, m: int, v: int) -> None:
    s = build_schedule("LoopedBFS", p, m, stages_per_rank=v)
    validate_both(s)
    check_complete(s)
    check_loop_placement(s, p, v)
    execute(s)
    execute(s, comm=0.5)
    for r in range(p):
        program = compute_only(s, r)
        kinds = [a.kind for a in program]
        assert kinds == [ActionKind.F] * (m * v) + [ActionKind.B] * (m * v)
        # Breadth-first: each stage's microbatches back to back, stages in loop order; backward mirrored.
        local = list(range(r, p * v, p))
        assert [a.stage for a in program[: m * v]] == [stage for stage in local for _ in range(m)]
        assert program[m * v :] == [Action(a.stage, ActionKind.B, a.microbatch) for a in reversed(program[: m * v])]
        assert peak_activations(s.actions[r]) == m * v


def test_looped_bfs_known_order() -> None:
    s = build_schedule("LoopedBFS", 2, 3)  # default: 2 stages per rank
    assert compute_only(s, 0) == order("0F0 0F1 0F2 2F0 2F1 2F2 2B2 2B1 2B0 0B2 0B1 0B0")
    assert compute_only(s, 1) == order("1F0 1F1 1F2 3F0 3F1 3F2 3B2 3B1 3B0 1B2 1B1 1B0")


# ------------------------------------------------------------------------ ForwardOnly
@FAST
@given(p=RANKS, m=MICROBATCHES, v=STAGES_PER_RANK)
@example(p=1, m=1, v=1)
@example(p=16, m=3, v=4)
def test_forward_only_properties(p: int, m: int, v: int) -> None:
    s = build_schedule("ForwardOnly", p, m, stages_per_rank=v)
    validate_both(s)
    check_complete(s, kinds=(ActionKind.F,))
    check_loop_placement(s, p, v)
    check_microbatch_order(s)
    run = execute(s, f=1.0, b=0.0)
    # The last microbatch's chain of p·v forwards starts no earlier than m - 1: that bound is met.
    assert run.makespan == (m * v + p - 1 if m >= p else p * v + m - 1)
    assert all(peak_activations(s.actions[r], forward_only=True) == 1 for r in range(p))


def test_forward_only_defaults_to_one_stage_per_rank() -> None:
    s = build_schedule("ForwardOnly", 3, 2)
    assert s.num_stages == 3
    assert compute_only(s, 1) == order("1F0 1F1")


# ------------------------------------------------------------------ names and errors
def test_names_registered_in_order() -> None:
    names = schedule_names()
    loop = ["GPipe", "1F1B", "Interleaved1F1B", "LoopedBFS"]
    assert names[: len(loop)] == loop
    assert names[-1] == "ForwardOnly"


@pytest.mark.parametrize("name", ["1F1B", "Interleaved1F1B", "LoopedBFS", "ForwardOnly"])
@pytest.mark.parametrize(
    ("ranks", "microbatches", "stages_per_rank", "words"),
    [
        (0, 4, None, "num_ranks must be an integer >= 1"),
        (4, 0, None, "num_microbatches must be an integer >= 1"),
        (4, 4, 0, "stages_per_rank must be an integer >= 1"),
    ],
)
def test_bad_sizes_name_the_constraint(
    name: str, ranks: int, microbatches: int, stages_per_rank: int | None, words: str
) -> None:
    with pytest.raises(ScheduleError, match=words):
        build_schedule(name, ranks, microbatches, stages_per_rank)
