"""Lowering passes: communication, FSDP, gradient reduction, I+W merging."""

from __future__ import annotations

import itertools
import random
from collections.abc import Callable
from typing import Any

import pytest
from hypothesis import event, given, settings
from hypothesis import strategies as st

from pipetrain.plan import Action, ActionKind, Schedule, ScheduleError, build_schedule, schedule_names
from pipetrain.plan.lower import (
    add_communication,
    add_fsdp,
    add_grad_reduction,
    forwards_only,
    lower,
    merge_input_weight,
)

K = ActionKind


def configs() -> list[tuple[str, Schedule]]:
    out = []
    for name in schedule_names():
        for p, m, v in [(1, 3, None), (3, 5, None), (4, 8, 2), (2, 6, 3)]:
            try:
                out.append((f"{name}-{p}x{m}x{v}", build_schedule(name, p, m, v)))
            except ScheduleError:
                pass
    return out


CONFIGS = configs()
IDS = [c[0] for c in CONFIGS]


def compute_only(program: list[Action | None]) -> list[Action]:
    return [a for a in program if a is not None and a.kind.is_compute]


def has_backward(s: Schedule) -> bool:
    return any(a is not None and any(p.kind is not K.F for p in a.parts) for a in s.iter_actions())


@pytest.mark.parametrize(("label", "schedule"), CONFIGS, ids=IDS)
def test_communication_pass(label: str, schedule: Schedule) -> None:
    low = add_communication(schedule)
    low.validate()
    rank_of = schedule.stage_to_rank
    S, M = schedule.num_stages, schedule.num_microbatches
    # Compute order per rank is kept; idle steps are dropped.
    for r in range(schedule.num_ranks):
        assert compute_only(low.actions[r]) == compute_only(schedule.actions[r])
        assert None not in low.actions[r]
    # One SEND and one RECV per dependency between stages on different ranks, none within a rank.
    cross_f = sum(1 for s in range(S - 1) if rank_of[s] != rank_of[s + 1])
    cross_b = sum(1 for s in range(1, S) if rank_of[s] != rank_of[s - 1]) if has_backward(schedule) else 0
    kinds = [a.kind for a in low.iter_actions() if a is not None]
    assert kinds.count(K.SEND_F) == kinds.count(K.RECV_F) == cross_f * M
    assert kinds.count(K.SEND_B) == kinds.count(K.RECV_B) == cross_b * M
    # Every SEND follows its producer directly, or other SEND/RECV of the same group.
    for r in range(low.num_ranks):
        program = low.actions[r]
        for i, a in enumerate(program):
            if a is not None and a.kind in (K.SEND_F, K.SEND_B):
                j = i - 1
                while program[j] is not None and program[j].kind.is_comm:  # type: ignore[union-attr]
                    j -= 1
                producer = program[j]
                assert producer is not None
                wanted = K.F if a.kind is K.SEND_F else (K.B, K.I)
                assert any(
                    p.stage == a.stage
                    and p.microbatch == a.microbatch
                    and p.kind in (wanted if isinstance(wanted, tuple) else (wanted,))
                    for p in producer.parts
                ), (label, r, i, a, producer)


def test_receives_are_posted_before_unrelated_compute() -> None:
    # 1F1B, 2 ranks: the forward of microbatch 1 arrives while rank 1 runs the backward of
    # microbatch 0, so its receive is posted before 1B0, not just before 1F1.
    low = build_schedule("1F1B", 2, 4).lower()
    program = [str(a) for a in low.actions[1]]
    assert program.index("1RECV_F1") < program.index("1B0") < program.index("1F1")
    # GPipe: each forward receive is posted as soon as the previous forward started.
    low = build_schedule("GPipe", 2, 3).lower()
    assert [str(a) for a in low.actions[1][:5]] == ["1RECV_F0", "1F0", "1RECV_F1", "1F1", "1RECV_F2"]


def test_v_placement_turn_has_no_messages() -> None:
    s = build_schedule("ZBVZeroBubble", 4, 8)
    low = s.lower()
    # Stages 3 and 4 both live on rank 3: no 3SEND_F, no 4RECV_F, no 4SEND_B, no 3RECV_B.
    names = {str(a) for a in low.actions[3]}
    assert not any(n.startswith(("3SEND_F", "4RECV_F", "4SEND_B", "3RECV_B")) for n in names)
    assert any(n.startswith("3SEND_B") for n in names)


