"""Schedule construction (pipetrain.plan.autoplan): every order it builds is complete, runs, fits
its memory limit and is timed exactly as ``simulate`` times it; auto_schedule beats or equals the
named schedules and plans where none fits."""

from __future__ import annotations

import random
import time
from dataclasses import replace

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pipetrain.plan import Costs, ScheduleError, auto_schedule, build_schedule, simulate
from pipetrain.plan.autoplan import Policy, construct, exact, merge_backward
from pipetrain.plan.autoplan.greedy import list_schedule
from pipetrain.plan.autoplan.problem import Problem
from pipetrain.plan.search import layout_problem, plan_schedule


def _costs(n: int, data: st.DataObject, comm: float) -> Costs:
    durations = st.lists(st.sampled_from([0.5, 1.0, 1.5, 2.0]), min_size=n, max_size=n)
    return Costs(
        f=data.draw(durations), i=data.draw(durations), w=data.draw(durations), comm=comm, activation_bytes=[1.0] * n
    )


@settings(max_examples=60, deadline=None)
@given(
    p=st.integers(1, 4),
    v=st.sampled_from([1, 2]),
    m=st.integers(1, 8),
    place=st.sampled_from(["loop", "v"]),
    comm=st.sampled_from([0.0, 0.3]),
    extra=st.integers(0, 6),
    policy=st.builds(
        Policy,
        forward_first=st.booleans(),
        max_inflight=st.one_of(st.none(), st.integers(1, 8)),
        deep_first=st.booleans(),
        split=st.booleans(),
        eager_w=st.booleans(),
        w_fit=st.booleans(),
        noise=st.sampled_from([0.0, 0.5]),
    ),
    data=st.data(),
)
def test_list_scheduling_is_complete_safe_and_timed_like_simulate(
    p: int, v: int, m: int, place: str, comm: float, extra: int, policy: Policy, data: st.DataObject
) -> None:
    """Down to one microbatch's own activations, the list scheduler never deadlocks on memory;
    what it builds validates, lowers, fits, and simulates to the makespan the search saw."""
    if place == "v" and v != 2:
        place = "loop"
    costs = _costs(p * v, data, comm)
    least = layout_problem(p, m, costs, None, v, place, True).least_memory()
    problem = layout_problem(p, m, costs, least + extra, v, place, True)
    orders = list_schedule(problem, policy, random.Random(0))
    assert orders is not None
    assert problem.complete(orders) and problem.fits(orders)
    schedule = problem.to_schedule(orders)
    schedule.validate()
    schedule.lower().validate()
    result = simulate(schedule, costs)
    assert result.makespan == pytest.approx(problem.makespan(orders))
    assert result.peak_memory_bytes is not None
    assert max(result.peak_memory_bytes.values()) <= least + extra + 1e-9
    merged = merge_backward(problem, orders)
    assert problem.complete(merged)
    assert simulate(problem.to_schedule(merged), costs).makespan == pytest.approx(problem.makespan(merged))


def test_plans_below_every_named_schedules_memory() -> None:
    """4 ranks x 2 stages, 4 stage activations per rank: half of what ZB-V and InterleavedZeroBubble
    hold; no named schedule fits, auto_schedule finds one (the issue's case)."""
    n = 8
    costs = Costs(f=[1.0] * n, i=[1.0] * n, w=[1.0] * n, activation_bytes=[1.0] * n)
    plan = plan_schedule(4, 8, costs, 4.0, time_limit=1.0)
    assert plan.best_named is None and plan.schedule.name == "Auto"
    plan.schedule.validate()
    result = simulate(plan.schedule, costs)
    assert result.peak_memory_bytes is not None and max(result.peak_memory_bytes.values()) <= 4
    assert result.makespan == plan.makespan
    zbv = simulate(build_schedule("ZBVZeroBubble", 4, 8), costs)
    assert zbv.makespan <= result.makespan  # twice the memory is worth something


