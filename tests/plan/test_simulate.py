"""The simulator against hand-computed answers, the papers' formulas and its own invariants."""

from __future__ import annotations

import itertools
import math
from pathlib import Path

import pytest
from hypothesis import assume, given, settings
from hypothesis import strategies as st

from pipetrain.plan.actions import Action
from pipetrain.plan.costs import Costs
from pipetrain.plan.errors import ScheduleError
from pipetrain.plan.generators import build_schedule, schedule_names
from pipetrain.plan.schedule import Schedule
from pipetrain.plan.simulate import simulate
from pipetrain.plan.timeline import Timeline
from pipetrain.plan.validate import validate


def sched(rows: dict[int, list[str]], **kw: object) -> Schedule:
    """A schedule from action strings; "" is an idle step."""
    return Schedule({r: [Action.parse(c) for c in row] for r, row in rows.items()}, **kw)  # type: ignore[arg-type]


def build_or_none(name: str, p: int, m: int, v: int | None = None) -> Schedule | None:
    try:
        return build_schedule(name, p, m, v)
    except ScheduleError:
        return None


# ---------------------------------------------------------------- hand-computed answers
def test_two_stages_one_microbatch_with_latency_and_per_stage_costs() -> None:
    s = sched({0: ["0F0", "0B0"], 1: ["1F0", "1B0"]})
    r = simulate(s, Costs(f=[1.0, 2.0], b=[3.0, 4.0], comm=0.5))
    # 0F0 [0,1], 1F0 [1.5,3.5], 1B0 [3.5,7.5], 0B0 [8,11]
    assert r.makespan == pytest.approx(11.0)
    ev = {e.action: (e.start, e.end) for e in r.timeline.events}
    assert ev == {"0F0": (0.0, 1.0), "1F0": (1.5, 3.5), "1B0": (3.5, 7.5), "0B0": (8.0, 11.0)}
    assert r.busy == {0: 4.0, 1: 6.0}
    assert r.idle == {0: 7.0, 1: 5.0}
    assert r.bubble == pytest.approx(1 - 10 / 22)
    assert r.peak_memory == {0: 1, 1: 1}
    assert r.peak_memory_time == {0: 0.0, 1: 1.5}
    assert [e.action for e in r.critical_path] == ["0F0", "1F0", "1B0", "0B0"]
    assert r.lower_bound == pytest.approx(11.0)


def test_same_rank_stages_pass_data_without_latency() -> None:
    # One rank holding both stages: comm never applies.
    s = sched({0: ["0F0", "1F0", "1B0", "0B0"]})
    r = simulate(s, Costs(f=1, b=2, comm=5))
    assert r.makespan == 6.0
    assert r.bubble == 0.0


def test_split_backward_frees_at_w_and_w_waits_for_i() -> None:
    s = sched({0: ["0F0", "0F1", "0I0", "0I1", "0W0", "0W1"]})
    r = simulate(s, Costs(f=1, i=1, w=1))
    assert r.makespan == 6.0
    assert r.peak_memory == {0: 2}
    # an activation released by W at time t and one taken at t do not count together
    s2 = sched({0: ["0F0", "0I0", "0W0", "0F1", "0I1", "0W1"]})
    assert simulate(s2, Costs(f=1, i=1, w=1)).peak_memory == {0: 1}


def test_overlap_pair_duration_memory_and_outputs() -> None:
    s = sched({0: ["0F0", "1F0", "(0F1;1B0)OVERLAP_F_B", "1F1", "0B0", "1B1", "0B1"]})
    sequential = simulate(s, Costs(f=1, b=2))
    assert sequential.makespan == pytest.approx(1 + 1 + 3 + 1 + 2 + 2 + 2)
    half = simulate(s, Costs(f=1, b=2, overlap=0.5))
    assert half.makespan == pytest.approx(1 + 1 + 2.5 + 1 + 2 + 2 + 2)
    full = simulate(s, Costs(f=1, b=2, overlap=1.0))
    assert full.makespan == pytest.approx(1 + 1 + 2 + 1 + 2 + 2 + 2)
    # 0F0 and 1F0 held, the pair takes 0F1 before 1B0 releases 1F0
    assert sequential.peak_memory == {0: 3}
    assert sequential.peak_memory_time == {0: 2.0}
    kinds = {e.action: e.kind for e in sequential.timeline.events}
    assert kinds["(0F1;1B0)OVERLAP_F_B"] == "OVERLAP_F_B"


