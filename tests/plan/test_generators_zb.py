"""ZB-H1, ZB-H2 and InterleavedZeroBubble: structure, memory, and the Zero Bubble paper's numbers.

The dependency check below is written from docs/semantics.md ("Dependencies (compute)") and runs
the rank programs abstractly (no timing), so it does not lean on the simulator under test.
"""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pipetrain.plan import Action, ActionKind, Schedule, ScheduleError, build_schedule
from pipetrain.plan.costs import Costs
from pipetrain.plan.generators._common import microbatch_groups
from pipetrain.plan.generators.interleaved_zb import memory_cap
from pipetrain.plan.simulate import simulate

ZB_NAMES = ("ZBH1", "ZBH2", "InterleavedZeroBubble")
PROPERTY_SETTINGS = settings(max_examples=40, deadline=None)

ranks = st.integers(1, 16)
microbatches = st.integers(1, 64)
stages_per_rank = st.integers(1, 4)


# ------------------------------------------------------------------ helpers
def programs_as_text(schedule: Schedule) -> dict[int, list[str]]:
    return {r: [str(a) for a in acts if a is not None] for r, acts in schedule.actions.items()}


def assert_complete(schedule: Schedule) -> None:
    """Every (stage, microbatch) has exactly one F, one I and one W, and nothing else."""
    seen: dict[tuple[int, ActionKind, int], int] = {}
    for action in schedule.iter_actions():
        assert action is not None, "generators emit no idle steps"
        assert action.kind in (ActionKind.F, ActionKind.I, ActionKind.W), f"unexpected {action}"
        assert action.microbatch is not None
        key = (action.stage, action.kind, action.microbatch)
        seen[key] = seen.get(key, 0) + 1
    expected = {
        (s, kind, mb): 1
        for s in range(schedule.num_stages)
        for kind in (ActionKind.F, ActionKind.I, ActionKind.W)
        for mb in range(schedule.num_microbatches)
    }
    assert seen == expected


def assert_placement(schedule: Schedule, expected: dict[int, int]) -> None:
    assert schedule.stage_to_rank == expected
    for rank, acts in schedule.actions.items():
        for action in acts:
            assert action is not None and expected[action.stage] == rank, f"{action} on rank {rank}"


def _needs(action: Action, last_stage: int) -> list[tuple[int, tuple[ActionKind, ...], int]]:
    """What ``action`` waits for, per docs/semantics.md."""
    s, mb = action.stage, action.microbatch
    assert mb is not None
    if action.kind is ActionKind.F:
        return [(s - 1, (ActionKind.F,), mb)] if s > 0 else []
    if action.kind in (ActionKind.I, ActionKind.B):
        needs = [(s, (ActionKind.F,), mb)]
        if s < last_stage:
            needs.append((s + 1, (ActionKind.I, ActionKind.B), mb))
        return needs
    assert action.kind is ActionKind.W
    return [(s, (ActionKind.I,), mb)]


def assert_dependencies_met(schedule: Schedule) -> None:
    """Run every rank's list in order; an action runs once all it needs has run. All must run."""
    last = schedule.num_stages - 1
    done: set[tuple[int, ActionKind, int]] = set()
    pos = {r: 0 for r in schedule.actions}
    progress = True
    while progress:
        progress = False
        for rank, acts in schedule.actions.items():
            while pos[rank] < len(acts):
                action = acts[pos[rank]]
                assert action is not None and action.microbatch is not None
                if not all(any((s, k, mb) in done for k in kinds) for s, kinds, mb in _needs(action, last)):
                    break
                done.add((action.stage, action.kind, action.microbatch))
                pos[rank] += 1
                progress = True
    stuck = {r: str(acts[pos[r]]) for r, acts in schedule.actions.items() if pos[r] < len(acts)}
    assert not stuck, f"dependencies can never be met: ranks wait at {stuck}"


def peak_held(schedule: Schedule) -> dict[int, int]:
    """Activations held per rank (F start .. W end); a rank runs its list one action at a time."""
    peaks = {}
    for rank, acts in schedule.actions.items():
        held = peak = 0
        for action in acts:
            assert action is not None
            if action.kind is ActionKind.F:
                held += 1
                peak = max(peak, held)
            elif action.kind is ActionKind.W:
                held -= 1
        assert held == 0
        peaks[rank] = peak
    return peaks


def check_structure(schedule: Schedule, placement: dict[int, int]) -> None:
    assert_complete(schedule)
    assert_placement(schedule, placement)
    assert_dependencies_met(schedule)


