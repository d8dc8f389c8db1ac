"""Tight memory with what W reads (issue 37): the exact model counts memory as ``simulate`` does,
and auto_schedule never returns a schedule that ``simulate`` puts over its limit."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pipetrain.plan import Costs, ScheduleError, auto_schedule, simulate
from pipetrain.plan.autoplan import exact
from pipetrain.plan.autoplan.problem import KIND_B
from pipetrain.plan.search import layout_problem

needs_ortools = pytest.mark.skipif(not exact.available(), reason="ortools (the solver extra) is not installed")


def _costs(n: int, wgrad: float | None, comm: float = 0.1) -> Costs:
    """Uniform durations, 2 bytes of activation per stage, ``wgrad`` bytes for what W reads."""
    return Costs(
        f=[1.0] * n,
        i=[1.0] * n,
        w=[1.0] * n,
        comm=comm,
        activation_bytes=[2.0] * n,
        weight_grad_bytes=None if wgrad is None else [wgrad] * n,
    )


@needs_ortools
@pytest.mark.parametrize("wgrad", [None, 1.0, 3.0])
@pytest.mark.parametrize("place", ["loop", "v"])
def test_the_exact_model_counts_memory_as_simulate_does(wgrad: float | None, place: str) -> None:
    """CP-SAT's optimum, simulated: the same makespan, and each rank's peak the model's, within the limit."""
    costs = _costs(4, wgrad)
    limit = 6.0
    problem = layout_problem(2, 3, costs, limit, 2, place, True)
    solved = exact.solve(problem, time_limit=30.0)
    assert solved.optimal and solved.orders is not None
    result = simulate(problem.to_schedule(solved.orders), costs)
    assert result.makespan == pytest.approx(solved.makespan)
    assert result.peak_memory_bytes is not None
    for r, program in enumerate(solved.orders):
        assert result.peak_memory_bytes[r] == pytest.approx(problem.peak(program, r))
        assert result.peak_memory_bytes[r] <= limit + 1e-9


@needs_ortools
def test_a_backward_runs_as_one_b_where_only_that_fits() -> None:
    """W reading more than the activation (3 bytes against 2) under a limit of 2: split, nothing
    fits, but one B holds the activation alone; its gradient is handed on at its end."""
    costs = _costs(2, 3.0, comm=0.0)
    problem = layout_problem(2, 1, costs, 2.0, 1, "loop", True)
    solved = exact.solve(problem, time_limit=10.0)
    assert solved.optimal and solved.orders is not None
    sm = problem.num_stages * problem.num_microbatches
    assert all(any(c // sm == KIND_B for c in program) for program in solved.orders)
    assert solved.makespan == pytest.approx(6.0)  # F, F, B, B: nothing overlaps
    result = simulate(problem.to_schedule(solved.orders), costs)
    assert result.makespan == pytest.approx(6.0)
    assert result.peak_memory_bytes is not None and max(result.peak_memory_bytes.values()) <= 2.0 + 1e-9


@settings(max_examples=12, deadline=None)
@given(
    p=st.integers(2, 3),
    v=st.sampled_from([1, 2]),
    m=st.integers(2, 5),
    wgrad=st.sampled_from([None, 1.0, 3.0]),
    comm=st.sampled_from([0.0, 0.3]),
    extra=st.integers(0, 4),
)
def test_auto_schedule_keeps_tight_limits(p: int, v: int, m: int, wgrad: float | None, comm: float, extra: int) -> None:
    """From the least memory a layout needs upwards, auto's schedule is simulated within the limit;
    below every layout's least it raises."""
    costs = _costs(p * v, wgrad, comm)
    least = min(
        layout_problem(p, m, costs, None, v, place, True).least_memory()
        for place in (("loop", "v") if v == 2 else ("loop",))
    )
    limit = least + extra
    schedule = auto_schedule(p, m, costs, limit, time_limit=0.3)
    result = simulate(schedule, costs)
    assert result.peak_memory_bytes is not None
    assert max(result.peak_memory_bytes.values()) <= limit + 1e-9
    with pytest.raises(ScheduleError, match="no schedule fits"):
        auto_schedule(p, m, costs, least - 1.0, time_limit=0.3)