def test_one_activation_per_stage_is_enough() -> None:
    n = 8
    costs = Costs(f=[1.0] * n, i=[1.0] * n, w=[1.0] * n, comm=0.1, activation_bytes=[1.0] * n)
    for place in ("loop", "v"):
        schedule = auto_schedule(4, 6, costs, 2.0, placement=place, time_limit=0.5)
        result = simulate(schedule, costs)
        assert result.peak_memory_bytes is not None and max(result.peak_memory_bytes.values()) <= 2
        assert (schedule.stage_to_rank[7] == 0) == (place == "v")


def test_memory_between_two_named_needs_is_used() -> None:
    """1F1B's memory (p) and ZB-H2's (2p-1) bracket 1.5p: the plan there is faster than at p and
    holds more than p."""
    p, m = 4, 16
    costs = Costs(f=[1.0] * p, i=[1.0] * p, w=[1.0] * p, comm=0.1, activation_bytes=[1.0] * p)
    at_p = plan_schedule(p, m, costs, float(p), time_limit=1.0)
    between = plan_schedule(p, m, costs, 1.5 * p, time_limit=1.0)
    assert between.makespan < at_p.makespan
    assert p < between.memory <= 1.5 * p


def test_latency_breaks_the_named_schedules_assumptions() -> None:
    """With message latency half a forward, the V-shaped named schedules wait; a constructed order
    hides more of it (4 ranks x 2 stages, 4 microbatches, ZB-V's own memory)."""
    n = 8
    ones = [1.0] * n
    costs = Costs(f=ones, i=ones, w=ones, comm=0.5, activation_bytes=ones)
    plan = plan_schedule(4, 4, costs, 8.0, time_limit=4.0)
    assert plan.best_named is not None
    assert plan.makespan < plan.best_named.result.makespan - 1e-9
    assert simulate(plan.schedule, costs).makespan == plan.makespan


def test_returns_within_its_time_limit_at_scale() -> None:
    started = time.perf_counter()
    schedule = auto_schedule(32, 64, Costs.per_rank(f=1, b=2, comm=0.1), 64.0, stages_per_rank=2, time_limit=2.0)
    assert time.perf_counter() - started < 2.0 + 1.5  # one list-scheduling run may end past it
    assert schedule.num_stages == 64


def test_bad_arguments_are_named() -> None:
    costs = Costs.per_rank(f=1, b=2)
    with pytest.raises(ScheduleError, match="placement must be 'loop' or 'v'"):
        auto_schedule(4, 8, costs, placement="zigzag")
    with pytest.raises(ScheduleError, match="placement 'v' needs 2 stages per rank, got 1"):
        auto_schedule(4, 8, costs, placement="v", stages_per_rank=1)
    for bad in (0, -1.0, float("nan"), float("inf"), True):
        with pytest.raises(ScheduleError, match=r"time_limit \(seconds\) must be a finite number > 0"):
            auto_schedule(4, 8, costs, time_limit=bad)
    with pytest.raises(ScheduleError, match=r"one microbatch alone needs 2 on some rank \(1 stage\(s\) per rank"):
        auto_schedule(4, 8, Costs.per_rank(f=1, b=2, activation_bytes=2.0), memory_limit=1.0, stages_per_rank=1)
    for ranks, microbatches, label in (
        (0, 8, "num_ranks"),
        (-1, 8, "num_ranks"),
        (2.0, 8, "num_ranks"),
        (True, 8, "num_ranks"),
        (2, 0, "num_microbatches"),
        (2, 2.5, "num_microbatches"),
    ):
        with pytest.raises(
            ScheduleError,
            match=f"{label} must be an integer >= 1, got {ranks if label == 'num_ranks' else microbatches!r}",
        ):
            auto_schedule(ranks, microbatches, costs, time_limit=0.2)  # type: ignore[arg-type]
    with pytest.raises(ScheduleError, match=r"costs must be a pipetrain\.plan\.Costs, got dict"):
        auto_schedule(2, 4, {"f": 1}, time_limit=0.2)  # type: ignore[arg-type]
    with pytest.raises(ScheduleError, match="unknown schedule"):
        auto_schedule(2, 4, costs, names=["NoSuchSchedule"], time_limit=0.2)