# ------------------------------------------------------------------ registry and errors
def test_names_are_registered_and_split_the_backward() -> None:
    from pipetrain.plan import schedule_names
    from pipetrain.plan.generators import family

    for name in ZB_NAMES:
        assert name in schedule_names()
        assert family(name.lower()).split_backward
        assert family(name).placement == "loop"


@pytest.mark.parametrize("name", ["ZBH1", "ZBH2"])
@pytest.mark.parametrize("spr", [2, 3])
def test_zbh_needs_one_stage_per_rank(name: str, spr: int) -> None:
    with pytest.raises(ScheduleError, match=rf"{name}: one stage per rank \(got stages_per_rank={spr}\)"):
        build_schedule(name, num_ranks=4, num_microbatches=8, stages_per_rank=spr)


@pytest.mark.parametrize("name", ZB_NAMES)
@pytest.mark.parametrize(("p", "m", "spr"), [(0, 4, None), (4, 0, None), (4, 4, 0), (-1, 4, None)])
def test_sizes_must_be_positive(name: str, p: int, m: int, spr: int | None) -> None:
    with pytest.raises(ScheduleError, match=name):
        build_schedule(name, num_ranks=p, num_microbatches=m, stages_per_rank=spr)


# ------------------------------------------------------------------ known answer
def test_zbh1_matches_the_papers_figure() -> None:
    """ZB-H1 at p=4, m=8 (paper, Figure 3 top): rank r warms up with p-r forwards, then
    I / due W / F; each W trails its I by r microbatches, and the deferred W fill the tail."""
    expected = {
        0: "0F0 0F1 0F2 0F3 0I0 0W0 0F4 0I1 0W1 0F5 0I2 0W2 0F6 0I3 0W3 0F7 0I4 0W4 0I5 0W5 0I6 0W6 0I7 0W7",
        1: "1F0 1F1 1F2 1I0 1F3 1I1 1W0 1F4 1I2 1W1 1F5 1I3 1W2 1F6 1I4 1W3 1F7 1I5 1W4 1I6 1W5 1I7 1W6 1W7",
        2: "2F0 2F1 2I0 2F2 2I1 2F3 2I2 2W0 2F4 2I3 2W1 2F5 2I4 2W2 2F6 2I5 2W3 2F7 2I6 2W4 2I7 2W5 2W6 2W7",
        3: "3F0 3I0 3F1 3I1 3F2 3I2 3F3 3I3 3W0 3F4 3I4 3W1 3F5 3I5 3W2 3F6 3I6 3W3 3F7 3I7 3W4 3W5 3W6 3W7",
    }
    schedule = build_schedule("ZBH1", num_ranks=4, num_microbatches=8)
    assert {r: " ".join(a) for r, a in programs_as_text(schedule).items()} == expected
    # The figure's timing: rank 0 idles 3 units after its warm-up (the whole bubble, a third of
    # 1F1B's 9), and all ranks finish together at 3m + p - 1 = 27.
    result = simulate(schedule, Costs(f=1, i=1, w=1, comm=0))
    assert result.makespan == 27
    starts = [e.start for e in result.timeline.events_of(0)]
    assert starts[:6] == [0, 1, 2, 3, 7, 8]
    assert all(result.timeline.events_of(r)[-1].end == 27 for r in range(4))


def test_zbh2_small_case_is_a_parallelogram() -> None:
    """ZB-H2 at p=3, m=6: rank r warms up with 2(p-r)-1 forwards; nobody waits once started."""
    expected = {
        0: "0F0 0F1 0F2 0F3 0F4 0I0 0W0 0F5 0I1 0W1 0I2 0W2 0I3 0W3 0I4 0W4 0I5 0W5",
        1: "1F0 1F1 1F2 1I0 1F3 1I1 1F4 1I2 1W0 1F5 1I3 1W1 1I4 1W2 1I5 1W3 1W4 1W5",
        2: "2F0 2I0 2F1 2I1 2F2 2I2 2F3 2I3 2F4 2I4 2W0 2F5 2I5 2W1 2W2 2W3 2W4 2W5",
    }
    schedule = build_schedule("ZBH2", num_ranks=3, num_microbatches=6)
    assert {r: " ".join(a) for r, a in programs_as_text(schedule).items()} == expected
    result = simulate(schedule, Costs(f=1, i=1, w=1, comm=0))
    for r in range(3):
        events = result.timeline.events_of(r)
        assert (events[0].start, events[-1].end) == (r, r + 18)