def test_overlap_waits_for_inputs_of_every_part() -> None:
    # rank 1's pair needs 1F1's input (0F1 on rank 0) and 2B0's grad (rank 0 again, V layout)
    s = sched(
        {
            0: ["0F0", "0F1", "3F0", "3B0", "3F1", "3B1", "0B0", "0B1"],
            1: ["1F0", "2F0", "(1F1;2B0)OVERLAP_F_B", "2F1", "1B0", "2B1", "1B1"],
        }
    )
    r = simulate(s, Costs(f=1, b=1, comm=0.25))
    pair = next(e for e in r.timeline.events if e.kind == "OVERLAP_F_B")
    f3b0 = next(e for e in r.timeline.events if e.action == "3B0")
    assert pair.start == pytest.approx(f3b0.end + 0.25)
    assert pair.end == pytest.approx(pair.start + 2)


def test_activation_bytes_per_stage() -> None:
    s = build_schedule("GPipe", 2, 3)
    r = simulate(s, Costs(f=1, b=2, activation_bytes=[10.0, 100.0]))
    assert r.peak_memory_bytes == {0: 30.0, 1: 300.0}
    assert r.peak_memory_bytes_time is not None
    assert r.peak_memory_bytes_time[1] == r.peak_memory_time[1]
    assert simulate(s, Costs()).peak_memory_bytes is None


def test_forward_only_frees_at_forward_end() -> None:
    s = sched({0: ["0F0", "0F1", "0F2"], 1: ["1F0", "1F1", "1F2"]})
    r = simulate(s, Costs(f=1, comm=1))
    assert r.peak_memory == {0: 1, 1: 1}
    assert r.makespan == 1 + 1 + 3


def test_idle_steps_take_no_time() -> None:
    a = sched({0: ["0F0", "", "", "0B0"], 1: ["", "1F0", "1B0"]})
    b = sched({0: ["0F0", "0B0"], 1: ["1F0", "1B0"]})
    assert simulate(a).makespan == simulate(b).makespan == 6.0


# ---------------------------------------------------------------- lowered schedules
def test_lowered_by_hand_send_post_sets_arrival() -> None:
    low = sched(
        {
            0: ["0F0", "0SEND_F0", "0RECV_B0", "0B0"],
            1: ["1RECV_F0", "1F0", "1B0", "1SEND_B0"],
        }
    )
    r = simulate(low, Costs(f=1, b=2, comm=0.5))
    assert r.lowered and r.num_sends == 2
    assert r.makespan == pytest.approx(1 + 0.5 + 1 + 2 + 0.5 + 2)
    compute_only = sched({0: ["0F0", "0B0"], 1: ["1F0", "1B0"]})
    assert simulate(compute_only, Costs(f=1, b=2, comm=0.5)).makespan == r.makespan
    # a RECV event spans from its post until the data is there
    recv = next(e for e in r.timeline.events if e.action == "1RECV_F0")
    assert (recv.start, recv.end) == (0.0, 1.5)
    # a SEND issued after other work delays the consumer
    late = sched(
        {
            0: ["0F0", "0F1", "0SEND_F0", "0SEND_F1", "0RECV_B0", "0RECV_B1", "0B0", "0B1"],
            1: ["1RECV_F0", "1RECV_F1", "1F0", "1F1", "1B0", "1SEND_B0", "1B1", "1SEND_B1"],
        }
    )
    first = simulate(late, Costs(f=1, b=1, comm=0))
    f10 = next(e for e in first.timeline.events if e.action == "1F0")
    assert f10.start == 2.0


def test_send_costs_rank_time_when_the_model_says_so() -> None:
    low = sched({0: ["0F0", "0SEND_F0", "0RECV_B0", "0B0"], 1: ["1RECV_F0", "1F0", "1B0", "1SEND_B0"]})
    r = simulate(low, Costs(f=1, b=2, send=0.25, recv=0.25))
    # 0F0 [0,1], send [1,1.25]; rank 1 recv [0,0.25], 1F0 [1.25,2.25], 1B0 → 4.25, send → 4.5;
    # rank 0 recv_b posted at 1.5, 0B0 starts 4.5, ends 6.5
    assert r.makespan == pytest.approx(6.5)
    assert r.busy == {0: 3.0, 1: 3.0}