def test_a_placement_alone_means_two_stages_per_rank() -> None:
    """placement="v" or "loop" without stages_per_rank plans 2 stages per rank in that layout."""
    costs = Costs.per_rank(f=1, b=2)
    v = auto_schedule(4, 8, costs, placement="v", time_limit=0.3)
    assert v.num_stages == 8 and v.stage_to_rank[7] == 0
    loop = auto_schedule(4, 8, costs, placement="loop", time_limit=0.3)
    assert loop.num_stages == 8 and loop.stage_to_rank[7] == 3


def test_numbers_of_other_numeric_types_and_one_name_are_taken() -> None:
    """numpy-like integers and reals (numbers.Integral / numbers.Real) are numbers; a string for
    names is one name, not its letters."""
    from fractions import Fraction

    costs = Costs.per_rank(f=1, b=2)
    plan = plan_schedule(4, 8, costs, Fraction(8), stages_per_rank=1, names="1F1B", time_limit=0.3)
    assert plan.best_named is not None and plan.best_named.name == "1F1B"
    assert plan.memory <= 8


def test_time_left_after_the_search_finishes_the_named_schedules(monkeypatch: pytest.MonkeyPatch) -> None:
    """Named schedules the first share of the time does not reach are simulated after the search,
    in time kept back for them: with that share cut to nothing (one schedule, ZB-V), the plan is
    still never slower than the best named schedule (ZB-H2 here, latency 0.3) by more than the
    tolerance within which, without a memory limit, less memory wins (ZB-H2 holds 7 rank shares)."""
    import pipetrain.plan.search as search

    costs = Costs.per_rank(f=1, b=2, comm=0.3)
    best = search.rank_schedules(4, 32, costs)[0]
    assert best.name == "ZBH2"
    monkeypatch.setattr(search, "_NAMED_SHARE", 1e-9)
    plan = plan_schedule(4, 32, costs, time_limit=1.0)
    assert plan.best_named is not None and plan.best_named.name == "ZBH2"
    assert plan.makespan <= (1 + search.MEMORY_TOLERANCE) * best.result.makespan + 1e-9
    assert plan.makespan <= best.result.makespan + 1e-9 or plan.memory < best.memory


@pytest.mark.skipif(not exact.available(), reason="ortools (the solver extra) is not installed")
def test_small_problems_reach_the_exact_optimum() -> None:
    """Where CP-SAT proves an optimum quickly, the planner reaches it (2 ranks, 4 microbatches)."""
    costs = Costs(f=[1.0, 1.6], i=[1.0, 1.6], w=[1.0, 1.6], comm=0.1, activation_bytes=[1.0, 1.0])
    problem = layout_problem(2, 4, costs, 2.0, 1, "loop", True)
    solved = exact.solve(problem, time_limit=20.0)
    assert solved.optimal
    plan = plan_schedule(2, 4, costs, 2.0, time_limit=2.0)
    assert plan.makespan == pytest.approx(solved.makespan)


def test_construct_never_returns_worse_than_its_seed() -> None:
    costs = Costs(f=1, i=1, w=1, comm=0.5)
    named = build_schedule("ZBVZeroBubble", 4, 8)
    problem = Problem.build(4, 8, [named.stage_to_rank[s] for s in range(8)], costs, [1.0] * 8, None, "v")
    seed = problem.orders_of(named)
    found = construct(problem, [seed], time.perf_counter() + 0.5, random.Random(0))
    assert found is not None and found[1] <= problem.makespan(seed) + 1e-9