# ------------------------------------------------------------------ properties over the grid
@PROPERTY_SETTINGS
@given(p=ranks, m=microbatches)
def test_zbh1_structure_and_memory(p: int, m: int) -> None:
    schedule = build_schedule("ZBH1", num_ranks=p, num_microbatches=m)
    check_structure(schedule, {r: r for r in range(p)})
    # 1F1B's peak (p, on its rank 0) on every rank: the deferred W hold activations longer.
    assert all(peak <= min(p, m) for peak in peak_held(schedule).values())
    assert max(peak_held(schedule).values()) == min(p, m)


@PROPERTY_SETTINGS
@given(p=ranks, m=microbatches)
def test_zbh2_structure_and_memory(p: int, m: int) -> None:
    schedule = build_schedule("ZBH2", num_ranks=p, num_microbatches=m)
    check_structure(schedule, {r: r for r in range(p)})
    peaks = peak_held(schedule)
    assert all(peak <= min(2 * p - 1, m) for peak in peaks.values())
    assert peaks[0] == min(2 * p - 1, m)


@PROPERTY_SETTINGS
@given(p=ranks, m=microbatches, v=stages_per_rank)
def test_interleaved_zb_structure_and_memory(p: int, m: int, v: int) -> None:
    schedule = build_schedule("InterleavedZeroBubble", num_ranks=p, num_microbatches=m, stages_per_rank=v)
    assert schedule.num_stages == p * v
    check_structure(schedule, {s: s % p for s in range(p * v)})
    cap = memory_cap(p, m, v)
    assert all(peak <= cap for peak in peak_held(schedule).values())


@settings(max_examples=25, deadline=None)
@given(name=st.sampled_from(ZB_NAMES), p=ranks, m=microbatches, v=stages_per_rank)
def test_validate_accepts_compute_only_and_lowered_forms(name: str, p: int, m: int, v: int) -> None:
    spr = v if name == "InterleavedZeroBubble" else None
    schedule = build_schedule(name, num_ranks=p, num_microbatches=m, stages_per_rank=spr)
    schedule.validate()
    lowered = schedule.lower()
    lowered.validate()
    assert lowered.is_lowered or p == 1
    schedule.lower(grad_reduce=True, fsdp=True).validate()


@pytest.mark.parametrize(("p", "m"), [(1, 3), (4, 8), (5, 3), (6, 17)])
def test_interleaved_zb_with_one_stage_per_rank_is_zbh1(p: int, m: int) -> None:
    one = build_schedule("InterleavedZeroBubble", num_ranks=p, num_microbatches=m, stages_per_rank=1)
    assert one.actions == build_schedule("ZBH1", num_ranks=p, num_microbatches=m).actions


def test_interleaved_zb_defaults_to_two_stages_per_rank() -> None:
    schedule = build_schedule("InterleavedZeroBubble", num_ranks=3, num_microbatches=5)
    assert schedule.num_stages == 6
    assert schedule.stages_of(1) == [1, 4]


