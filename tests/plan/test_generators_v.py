"""ZBVZeroBubble and DualPipeV: V placement, completeness, dependencies, memory and the papers' numbers.

The dependency check runs the rank programs abstractly (no timing) by the rules of
docs/semantics.md, counting an OVERLAP_F_B's parts in order, so it does not lean on the
validator or the simulator. Memory is counted from the order alone: a rank runs one action at a
time, so its activations after each action follow from the F, B and W it has run.
"""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pipetrain.plan import Action, ActionKind, Schedule, ScheduleError, build_schedule
from pipetrain.plan.costs import Costs
from pipetrain.plan.simulate import simulate

V_NAMES = ("ZBVZeroBubble", "DualPipeV")
PROPERTY_SETTINGS = settings(max_examples=40, deadline=None)

ranks = st.integers(1, 16)
microbatches = st.integers(1, 64)
EDGE_SIZES = [(1, 1), (1, 5), (2, 1), (2, 3), (4, 1), (4, 7), (4, 8), (5, 64), (16, 1), (16, 31), (16, 64)]


# ------------------------------------------------------------------ helpers
def parts_by_rank(schedule: Schedule) -> dict[int, list[Action]]:
    """Each rank's compute parts in program order (OVERLAP_F_B unfolded)."""
    out: dict[int, list[Action]] = {}
    for rank, acts in schedule.actions.items():
        out[rank] = []
        for action in acts:
            assert action is not None, "generators emit no idle steps"
            out[rank].extend(action.parts)
    return out


def v_layout(p: int) -> dict[int, int]:
    return {s: (s if s < p else 2 * p - 1 - s) for s in range(2 * p)}


def assert_complete(schedule: Schedule) -> None:
    """Every (stage, mb): one F, and one B or one I and one W (never B with I or W)."""
    counts: dict[tuple[int, int], dict[ActionKind, int]] = {}
    for parts in parts_by_rank(schedule).values():
        for part in parts:
            assert part.kind in (ActionKind.F, ActionKind.B, ActionKind.I, ActionKind.W), f"unexpected {part}"
            assert part.microbatch is not None
            cell = counts.setdefault((part.stage, part.microbatch), {})
            cell[part.kind] = cell.get(part.kind, 0) + 1
    cells = {(s, mb) for s in range(schedule.num_stages) for mb in range(schedule.num_microbatches)}
    assert set(counts) == cells
    for cell, kinds in counts.items():
        full = {ActionKind.F: 1, ActionKind.B: 1}
        split = {ActionKind.F: 1, ActionKind.I: 1, ActionKind.W: 1}
        assert kinds in (full, split), f"{cell}: {kinds}"


def assert_v_placement(schedule: Schedule, p: int) -> None:
    layout = v_layout(p)
    assert schedule.num_ranks == p and schedule.num_stages == 2 * p
    assert schedule.stage_to_rank == layout
    for rank, parts in parts_by_rank(schedule).items():
        for part in parts:
            assert layout[part.stage] == rank, f"{part} on rank {rank}"


def _needs(part: Action, last_stage: int) -> list[tuple[int, tuple[ActionKind, ...], int]]:
    """What ``part`` waits for (docs/semantics.md, "Dependencies (compute)")."""
    s, mb = part.stage, part.microbatch
    assert mb is not None
    if part.kind is ActionKind.F:
        return [(s - 1, (ActionKind.F,), mb)] if s > 0 else []
    if part.kind in (ActionKind.B, ActionKind.I):
        needs = [(s, (ActionKind.F,), mb)]
        if s < last_stage:
            needs.append((s + 1, (ActionKind.B, ActionKind.I), mb))
        return needs
    return [(s, (ActionKind.I,), mb)]  # W