def test_lowering_twice_is_refused() -> None:
    s = build_schedule("1F1B", 2, 4)
    low = s.lower()
    with pytest.raises(ScheduleError, match="already lowered"):
        low.lower()
    with pytest.raises(ScheduleError, match="already has SEND/RECV"):
        add_communication(low)
    with pytest.raises(ScheduleError, match="already lowered"):
        lower(add_fsdp(s))
    with pytest.raises(ScheduleError, match="already has UNSHARD/RESHARD"):
        add_fsdp(add_fsdp(s))
    with pytest.raises(ScheduleError, match="already has REDUCE_GRAD"):
        add_grad_reduction(add_grad_reduction(s))


def test_lower_without_passes_is_a_copy() -> None:
    s = build_schedule("GPipe", 2, 2)
    out = s.lower(comms=False)
    assert out == s
    assert out.actions[0] is not s.actions[0]


def test_deadlocking_compute_schedule_cannot_be_lowered() -> None:
    s = Schedule(
        {
            0: [Action.parse(x) for x in "0F0 0B0 0F1 0B1".split()],
            1: [Action.parse(x) for x in "1F1 1B1 1F0 1B0".split()],
        }
    )
    with pytest.raises(ScheduleError, match="deadlock"):
        add_communication(s)
    with pytest.raises(ScheduleError, match="deadlock"):
        s.lower()


def _gathered(program: list[Action | None]) -> tuple[list[set[int]], int]:
    """Per compute action, the stages gathered while it runs; and how many UNSHARDs the rank does.
    Fails on a stage freed and gathered again with no compute between (a wasted all-gather)."""
    unsharded: set[int] = set()
    freed: set[int] = set()  # since the last compute action
    during: list[set[int]] = []
    gathers = 0
    for a in program:
        if a is None:
            continue
        if a.kind is K.UNSHARD:
            assert a.stage not in unsharded
            assert a.stage not in freed, f"stage {a.stage} is freed and gathered again before any compute"
            unsharded.add(a.stage)
            gathers += 1
        elif a.kind is K.RESHARD:
            unsharded.remove(a.stage)
            freed.add(a.stage)
        elif a.kind.is_compute:
            during.append(set(unsharded))
            freed.clear()
    assert unsharded == set(), f"the rank ends with {unsharded} unsharded"
    return during, gathers


@pytest.mark.parametrize("prefetch", [0, 1, 2, 5])
@pytest.mark.parametrize(("label", "schedule"), CONFIGS, ids=IDS)
def test_fsdp_one_stage_at_a_time_holds_only_the_stage_computing(label: str, schedule: Schedule, prefetch: int) -> None:
    """max_unsharded=1 is a hard cap: at every compute action only its own stage is gathered (both
    of an OVERLAP_F_B's, which cannot run otherwise), whatever the prefetch."""
    out = add_fsdp(schedule, prefetch, max_unsharded=1)
    out.validate()
    for r in range(out.num_ranks):
        uses = [{p.stage for p in a.parts} for a in compute_only(out.actions[r])]
        during, _ = _gathered(out.actions[r])
        for k, held in enumerate(during):
            assert held == uses[k], (label, r, k)


@pytest.mark.parametrize("prefetch", [0, 1, 2])
@pytest.mark.parametrize(("label", "schedule"), CONFIGS, ids=IDS)
def test_fsdp_keeps_stages_gathered_within_the_limit(label: str, schedule: Schedule, prefetch: int) -> None:
    """Never more than max_unsharded stages at once (unless one OVERLAP_F_B uses more); the
    stages of the next prefetch+1 actions all gathered whenever they fit the limit; a rank with
    room for all its stages gathers each once per step; and more room never means more gathers."""
    counts: dict[int | None, list[int]] = {}
    for limit in (1, 2, 3, None):
        out = add_fsdp(schedule, prefetch, max_unsharded=limit)
        out.validate()
        counts[limit] = []
        for r in range(out.num_ranks):
            uses = [{p.stage for p in a.parts} for a in compute_only(out.actions[r])]
            during, gathers = _gathered(out.actions[r])
            counts[limit].append(gathers)
            for k, held in enumerate(during):
                window = set().union(*uses[k : k + prefetch + 1])
                assert uses[k] <= held, (label, limit, r, k)
                assert limit is None or len(held) <= max(limit, len(uses[k])), (label, limit, r, k, held)
                if limit is None or len(window) <= limit:
                    assert window <= held, (label, limit, r, k, held, window)
            if limit is None or limit >= len(schedule.stages_of(r)):
                assert gathers == len(schedule.stages_of(r)), (label, limit, r)
    for fewer, more in itertools.pairwise((1, 2, 3, None)):
        assert all(a >= b for a, b in zip(counts[fewer], counts[more], strict=True)), (label, fewer, more, counts)