@pytest.mark.parametrize("name", ["GPipe", "1F1B", "Interleaved1F1B", "ZBH1", "ZBVZeroBubble", "DualPipeV"])
def test_lowered_and_compute_only_agree_at_zero_comm(name: str) -> None:
    for p, m in [(2, 4), (4, 8), (3, 7)]:
        s = build_or_none(name, p, m)
        if s is None:
            continue
        low = s.lower()
        a = simulate(s, Costs(f=1, i=1, w=1))
        b = simulate(low, Costs(f=1, i=1, w=1))
        assert b.lowered
        assert a.makespan == b.makespan, (name, p, m)
        assert a.peak_memory == b.peak_memory
        assert b.num_sends > 0 or p == 1


# ---------------------------------------------------------------- deadlocks and bad input
def test_deadlock_names_ranks_steps_and_actions() -> None:
    s = sched({0: ["0B0", "0F0"], 1: ["1F0", "1B0"]})
    with pytest.raises(ScheduleError) as err:
        simulate(s)
    text = str(err.value)  # validate's wording: the rank, step and action, and the rule broken
    assert "rank 0, step 0, action 0B0: needs 0F0, which rank 0 runs later (step 1)" in text


def test_cross_rank_cycle_is_a_deadlock() -> None:
    s = sched({0: ["0F0", "0F1", "0B1", "0B0"], 1: ["1F0", "1B0", "1F1", "1B1"]})
    simulate(s)  # fine
    bad = sched({0: ["0F0", "0B0", "0F1", "0B1"], 1: ["1F1", "1F0", "1B0", "1B1"]})
    with pytest.raises(
        ScheduleError, match=r"rank 0, step 1, action 0B0: deadlock: .*rank 1, step 0, action 1F1: waits for 0F1"
    ):
        simulate(bad)


def test_missing_send_in_lowered_schedule_is_reported() -> None:
    low = sched({0: ["0F0", "0RECV_B0", "0B0"], 1: ["1RECV_F0", "1F0", "1B0", "1SEND_B0"]})
    with pytest.raises(ScheduleError, match=r"rank 0, step 0, action 0F0: .* but no 0SEND_F0 follows it"):
        simulate(low)


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        ("0RECV_B1", r"duplicate 0RECV_B1, already at step"),
        ("0SEND_F1", r"duplicate 0SEND_F1, already at step"),
        ("0REDUCE_GRAD", r"REDUCE_GRAD"),
    ],
)
def test_a_broken_lowered_schedule_is_refused_not_timed(extra: str, message: str) -> None:
    """A lowered schedule is checked by validate's rules under gloo's model (the simulation's):
    a message received twice used to be timed."""
    low = build_schedule("1F1B", 2, 2).lower(grad_reduce=True)
    rows = {r: [str(a) for a in low.actions[r] if a is not None] for r in range(2)}
    rows[0].append(extra)
    broken = sched(rows)
    with pytest.raises(ScheduleError, match=message):
        simulate(broken)
    with pytest.raises(ScheduleError, match=message):
        validate(broken, matching="gloo")


@pytest.mark.parametrize(
    "rows, message",
    [
        ({0: ["0F0", "0F1", "0B0"], 1: ["1F0", "1B0", "1F1", "1B1"]}, r"rank 0, step 1, action 0F1: has no backward"),
        (
            {0: ["0F0", "0F1", "0B0", "0B1"], 1: ["1F0", "1B0", "1F1", "1B1", "1F1"]},
            r"rank 1, step 4, action 1F1: duplicate 1F1, already at step 2",
        ),
    ],
    ids=["missing-backward", "duplicate-forward"],
)
def test_a_broken_schedule_is_refused_not_timed(rows: dict[int, list[str]], message: str) -> None:
    """Without the check these simulate quietly (a makespan for work that is not all there)."""
    broken = sched(rows)
    with pytest.raises(ScheduleError, match=message):
        simulate(broken)
    with pytest.raises(ScheduleError, match=message):
        broken.validate()  # the same rule, the same words


