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


def test_a_stage_that_never_ran_a_kind_gets_the_other_stages_median() -> None:
    """(What `pipetrain train` writes to costs.txt for one step, where a stage may run no I or W.)"""
    from pipetrain.plan.timeline import TimelineEvent

    def ev(rank: int, label: str, kind: str, stage: int, start: float, end: float) -> TimelineEvent:
        return TimelineEvent(rank, label, kind, stage, int(label[-1]), start, end)

    tl = Timeline(
        3,
        [ev(0, "0F0", "F", 0, 0, 1), ev(0, "0F1", "F", 0, 1, 4), ev(1, "1F0", "F", 1, 1, 3),
         ev(1, "1I0", "I", 1, 3, 4), ev(1, "1W0", "W", 1, 4, 4.5), ev(2, "2F0", "F", 2, 3, 4),
         ev(2, "2I0", "I", 2, 4, 7), ev(2, "2W0", "W", 2, 7, 8.5)],
    )  # fmt: skip
    costs = costs_from_timelines([tl], 3)
    assert costs.f == (2.0, 2.0, 1.0)  # stage 0: the median of 1 and 3
    assert costs.i == (2.0, 1.0, 3.0) and costs.w == (1.0, 0.5, 1.5)  # stage 0 ran none: the others' median
    assert costs.b == (3.0, 1.5, 4.5)


def test_a_stage_seen_running_its_backward_one_way_gets_the_other_way_from_its_own_numbers() -> None:
    """Stage 0 ran B only, stage 1 I and W only, stage 2 both: B on stage 1 is its own I + W (not
    stage 0's B), I and W on stage 0 half its own B; a stage that ran both keeps what it measured."""
    from pipetrain.plan.timeline import TimelineEvent

    def ev(rank: int, label: str, kind: str, stage: int, start: float, end: float) -> TimelineEvent:
        return TimelineEvent(rank, label, kind, stage, int(label[-1]), start, end)

    tl = Timeline(
        3,
        [ev(0, "0F0", "F", 0, 0, 1), ev(0, "0B0", "B", 0, 9, 11), ev(1, "1F0", "F", 1, 1, 3),
         ev(1, "1I0", "I", 1, 7, 8), ev(1, "1W0", "W", 1, 8, 12), ev(2, "2F0", "F", 2, 3, 4),
         ev(2, "2F1", "F", 2, 4, 5), ev(2, "2B0", "B", 2, 5, 6), ev(2, "2I1", "I", 2, 6, 7),
         ev(2, "2W1", "W", 2, 7, 8)],
    )  # fmt: skip
    costs = costs_from_timelines([tl], 3)
    assert costs.b == (2.0, 5.0, 1.0)
    assert costs.i == (1.0, 1.0, 1.0) and costs.w == (1.0, 4.0, 1.0)