def assert_runs_in_dependency_order(schedule: Schedule) -> None:
    """Abstract execution: a rank runs its next action once every part's inputs exist.

    Parts of an OVERLAP_F_B count in order (the B may use the F's output). Fails if any rank
    is left with actions that can never run.
    """
    last = schedule.num_stages - 1
    done: set[tuple[int, ActionKind, int]] = set()
    programs = {r: [a for a in acts if a is not None] for r, acts in schedule.actions.items()}
    pos = dict.fromkeys(programs, 0)
    progress = True
    while progress:
        progress = False
        for rank, program in programs.items():
            while pos[rank] < len(program):
                action = program[pos[rank]]
                made: set[tuple[int, ActionKind, int]] = set()
                ready = True
                for part in action.parts:
                    for stage, kinds, mb in _needs(part, last):
                        if not any((stage, k, mb) in done or (stage, k, mb) in made for k in kinds):
                            ready = False
                    assert part.microbatch is not None
                    made.add((part.stage, part.kind, part.microbatch))
                if not ready:
                    break
                done |= made
                pos[rank] += 1
                progress = True
    stuck = {r: str(programs[r][pos[r]]) for r in programs if pos[r] < len(programs[r])}
    assert not stuck, f"cannot run: {stuck}"


def peak_activations(schedule: Schedule) -> dict[int, int]:
    """Per rank, the most (stage, mb) activations held at once, from the order alone.

    An activation lives from its F's start to the end of its B (or W when split); the parts of
    an OVERLAP_F_B run together, so its F allocates before its B frees.
    """
    peaks: dict[int, int] = {}
    for rank, acts in schedule.actions.items():
        held = peak = 0
        for action in acts:
            assert action is not None
            held += sum(part.kind is ActionKind.F for part in action.parts)
            peak = max(peak, held)
            held -= sum(part.kind in (ActionKind.B, ActionKind.W) for part in action.parts)
        assert held == 0, f"rank {rank} ends holding {held} activations"
        peaks[rank] = peak
    return peaks


def memory_bound(name: str, p: int, m: int) -> int:
    """ZB-V: 1F1B's memory, p stage activations = 2p chunk activations; DualPipe-V: PP+1 = 2p+1."""
    cap = 2 * p if name == "ZBVZeroBubble" else 2 * p + 1
    return min(cap, 2 * m)


def check_all(name: str, p: int, m: int) -> Schedule:
    schedule = build_schedule(name, p, m)
    assert_complete(schedule)
    assert_v_placement(schedule, p)
    assert_runs_in_dependency_order(schedule)
    bound = memory_bound(name, p, m)
    assert all(v <= bound for v in peak_activations(schedule).values()), (peak_activations(schedule), bound)
    return schedule


# ------------------------------------------------------------------ properties over the grid
@pytest.mark.parametrize("name", V_NAMES)
@given(p=ranks, m=microbatches)
@PROPERTY_SETTINGS
def test_properties_on_grid(name: str, p: int, m: int) -> None:
    check_all(name, p, m)


@pytest.mark.parametrize("name", V_NAMES)
@pytest.mark.parametrize(("p", "m"), EDGE_SIZES)
def test_properties_at_edges(name: str, p: int, m: int) -> None:
    check_all(name, p, m)


@pytest.mark.parametrize("name", V_NAMES)
@pytest.mark.parametrize(("p", "m"), [(1, 1), (2, 3), (3, 6), (4, 8), (5, 2), (6, 17)])
def test_validates_compute_only_and_lowered(name: str, p: int, m: int) -> None:
    schedule = build_schedule(name, p, m)
    schedule.validate()
    lowered = schedule.lower()
    lowered.validate()
    assert lowered.is_lowered == (p > 1)


@pytest.mark.parametrize("name", V_NAMES)
def test_names_and_default_stages_per_rank(name: str) -> None:
    assert build_schedule(name.lower(), 3, 6) == build_schedule(name, 3, 6, stages_per_rank=2)
    assert build_schedule(name, 3, 6).name == name