_STEP = st.one_of(st.integers(0, 5), st.tuples(st.integers(0, 5), st.integers(0, 5)))


@settings(max_examples=400, deadline=None)
@given(steps=st.lists(_STEP, max_size=24), prefetch=st.integers(0, 4), limit=st.one_of(st.none(), st.integers(1, 6)))
def test_fsdp_cap_and_window_on_any_order(steps: list[int | tuple[int, int]], prefetch: int, limit: int | None) -> None:
    """Any order of stages on one rank (pairs are OVERLAP_F_B): the cap holds unless one action
    uses more stages; the next prefetch+1 actions' stages are gathered whenever they fit; no
    stage is freed and gathered again with no compute between; with room for all, one gather each."""
    program = [
        Action.overlap(Action(s[0], K.F, k), Action(s[1], K.B, k)) if isinstance(s, tuple) else Action(s, K.F, k)
        for k, s in enumerate(steps)
    ]
    stages = sorted({p.stage for a in program for p in a.parts})
    schedule = Schedule(
        {0: list(program)}, stage_to_rank=dict.fromkeys(range(6), 0), num_microbatches=max(1, len(steps))
    )
    out = add_fsdp(schedule, prefetch, max_unsharded=limit)
    uses = [{p.stage for p in a.parts} for a in program]
    during, gathers = _gathered(out.actions[0])
    cap = len(stages) if limit is None else limit
    for k, held in enumerate(during):
        assert uses[k] <= held and len(held) <= max(cap, len(uses[k])), (k, held)
        window = set().union(*uses[k : k + prefetch + 1])
        if len(window) <= cap:
            assert window <= held, (k, held, window)
    if len(stages) <= cap:
        assert gathers == len(stages)


def test_fsdp_prefetch_frees_a_stage_idle_over_the_window() -> None:
    """To gather 2 one action early at a limit of 2, the pass frees stage 0 (idle since before the
    window) rather than stage 1 (used in it), and never a stage the action itself uses."""
    s = Schedule({0: [Action.parse(x) for x in "0F0 1F0 0F1 1F1 2F0 2F1".split()]}, name="three stages")
    out = add_fsdp(s, prefetch=1, max_unsharded=2)
    out.validate()
    assert [str(a) for a in out.actions[0]] == (
        "0UNSHARD 1UNSHARD 0F0 1F0 0F1 0RESHARD 2UNSHARD 1F1 1RESHARD 2F0 2F1 2RESHARD"
    ).split()
    # At a limit of 1 nothing is gathered ahead across a change of stage.
    one = add_fsdp(s, prefetch=1, max_unsharded=1)
    assert [str(a) for a in one.actions[0]] == (
        "0UNSHARD 0F0 0RESHARD 1UNSHARD 1F0 1RESHARD 0UNSHARD 0F1 0RESHARD 1UNSHARD 1F1 1RESHARD "
        "2UNSHARD 2F0 2F1 2RESHARD"
    ).split()


def test_fsdp_frees_the_stage_used_furthest_ahead() -> None:
    """At the limit, the idle stage whose next use is furthest away makes room (Belady)."""
    s = Schedule({0: [Action.parse(x) for x in "0F0 1F0 0F1 2F0 1F1 0F2 2F1 1F2 2F2".split()]}, name="three stages")
    out = add_fsdp(s, prefetch=0, max_unsharded=2)
    out.validate()
    # At 2F0, stage 0 (next used at 0F2) makes room rather than stage 1 (next used at 1F1, sooner).
    assert [str(a) for a in out.actions[0]] == (
        "0UNSHARD 0F0 1UNSHARD 1F0 0F1 0RESHARD 2UNSHARD 2F0 1F1 1RESHARD 0UNSHARD 0F2 0RESHARD 2F1 "
        "1UNSHARD 1F2 1RESHARD 2F2 2RESHARD"
    ).split()