@given(p=ranks, m=microbatches)
@PROPERTY_SETTINGS
def test_rounds_cover_microbatches_evenly(p: int, m: int) -> None:
    blocks = microbatch_groups(p, m)
    assert [mb for block in blocks for mb in block] == list(range(m))
    assert len(blocks) == max(1, m // p)
    assert max(map(len, blocks)) - min(map(len, blocks)) <= 1


@pytest.mark.parametrize("name", ZB_NAMES)
def test_simulator_agrees_on_peak_memory(name: str) -> None:
    schedule = build_schedule(name, num_ranks=5, num_microbatches=13)
    assert simulate(schedule, Costs(f=1, i=1, w=1, comm=0.5)).peak_memory == peak_held(schedule)


# ------------------------------------------------------------------ the paper's bubbles
# (F, I, W) with T_W <= T_F and T_W <= T_I, the paper's regime (its B is our I).
PAPER_COSTS = [(1.0, 1.0, 1.0), (1.0, 1.5, 0.5), (1.0, 2.0, 1.0), (2.0, 1.0, 1.0), (1.0, 1.25, 0.75)]
SIZES = [(1, 1), (1, 5), (2, 2), (2, 7), (3, 9), (4, 8), (4, 13), (6, 20), (8, 24), (16, 48)]


@pytest.mark.parametrize(("f", "i", "w"), PAPER_COSTS)
@pytest.mark.parametrize(("p", "m"), SIZES)
def test_zbh1_bubble_is_the_papers(f: float, i: float, w: float, p: int, m: int) -> None:
    """ZB-H1: makespan m(F+I+W) + (p-1)(F+I-W), against 1F1B's (p-1)(F+I+W)."""
    result = simulate(build_schedule("ZBH1", num_ranks=p, num_microbatches=m), Costs(f=f, i=i, w=w, comm=0))
    assert result.makespan == pytest.approx(m * (f + i + w) + (p - 1) * (f + i - w))


@pytest.mark.parametrize(("f", "i", "w"), PAPER_COSTS)
@pytest.mark.parametrize(("p", "m"), [(p, m) for p, m in SIZES if m >= 2 * p - 1])
def test_zbh2_bubble_is_the_papers(f: float, i: float, w: float, p: int, m: int) -> None:
    """ZB-H2: rank r idles (p-1-r)(F+I-2W) inside its own span, so rank 0's is the paper's
    (p-1)(F+I-2W) and at T_F = T_I = T_W no rank ever waits once it has started."""
    result = simulate(build_schedule("ZBH2", num_ranks=p, num_microbatches=m), Costs(f=f, i=i, w=w, comm=0))
    work = m * (f + i + w)
    for r in range(p):
        events = result.timeline.events_of(r)
        assert events[-1].end - events[0].start - work == pytest.approx((p - 1 - r) * (f + i - 2 * w))
    assert result.makespan == pytest.approx(work + (p - 1) * max(f, f + i - 2 * w))


@pytest.mark.parametrize(("p", "m"), [(2, 2), (4, 4), (4, 9), (8, 8), (8, 19), (16, 16), (3, 64)])
@pytest.mark.parametrize("v", [1, 2, 3, 4])
def test_interleaved_zb_reaches_the_lower_bound(p: int, m: int, v: int) -> None:
    """At F = I = W = 1 and free communication, rank p-1 cannot start before p-1 and has 3vm of
    work: the schedule ends exactly then, for every m >= p (divisible by p or not)."""
    schedule = build_schedule("InterleavedZeroBubble", num_ranks=p, num_microbatches=m, stages_per_rank=v)
    result = simulate(schedule, Costs(f=1, i=1, w=1, comm=0))
    assert result.makespan == 3 * v * m + p - 1


@pytest.mark.parametrize("p", [2, 4, 8])
def test_zbh1_with_few_microbatches_is_optimal(p: int) -> None:
    """m < p at F = I = W = 1: the last rank starts at p-1 and must run m F and m I; the last
    gradient then crosses p-1 ranks and rank 0 runs one W. ZB-H1 ends exactly then."""
    for m in range(1, p):
        result = simulate(build_schedule("ZBH1", num_ranks=p, num_microbatches=m), Costs(f=1, i=1, w=1))
        assert result.makespan == (p - 1) + 2 * m + (p - 1) + 1


@pytest.mark.parametrize(("f", "i", "w"), PAPER_COSTS)
@pytest.mark.parametrize("p", [2, 3, 5, 8])
def test_zbh2_is_never_slower_than_zbh1(f: float, i: float, w: float, p: int) -> None:
    """Including m < 2p-1, where ZB-H2 cannot fill its warm-up and shortens its W deferral."""
    costs = Costs(f=f, i=i, w=w, comm=0)
    for m in range(1, 2 * p + 2):
        h1 = simulate(build_schedule("ZBH1", num_ranks=p, num_microbatches=m), costs).makespan
        h2 = simulate(build_schedule("ZBH2", num_ranks=p, num_microbatches=m), costs).makespan
        assert h2 <= h1 + 1e-9, f"p={p} m={m}: ZBH2 {h2} > ZBH1 {h1}"


# ------------------------------------------------------------------ against torch 2.13
def torch_interleaved_zb(p: int, m: int, v: int) -> Schedule:
    """torch's InterleavedZeroBubble order (compute-only), from benchmarks/_torch_reference.py."""
    import _torch_reference

    theirs = _torch_reference.torch_schedule_object("InterleavedZeroBubble", p, m, v)
    assert theirs is not None, f"torch rejects InterleavedZeroBubble with p={p} m={m} v={v}"
    schedule: Schedule = _torch_reference.to_pipetrain(theirs)
    assert schedule.num_microbatches == m
    return schedule


@pytest.mark.parametrize(("p", "m", "v"), [(2, 4, 2), (4, 2, 2), (4, 8, 2), (4, 10, 3), (4, 12, 4), (8, 16, 2)])
@pytest.mark.parametrize("comm", [0.0, 0.5])
def test_interleaved_zb_no_worse_than_torch(p: int, m: int, v: int, comm: float) -> None:
    costs = Costs(f=1, b=2, i=1, w=1, comm=comm)
    ours = simulate(build_schedule("InterleavedZeroBubble", num_ranks=p, num_microbatches=m, stages_per_rank=v), costs)
    theirs = simulate(torch_interleaved_zb(p, m, v), costs)
    assert ours.makespan <= theirs.makespan + 1e-9
    assert all(ours.peak_memory[r] <= theirs.peak_memory[r] for r in range(p))