def test_check_false_skips_the_structure_scan() -> None:
    forward_missing = sched({0: ["0F0", "0F1", "0B0"], 1: ["1F0", "1B0", "1F1", "1B1"]})
    assert simulate(forward_missing, check=False).makespan == 7


def test_per_stage_costs_must_match_stage_count() -> None:
    s = build_schedule("GPipe", 2, 2)
    with pytest.raises(ScheduleError, match="3 per-stage values, but the schedule has 2 stages"):
        simulate(s, Costs(f=[1, 1, 1]))


# ---------------------------------------------------------------- formulas
@settings(max_examples=40, deadline=None)
@given(p=st.integers(1, 8), m=st.integers(1, 24), unit=st.sampled_from([0.5, 1.0, 3.0]))
def test_gpipe_and_1f1b_bubble_formula(p: int, m: int, unit: float) -> None:
    for name in ("GPipe", "1F1B"):
        s = build_or_none(name, p, m)
        if s is None:
            assert name == "1F1B"
            continue
        r = simulate(s, Costs(f=unit, b=2 * unit))
        assert r.makespan == pytest.approx((m + p - 1) * 3 * unit)
        assert r.bubble == pytest.approx((p - 1) / (m + p - 1))
        assert r.makespan >= r.lower_bound - 1e-9


@settings(max_examples=40, deadline=None)
@given(
    p=st.integers(1, 6),
    m=st.integers(1, 10),
    f=st.lists(st.sampled_from([0.5, 1.0, 2.0, 3.0]), min_size=6, max_size=6),
    b=st.lists(st.sampled_from([0.5, 1.0, 2.0, 4.0]), min_size=6, max_size=6),
    comm=st.sampled_from([0.0, 0.25, 1.0]),
)
def test_gpipe_flow_shop_formula_with_per_stage_costs(
    p: int, m: int, f: list[float], b: list[float], comm: float
) -> None:
    # identical jobs through a flow shop: sum of stage times + (m-1) x the bottleneck, each way
    f, b = f[:p], b[:p]
    r = simulate(build_schedule("GPipe", p, m), Costs(f=f, b=b, comm=comm))
    expect = sum(f) + (m - 1) * max(f) + sum(b) + (m - 1) * max(b) + 2 * (p - 1) * comm
    assert r.makespan == pytest.approx(expect)
    assert r.lower_bound <= r.makespan + 1e-9


@pytest.mark.parametrize("p", [2, 3, 4, 6])
def test_1f1b_memory_bound(p: int) -> None:
    r = simulate(build_schedule("1F1B", p, 3 * p))
    assert r.peak_memory == {rank: p - rank for rank in range(p)}
    g = simulate(build_schedule("GPipe", p, 3 * p))
    assert g.peak_memory == {rank: 3 * p for rank in range(p)}


# Zero Bubble paper, Table 2 (T_B there is our I): bubble per rank, peak activations.
@pytest.mark.parametrize("p,m", [(2, 4), (4, 8), (4, 12), (6, 12), (8, 16)])
def test_zero_bubble_table_2(p: int, m: int) -> None:
    f, i, w = 1.0, 1.0, 1.0
    costs = Costs(f=f, i=i, w=w)
    expected = {"1F1B": (p - 1) * (f + i + w), "ZBH1": (p - 1) * (f + i - w), "ZBH2": (p - 1) * (f + i - 2 * w)}
    peaks = {"1F1B": p, "ZBH1": p, "ZBH2": 2 * p - 1}
    for name, bubble in expected.items():
        r = simulate(build_schedule(name, p, m), costs)
        assert max(r.span_idle.values()) == pytest.approx(bubble), name
        # rank 0 starts at once and idles `bubble`; the last rank starts (p-1)F late
        assert r.makespan == pytest.approx(m * (f + i + w) + max(bubble, (p - 1) * f)), name
        assert r.peak_memory[0] == peaks[name], name
        assert max(r.peak_memory.values()) == peaks[name], name