def test_fsdp_prefetch_must_be_non_negative() -> None:
    with pytest.raises(ScheduleError, match="prefetch"):
        add_fsdp(build_schedule("GPipe", 1, 1), -1)


@pytest.mark.parametrize("bad", [0, -2, True, 2.0])
def test_fsdp_max_unsharded_must_be_a_positive_integer(bad: object) -> None:
    with pytest.raises(ScheduleError, match=f"max_unsharded must be an integer >= 1 .* got {bad!r}"):
        build_schedule("Interleaved1F1B", 2, 4).lower(fsdp=True, max_unsharded=bad)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("label", "schedule"), [c for c in CONFIGS if has_backward(c[1])], ids=lambda x: x if isinstance(x, str) else ""
)
def test_grad_reduction_after_last_backward(label: str, schedule: Schedule) -> None:
    out = lower(schedule, grad_reduce=True, fsdp=True)
    out.validate()
    for r in range(out.num_ranks):
        program = out.actions[r]
        reduced = [a.stage for a in program if a is not None and a.kind is K.REDUCE_GRAD]
        assert sorted(reduced) == schedule.stages_of(r)
        for i, a in enumerate(program):
            if a is None or a.kind is not K.REDUCE_GRAD:
                continue
            j = i - 1
            while program[j] is not None and program[j].kind in (K.SEND_F, K.SEND_B, K.RECV_F, K.RECV_B, K.REDUCE_GRAD):  # type: ignore[union-attr]
                j -= 1
            last = program[j]
            assert last is not None and any(p.stage == a.stage and p.kind in (K.B, K.W) for p in last.parts)
            later = [b for b in program[i + 1 :] if b is not None and b.kind.is_compute]
            assert not any(p.stage == a.stage and p.kind in (K.B, K.W) for b in later for p in b.parts)


def test_grad_reduction_needs_a_backward() -> None:
    with pytest.raises(ScheduleError, match="forward-only"):
        build_schedule("ForwardOnly", 2, 2).lower(grad_reduce=True)


def test_merge_input_weight() -> None:
    s = Schedule({0: [None if x == "." else Action.parse(x) for x in "0F0 0F1 0I0 0W0 0I1 0F2 0W1 0I2 . 0W2".split()]})
    merged = merge_input_weight(s)
    assert [str(a) if a else "." for a in merged.actions[0]] == "0F0 0F1 0B0 0I1 0F2 0W1 0B2 .".split()
    merged.validate()
    low = s.lower(merge_iw=True, grad_reduce=True)
    low.validate()
    assert "0B0" in [str(a) for a in low.actions[0]]


@pytest.mark.parametrize(
    "name", [n for n in schedule_names() if n in ("ZBH1", "ZBH2", "InterleavedZeroBubble", "ZBVZeroBubble")]
)
def test_merge_input_weight_on_zero_bubble(name: str) -> None:
    s = build_schedule(name, 4, 8)
    merged = merge_input_weight(s)
    merged.validate()
    merged.lower().validate()
    for r in range(s.num_ranks):
        before = compute_only(s.actions[r])
        after = compute_only(merged.actions[r])
        merges = sum(1 for a in after if a.kind is K.B) - sum(1 for a in before if a.kind is K.B)
        assert len(before) - len(after) == merges


