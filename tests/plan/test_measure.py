"""Costs from measured timelines recover the costs a timeline was made with."""

from __future__ import annotations

import pytest

from pipetrain.plan import Costs, ScheduleError, build_schedule, simulate
from pipetrain.plan.measure import costs_from_timelines, message_latency
from pipetrain.plan.timeline import Timeline


@pytest.mark.parametrize("name", ["1F1B", "ZBH1", "ZBVZeroBubble", "Interleaved1F1B"])
def test_simulated_timelines_give_back_their_costs(name: str) -> None:
    schedule = build_schedule(name, 4, 8)
    n = schedule.num_stages
    truth = Costs(f=[1.0 + 0.1 * s for s in range(n)], i=[1.5] * n, w=[0.5] * (n - 1) + [0.8], comm=0.25)
    if name in ("1F1B", "Interleaved1F1B"):  # full backward: B only
        truth = Costs(f=truth.f, b=[2.0] * n, comm=0.25)
    timeline = simulate(schedule, truth).timeline
    measured = costs_from_timelines([timeline, timeline], n, activation_bytes=[3.0] * n)
    assert measured.f == pytest.approx(truth.f)
    assert measured.b == pytest.approx(truth.b)
    assert measured.comm == pytest.approx(0.25)
    assert measured.activation_bytes == (3.0,) * n
    if name in ("ZBH1", "ZBVZeroBubble"):
        assert measured.i == pytest.approx(truth.i) and measured.w == pytest.approx(truth.w)


def test_latency_is_zero_without_waits_and_medians_ignore_one_stall() -> None:
    schedule = build_schedule("1F1B", 2, 4)
    fast = simulate(schedule, Costs(f=1, b=2)).timeline
    assert message_latency([fast]) == 0.0
    stalled = simulate(schedule, Costs(f=[1, 5], b=2)).timeline  # one slow step
    costs = costs_from_timelines([fast, fast, stalled], 2)
    assert costs.f == pytest.approx((1.0, 1.0))


def test_no_timeline_or_no_forward_is_named() -> None:
    with pytest.raises(ScheduleError, match="no measured timeline"):
        costs_from_timelines([], 2)
    with pytest.raises(ScheduleError, match="no forward"):
        costs_from_timelines([Timeline(num_ranks=1, events=[], title="", source="measured", unit="s")], 2)