@pytest.mark.parametrize("p,m", [(2, 4), (4, 8), (4, 16), (8, 16)])
def test_zbv_has_no_bubble_at_equal_costs(p: int, m: int) -> None:
    r = simulate(build_schedule("ZBVZeroBubble", p, m, 2), Costs(f=1, i=1, w=1))
    assert all(v == 0 for v in r.span_idle.values())
    assert r.makespan == r.lower_bound == 2 * m * 3 + (p - 1)
    # p activations of a full stage = 2p chunk activations (the memory of 1F1B)
    assert max(r.peak_memory.values()) <= 2 * p


# DualPipe README: DualPipeV's bubble is (PP/2-1)(F&B+B-3W) with PP = 2p (DualPipe's pipeline of
# chunks, folded into a V on p ranks), holding PP+1 chunk activations per rank.
@pytest.mark.parametrize("p,m", [(2, 8), (4, 8), (4, 16), (8, 16)])
@pytest.mark.parametrize("overlap", [0.0, 0.5, 1.0])
def test_dualpipev_readme_table(p: int, m: int, overlap: float) -> None:
    f, i, w = 1.0, 1.0, 1.0
    b = i + w
    costs = Costs(f=f, i=i, w=w, overlap=overlap)
    r = simulate(build_schedule("DualPipeV", p, m, 2), costs)
    f_and_b = costs.overlapped([f, b])
    pp = 2 * p
    formula = (pp / 2 - 1) * (f_and_b + b - 3 * w)
    if overlap == 0.0:
        assert max(r.span_idle.values()) == pytest.approx(formula)
    else:  # the overlapped pairs also shorten the warm-up here, so it does at least as well
        assert max(r.span_idle.values()) <= formula + 1e-9
    assert max(r.peak_memory.values()) == pp + 1


# ---------------------------------------------------------------- invariants over every generator
def _all(p: int, m: int) -> list[Schedule]:
    out = []
    for name in schedule_names():
        for v in (None, 2, 3):
            s = build_or_none(name, p, m, v)
            if s is not None:
                out.append(s)
    return out


@settings(max_examples=25, deadline=None)
@given(
    p=st.integers(1, 5),
    m=st.integers(1, 12),
    f=st.sampled_from([0.5, 1.0, 2.0]),
    i=st.sampled_from([0.5, 1.0, 2.0]),
    w=st.sampled_from([0.25, 1.0]),
    comm=st.sampled_from([0.0, 0.5]),
)
def test_invariants_for_every_generator(p: int, m: int, f: float, i: float, w: float, comm: float) -> None:
    schedules = _all(p, m)
    assume(schedules)
    costs = Costs(f=f, i=i, w=w, comm=comm)
    for s in schedules:
        r = simulate(s, costs)
        assert r.lower_bound <= r.makespan + 1e-9, s.name
        assert 0.0 <= r.bubble < 1.0 or r.makespan == 0
        assert all(0 <= r.busy[k] <= r.makespan + 1e-9 for k in r.busy)
        assert math.isclose(sum(r.busy.values()) + sum(r.idle.values()), p * r.makespan)
        tl = r.timeline
        assert len(tl.events) == len(s)
        assert tl.end == pytest.approx(r.makespan)
        for rank in range(p):
            evs = tl.events_of(rank)
            assert all(a.end <= b.start + 1e-9 for a, b in itertools.pairwise(evs)), (s.name, rank)
        path = r.critical_path
        assert path[0].start == 0.0 and path[-1].end == pytest.approx(r.makespan)
        assert all(a.end <= b.start + 1e-9 for a, b in itertools.pairwise(path))
        again = simulate(s, costs)
        assert again.makespan == r.makespan and again.timeline.events == tl.events


def test_timeline_json_round_trip(tmp_path: object) -> None:
    r = simulate(build_schedule("GPipe", 3, 4), Costs(comm=0.5))
    tl = r.timeline
    assert tl.title and tl.source == "simulated"
    back = Timeline.from_json(tl.to_json())
    assert back == tl
    with pytest.raises(ScheduleError):
        Timeline.from_json('{"format": "nope"}')