def random_schedule(rng: random.Random, num_ranks: int, num_stages: int, num_mb: int, mode: str) -> Schedule:
    """A random deadlock-free compute schedule: per-rank lists cut from a random topological order.

    ``mode``: "forward" (F only), "full" (F, B) or "split" (F, I, W), or "mixed" (B or I+W per pair).
    Stages are placed on random ranks (every rank gets at least one), so neighbours may share a rank.
    """
    placement = {s: s % num_ranks for s in range(num_stages)}
    free = list(range(num_ranks, num_stages))
    for s in free:
        placement[s] = rng.randrange(num_ranks)
    split = {
        (s, m): mode == "split" or (mode == "mixed" and rng.random() < 0.5)
        for s in range(num_stages)
        for m in range(num_mb)
    }
    done: set[tuple[str, int, int]] = set()
    todo: set[tuple[str, int, int]] = {("F", s, m) for s in range(num_stages) for m in range(num_mb)}
    if mode != "forward":
        for (s, m), is_split in split.items():
            todo |= {("I", s, m), ("W", s, m)} if is_split else {("B", s, m)}

    def ready(kind: str, s: int, m: int) -> bool:
        if kind == "F":
            return s == 0 or ("F", s - 1, m) in done
        if kind == "W":
            return ("I", s, m) in done
        up = s == num_stages - 1 or ("B", s + 1, m) in done or ("I", s + 1, m) in done
        return ("F", s, m) in done and up

    programs: dict[int, list[Action | None]] = {r: [] for r in range(num_ranks)}
    while todo:
        choice = rng.choice(sorted(a for a in todo if ready(*a)))
        todo.remove(choice)
        done.add(choice)
        kind, s, m = choice
        programs[placement[s]].append(Action(s, ActionKind(kind), m))
        if rng.random() < 0.1:
            programs[placement[s]].append(None)
    return Schedule(programs, num_stages=num_stages, num_microbatches=num_mb, stage_to_rank=placement)


@settings(max_examples=120, deadline=None)
@given(
    seed=st.integers(0, 2**32 - 1),
    num_ranks=st.integers(1, 5),
    extra_stages=st.integers(0, 6),
    num_mb=st.integers(1, 5),
    mode=st.sampled_from(["forward", "full", "split", "mixed"]),
)
def test_random_valid_schedules_lower_to_valid_schedules(
    seed: int, num_ranks: int, extra_stages: int, num_mb: int, mode: str
) -> None:
    """Any placement (neighbouring stages on one rank included), any valid order: lowering validates."""
    s = random_schedule(random.Random(seed), num_ranks, num_ranks + extra_stages, num_mb, mode)
    s.validate()
    low = s.lower(grad_reduce=mode != "forward", fsdp=True, prefetch=seed % 3, merge_iw=seed % 2 == 0)
    low.validate()
    plain = s.lower()
    plain.validate()
    for r in range(s.num_ranks):
        assert compute_only(plain.actions[r]) == compute_only(s.actions[r])


@pytest.mark.parametrize("name", schedule_names())
def test_one_sweep_lowering_equals_the_public_passes_in_a_row(name: str) -> None:
    """lower() fuses the passes into one sweep per rank; it must equal applying them one by one."""
    for p, m, v in [(1, 1, None), (2, 3, None), (3, 4, 2), (4, 8, None), (4, 17, 3)]:
        try:
            s = build_schedule(name, p, m, v)
        except ScheduleError:
            continue
        for prefetch, limit, grad, merge in itertools.product((0, 1, 2), (1, 2, None), (False, True), (False, True)):
            fused = _outcome(
                lower, s, fsdp=True, prefetch=prefetch, max_unsharded=limit, grad_reduce=grad, merge_iw=merge
            )
            chained = _outcome(_chain, s, prefetch, limit, grad, merge)
            assert fused == chained, (name, p, m, v, prefetch, limit, grad, merge)


def _chain(s: Schedule, prefetch: int, limit: int | None, grad: bool, merge: bool) -> Schedule:
    chained = merge_input_weight(s) if merge else s
    if grad:
        chained = add_grad_reduction(chained)
    return add_communication(add_fsdp(chained, prefetch, limit))


def _outcome(make: Callable[..., Schedule], *args: Any, **kwargs: Any) -> Schedule | str:
    """The schedule, or the error message, so that both ways must fail alike too."""
    try:
        return make(*args, **kwargs)
    except ScheduleError as err:
        return str(err)