@pytest.mark.parametrize("name", V_NAMES)
@pytest.mark.parametrize("v", [1, 3, 4])
def test_needs_exactly_two_stages_per_rank(name: str, v: int) -> None:
    with pytest.raises(ScheduleError, match=rf"{name}: exactly 2 stages per rank.*stages_per_rank={v}"):
        build_schedule(name, 4, 8, stages_per_rank=v)


# ------------------------------------------------------------------ ZB-V: the paper
# Zero Bubble (arXiv 2401.10241) section 6, its ZB-V figure: p=4, m=8. Rank r holds chunk 0 =
# stage r and chunk 1 = stage 7-r. Written out by hand from the figure's pattern.
ZBV_P4_M8 = {
    0: "0F0 0F1 0F2 0F3 0F4 0F5 0F6"
    " 7F0 7I0 7W0 7F1 7I1 7W1 7F2 7I2 7W2 7F3 7I3 7W3"
    " 0F7 0I0 0W0 7F4 7I4 7W4 0I1 0W1 7F5 7I5 7W5 0I2 0W2 7F6 7I6 7W6 0I3 0W3 7F7 7I7 7W7"
    " 0I4 0W4 0I5 0W5 0I6 0W6 0I7 0W7",
    1: "1F0 1F1 1F2 1F3 1F4 6F0 1F5"
    " 6F1 6I0 6W0 6F2 6I1 6W1 6F3 6I2 6W2"
    " 1F6 1I0 1W0 6F4 6I3 6W3 1F7 1I1 1W1 6F5 6I4 6W4 1I2 1W2 6F6 6I5 6W5 1I3 1W3 6F7 6I6 6W6"
    " 1I4 6I7 1I5 1W4 1I6 1W5 1I7 1W6 6W7 1W7",
    2: "2F0 2F1 2F2 5F0 2F3 5F1 2F4"
    " 5F2 5I0 5W0 5F3 5I1 5W1"
    " 2F5 2I0 2W0 5F4 5I2 5W2 2F6 2I1 2W1 5F5 5I3 5W3 2F7 2I2 2W2 5F6 5I4 5W4 2I3 2W3 5F7 5I5 5W5"
    " 2I4 5I6 2I5 5I7 2I6 2W4 2I7 2W5 5W6 5W7 2W6 2W7",
    3: "3F0 4F0 3F1 4F1 3F2 4F2 3F3"
    " 4F3 4I0 4W0"
    " 3F4 3I0 3W0 4F4 4I1 4W1 3F5 3I1 3W1 4F5 4I2 4W2 3F6 3I2 3W2 4F6 4I3 4W3 3F7 3I3 3W3 4F7 4I4 4W4"
    " 3I4 4I5 3I5 4I6 3I6 4I7 3I7 3W4 4W5 4W6 4W7 3W5 3W6 3W7",
}


def test_zbv_matches_the_paper_figure() -> None:
    schedule = build_schedule("ZBVZeroBubble", 4, 8)
    got = {r: " ".join(str(a) for a in acts) for r, acts in schedule.actions.items()}
    assert got == ZBV_P4_M8


@given(p=st.integers(1, 12), extra=st.integers(0, 24))
@PROPERTY_SETTINGS
def test_zbv_zero_bubble_when_f_i_w_equal(p: int, extra: int) -> None:
    """F = I = W, no communication cost, m >= 2p-1: no rank idles between its first and last
    action and the pipeline ends at the lower bound (the last rank's late start + its 6m work)."""
    m = 2 * p - 1 + extra
    result = simulate(build_schedule("ZBVZeroBubble", p, m), Costs(f=1, b=2, i=1, w=1, comm=0))
    assert all(v == 0 for v in result.span_idle.values()), result.span_idle
    assert result.makespan == 6 * m + p - 1 == result.lower_bound