@pytest.mark.skipif(not exact.available(), reason="ortools (the solver extra) is not installed")
def test_windows_never_worsen_and_keep_the_limit() -> None:
    """CP-SAT over windows of time, from ZB-V with latency: complete, within the memory limit, no
    slower, and timed as simulate times it (a split backward: I then W)."""
    costs = Costs(f=1, i=1, w=1, comm=0.5)
    named = build_schedule("ZBVZeroBubble", 4, 8)
    problem = Problem.build(4, 8, [named.stage_to_rank[s] for s in range(8)], costs, [1.0] * 8, 8.0, "v")
    seed = problem.orders_of(named)
    started = time.perf_counter()
    orders, (makespan, _) = exact.improve_windows(problem, seed, started + 1.0, random.Random(0))
    assert time.perf_counter() - started < 1.5
    assert problem.complete(orders) and problem.fits(orders)
    assert makespan <= problem.makespan(seed) + 1e-9
    assert simulate(problem.to_schedule(orders), costs).makespan == pytest.approx(makespan)


@pytest.mark.skipif(not exact.available(), reason="ortools (the solver extra) is not installed")
def test_windows_solve_a_small_problem_whole_and_stop_when_it_is_proven() -> None:
    """A problem of a few hundred actions is solved whole first: under tight memory (a limit of 4
    with 16 microbatches and latency), from 1F1B, CP-SAT's proven optimum, and no time spent after."""
    costs = Costs(f=1, i=1, w=1, comm=0.5)
    named = build_schedule("1F1B", 4, 16)
    problem = Problem.build(4, 16, [0, 1, 2, 3], costs, [1.0] * 4, 4.0, "loop")
    assert exact.solved_whole_first(problem)
    solved = exact.solve(problem, time_limit=30.0)
    assert solved.optimal
    started = time.perf_counter()
    seed = exact.split_backward(problem, problem.orders_of(named))
    orders, (makespan, _) = exact.improve_windows(problem, seed, started + 30.0, random.Random(0))
    assert makespan == pytest.approx(solved.makespan)
    assert time.perf_counter() - started < 20.0
    assert problem.complete(orders) and problem.fits(orders)


@pytest.mark.parametrize(("v", "place"), [(1, "loop"), (2, "loop"), (2, "v")])
@pytest.mark.parametrize("ratio", [0.5, 2.0])
def test_the_search_counts_memory_as_simulate_does_where_order_alone_sets_it(v: int, place: str, ratio: float) -> None:
    """Without message buffers (the part that depends on timing) the search's memory is simulate's,
    rank by rank: activations, what W reads from I's end, static bytes, and the largest transient
    held throughout (a bound on simulate's, each at its own action); and list scheduling keeps every
    rank within the limit."""
    n = 3 * v
    costs = Costs(
        f=1, i=1, w=1, comm=0.2, activation_bytes=[100.0 * (s + 1) for s in range(n)],
        weight_grad_bytes=[100.0 * (s + 1) * ratio for s in range(n)], static_bytes=[10.0 * s for s in range(n)],
        transient_bytes=[30.0 if s % 2 else 5.0 for s in range(n)],
    )  # fmt: skip
    free = layout_problem(3, 6, costs, None, v, place, True)
    # Down to one microbatch's most on every rank at once (what list scheduling reserves).
    least = max(free.base[r] + sum(free.hold[s] for s in free.stages_of(r)) for r in range(3))
    for limit in (None, least, 1.5 * least):
        problem = layout_problem(3, 6, costs, limit, v, place, True)
        for policy in (Policy(), Policy(split=False), Policy(forward_first=True, eager_w=True)):
            orders = list_schedule(problem, policy, random.Random(0))
            assert orders is not None and problem.fits(orders)
            schedule = problem.to_schedule(orders)
            peaks = simulate(schedule, costs).peak_memory_bytes
            bare = simulate(schedule, replace(costs, transient_bytes=None)).peak_memory_bytes
            assert peaks is not None and bare is not None
            # The search holds a rank's largest transient throughout; simulate counts each action's
            # at its own time: the same without transients, never less with them.
            most = [max(costs.per_stage("transient_bytes", n)[s] for s in problem.stages_of(r)) for r in range(3)]
            got = [problem.peak(o, r) for r, o in enumerate(orders)]
            assert [g - x for g, x in zip(got, most, strict=True)] == pytest.approx([bare[r] for r in range(3)])
            assert all(g >= peaks[r] - 1e-9 for r, g in enumerate(got))
            assert limit is None or max(peaks.values()) <= limit + 1e-9