@pytest.mark.parametrize("name", schedule_names())
def test_forwards_only_keeps_every_forward_and_runs(name: str) -> None:
    """eval runs any training schedule's forwards: complete, valid, and lowerable."""
    for p, m, v in [(1, 1, None), (2, 3, None), (4, 8, None), (3, 7, 3)]:
        try:
            s = build_schedule(name, p, m, v)
        except ScheduleError:
            continue
        fwd = forwards_only(s)
        fwd.validate()
        fwd.lower().validate()
        kinds = {a.kind for a in fwd.iter_actions() if a is not None}
        assert kinds == {ActionKind.F}
        assert len(fwd) == s.num_stages * m
        assert fwd.stage_to_rank == s.stage_to_rank


def _mutate(s: Schedule, rng: random.Random, how: str) -> Schedule:
    """``s`` with one random defect of kind ``how`` (the result may still be valid, e.g. a swap)."""
    programs = {r: list(s.actions[r]) for r in range(s.num_ranks)}
    r = rng.choice([r for r, p in programs.items() if any(a is not None for a in p)])
    program = programs[r]
    k = rng.choice([i for i, a in enumerate(program) if a is not None])
    a = program[k]
    assert a is not None
    part = a.parts[0]
    if how == "drop":
        del program[k]
    elif how == "duplicate":
        program.insert(rng.randrange(len(program) + 1), a)
    elif how == "swap":
        j = rng.randrange(len(program))
        program[k], program[j] = program[j], program[k]
    elif how == "kind":  # B <-> I, W -> B, F -> W ...
        kinds = [K.F, K.B, K.I, K.W]
        program[k] = Action(part.stage, rng.choice([x for x in kinds if x is not part.kind]), part.microbatch)
    elif how == "microbatch":
        program[k] = Action(part.stage, part.kind, rng.randrange(s.num_microbatches))
    out = Schedule(
        programs, num_stages=s.num_stages, num_microbatches=s.num_microbatches, stage_to_rank=s.stage_to_rank
    )
    if how == "stage":  # the constructor refuses a misplaced stage: put it there afterwards, as a user could
        out.actions[r][k] = Action(rng.randrange(s.num_stages), part.kind, part.microbatch)
    if how == "out of range":  # likewise a microbatch past the schedule's last
        out.actions[r][k] = Action(part.stage, part.kind, s.num_microbatches + rng.randrange(2))
    return out


@settings(max_examples=300, deadline=None)
@given(
    seed=st.integers(0, 2**32 - 1),
    name=st.sampled_from(schedule_names()),
    how=st.sampled_from(["drop", "duplicate", "swap", "kind", "stage", "microbatch", "out of range"]),
    fsdp=st.booleans(),
)
def test_lower_rejects_what_validate_rejects_with_its_message(seed: int, name: str, how: str, fsdp: bool) -> None:
    """lower() checks a compute schedule in its own unit-time run; on a defect it must raise
    exactly validate()'s error (rank, step, action, rule), and accept what validate() accepts."""
    rng = random.Random(seed)
    p, m = rng.randint(1, 4), rng.randint(1, 6)
    try:
        s = build_schedule(name, p, m)
    except ScheduleError:
        return
    broken = _mutate(s, rng, how)
    try:
        broken.validate()
    except ScheduleError as err:
        event("defect found")
        with pytest.raises(ScheduleError) as got:
            broken.lower(fsdp=fsdp, grad_reduce=False)
        assert str(got.value) == str(err)
        return
    broken.lower(fsdp=fsdp).validate()


def test_lower_posts_early_receives_as_an_option() -> None:
    """recv_ahead is a lowering option: the moved receives are in the schedule itself, and the
    same multiset of actions runs, with every RECV_B ahead of or at its old place."""
    from pipetrain.plan import build_schedule, simulate
    from pipetrain.plan.passes.early_recv import post_receives_early

    s = build_schedule("1F1B", 4, 8)
    plain = s.lower()
    early = s.lower(recv_ahead=2)
    assert early.actions == post_receives_early(plain, 2).actions
    assert early.actions != plain.actions
    for r in range(4):
        assert sorted(map(str, filter(None, early.actions[r]))) == sorted(map(str, filter(None, plain.actions[r])))
    assert simulate(early).makespan <= simulate(plain).makespan + 1e-9
    with pytest.raises(ScheduleError, match="recv_ahead moves receives: it needs comms=True"):
        s.lower(comms=False, recv_ahead=1)