# ---------------------------------------------------------------- costs
def test_costs_defaults_and_parse() -> None:
    c = Costs()
    assert (c.f, c.b, c.i, c.w, c.comm) == (1.0, 2.0, 1.0, 1.0, 0.0)
    assert Costs(f=1, b=3).i == 1.5 and Costs(f=1, b=3).w == 1.5
    assert Costs(f=1, b=3, w=1).i == 2.0
    assert Costs(f=2).b == 4.0
    p = Costs.parse("f=2:1:1:2, b=4, comm=0.5, overlap=0.5, bytes=1:2:3:4")
    assert p.f == (2.0, 1.0, 1.0, 2.0) and p.b == 4.0 and p.comm == 0.5 and p.overlap == 0.5
    assert p.activation_bytes == (1.0, 2.0, 3.0, 4.0)
    assert Costs.parse(str(p)) == p
    assert p.duration(Action.parse("(0F1;1B0)OVERLAP_F_B"), 4) == pytest.approx(2 + 4 - 0.5 * 2)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    "text",
    ["f=-1", "x=1", "f=abc", "comm=1:2", "f", "overlap=2", "b=1,i=2"],
)
def test_costs_parse_errors(text: str) -> None:
    with pytest.raises(ScheduleError):
        Costs.parse(text)


def test_costs_reject_bad_values() -> None:
    for kw in ({"f": float("nan")}, {"f": []}, {"f": "1"}, {"comm": -1}, {"f": True}):
        with pytest.raises(ScheduleError):
            Costs(**kw)  # type: ignore[arg-type]


@pytest.mark.parametrize("name", ["1F1B", "GPipe", "ZBH1", "ZBVZeroBubble", "DualPipeV", "ForwardOnly"])
def test_peak_memory_does_not_depend_on_durations(name: str) -> None:
    """A rank's activations change in its program order whatever the costs; zero costs are no exception
    (frees-first at equal times made every zero-cost schedule report a peak of 0)."""
    s = build_schedule(name, 4, 8)
    reference = simulate(s, Costs(f=1, b=2)).peak_memory
    assert reference[0] > 0
    assert simulate(s, Costs(f=0, b=0)).peak_memory == reference
    assert simulate(s, Costs(f=0, b=2, i=0, w=2)).peak_memory == reference
    assert simulate(s, Costs(f=1, b=0, i=0, w=0, overlap=1)).peak_memory == reference


def test_simulate_and_validate_word_a_broken_schedule_alike(tmp_path: Path) -> None:
    """One broken CSV, one message: the rule validate names, not a generic 'no rank can proceed'."""
    from pipetrain.plan import Schedule, ScheduleError, simulate

    path = tmp_path / "bad.csv"
    path.write_text("0F0,0B0\n1B0,1F0\n")
    schedule = Schedule.from_csv(path)
    with pytest.raises(ScheduleError) as by_validate:
        schedule.validate()
    with pytest.raises(ScheduleError) as by_simulate:
        simulate(schedule, Costs())
    assert str(by_simulate.value) == str(by_validate.value)
    assert "1B0: needs 1F0, which rank 1 runs later (step 1)" in str(by_simulate.value)


def test_one_microbatch_is_not_plural() -> None:
    from pipetrain.plan import build_schedule, simulate

    title = simulate(build_schedule("1F1B", 1, 1), Costs()).title
    assert "1 rank, 1 stage, 1 microbatch |" in title


def test_a_backward_leaves_its_gradient_after_freeing_what_it_read() -> None:
    """What an I or B leaves at its end counts after what it frees there (issue 37): 1F1B's last
    rank holds one activation and two received inputs, never the gradient its B made on top of
    the activation that B freed (130 before); ZBH1's first rank, what I keeps for W likewise."""
    s = build_schedule("1F1B", 2, 4).lower()
    assert simulate(s, Costs(f=1, b=2, activation_bytes=100.0, message_bytes=10.0)).peak_memory_bytes == {
        0: 230.0,
        1: 120.0,
    }
    z = build_schedule("ZBH1", 2, 4).lower()
    costs = Costs(f=1, i=1, w=1, activation_bytes=100.0, weight_grad_bytes=150.0, message_bytes=10.0)
    assert simulate(z, costs).peak_memory_bytes == {0: 260.0, 1: 340.0}