@given(p=st.integers(1, 16), data=st.data())
@PROPERTY_SETTINGS
def test_zbv_few_microbatches(p: int, data: st.DataObject) -> None:
    """m <= p: the V cannot fill. The first microbatch's chain takes 4p+1 (2p F, 2p I, one W);
    each further one adds its F, I and W on the busiest rank, 3 units, and no rank can do its 6m
    units of work before its first input arrives (6m + p - 1). The paper's pattern, trimmed to
    m microbatches, takes 4p + 4m - 2 here; the list schedule keeps its per-rank memory."""
    m = data.draw(st.integers(1, p))
    result = simulate(build_schedule("ZBVZeroBubble", p, m), Costs(f=1, b=2, i=1, w=1, comm=0))
    assert result.makespan <= max(4 * p + 3 * m - 2, 6 * m + p - 1)
    if m in (1, p):
        assert result.makespan == result.lower_bound
    assert all(result.peak_memory[r] <= min(2 * m, m + 1 + r) for r in range(p)), result.peak_memory


@pytest.mark.parametrize(("p", "m"), [(2, 4), (4, 8), (8, 16)])
def test_zbv_memory_equals_1f1b(p: int, m: int) -> None:
    """The paper's promise: 1F1B's memory (p stage activations = 2p chunk activations), reached."""
    result = simulate(build_schedule("ZBVZeroBubble", p, m), Costs(f=1, b=2, i=1, w=1, comm=0.5))
    assert result.peak_memory == dict.fromkeys(range(p), 2 * p)


# ------------------------------------------------------------------ DualPipe-V: DeepSeek's table
def test_dualpipev_pairs_forward_of_one_chunk_with_backward_of_the_other() -> None:
    p, m = 4, 12
    schedule = build_schedule("DualPipeV", p, m)
    for rank, acts in schedule.actions.items():
        pairs = [a for a in acts if a is not None and a.kind is ActionKind.OVERLAP_F_B]
        for pair in pairs:
            f, b = pair.parts
            assert f.kind is ActionKind.F and b.kind is ActionKind.B, pair
            assert {f.stage, b.stage} == {rank, 2 * p - 1 - rank}, pair
        # Main phase: 2(m - 2p + r + 1) pairs (the last rank issues its first pair apart),
        # then p-r-1 more while chunk 1's backwards drain.
        expected = 2 * (m - 2 * p + rank + 1) + (p - rank - 1) - (rank == p - 1)
        assert len(pairs) == expected, (rank, len(pairs))


@pytest.mark.parametrize(("f", "i", "w"), [(1, 1, 1), (1, 2, 1), (2, 2, 1), (1, 1, 0.5)])
@pytest.mark.parametrize(("p", "m"), [(1, 3), (2, 4), (3, 5), (4, 8), (4, 20), (8, 16)])
def test_dualpipev_bubble_within_deepseek_table(f: float, i: float, w: float, p: int, m: int) -> None:
    """README: bubble (PP/2 - 1)(F&B + B - 3W) with PP = 2p stages, here F&B = F + B (no overlap)."""
    result = simulate(build_schedule("DualPipeV", p, m), Costs(f=f, b=i + w, i=i, w=w, comm=0))
    b = i + w
    work = 2 * m * (f + b)
    bound = work + (p - 1) * ((f + b) + b - 3 * w)
    assert result.makespan <= bound
    if i == w:
        assert result.makespan == bound
    assert result.max_peak_memory <= 2 * p + 1


def test_dualpipev_accepts_fewer_microbatches_than_stages() -> None:
    """torch and DeepSeek need m >= 2p; here the pattern is trimmed and stays correct."""
    for p, m in [(4, 1), (4, 3), (4, 6), (8, 5)]:
        schedule = check_all("DualPipeV", p, m)
        schedule.validate()
        costs = Costs(f=1, b=2, i=1, w=1, comm=0)
        full = simulate(build_schedule("DualPipeV", p, 2 * p), costs)
        assert simulate(schedule, costs).makespan < full.makespan
