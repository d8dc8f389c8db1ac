"""Each action's transient counted at its own time (issue 37): a rank's peak is the most it holds
while an action runs plus that action's stage's ``transient_bytes``, not its most held plus its
largest transient wherever each falls."""

from __future__ import annotations

import random

import pytest

from pipetrain.plan.actions import Action
from pipetrain.plan.costs import Costs
from pipetrain.plan.errors import ScheduleError
from pipetrain.plan.generators import build_schedule, schedule_names
from pipetrain.plan.schedule import Schedule
from pipetrain.plan.simulate import simulate


def _schedule(rows: dict[int, list[str]]) -> Schedule:
    return Schedule({r: [Action.parse(c) for c in row] for r, row in rows.items()})  # type: ignore[misc]


def test_a_transient_counts_on_what_is_held_while_its_own_action_runs() -> None:
    """Two ranks, four stages in a loop (rank 0: stages 0 and 2, rank 1: 1 and 3), one
    microbatch, f=1, b=2, no latency, no message bytes.

    Times: 0F0 [0,1], 1F0 [1,2], 2F0 [2,3], 3F0 [3,4], 3B0 [4,6], 2B0 [6,8], 1B0 [8,10],
    0B0 [10,12].

    Rank 0 (activations 100 and 40, transients 80 and 30): it holds 100 from 0, 140 from 2 until
    2B0 ends at 8 (idle from 3 to 6), then 100 until 12. While 0F0 runs it holds 100 (+80: 180);
    2F0 and 2B0 140 (+30: 170); 0B0 100 (+80: 180). Peak 180, first at 0F0's start (t=0). The
    old sum of the most held and the largest transient said 140 + 80 = 220.

    Rank 1 (activations 20 and 60, transients 50 and 5): 1F0 holds 20 (+50: 70), 3F0 and 3B0
    80 (+5: 85), 1B0 20 (+50: 70). Peak 85 at 3F0's start (t=3); the old sum said 80 + 50 = 130.
    """
    schedule = _schedule({0: ["0F0", "2F0", "2B0", "0B0"], 1: ["1F0", "3F0", "3B0", "1B0"]})
    costs = Costs(f=1, b=2, activation_bytes=[100.0, 20.0, 40.0, 60.0], transient_bytes=[80.0, 50.0, 30.0, 5.0])
    result = simulate(schedule, costs)
    assert result.makespan == pytest.approx(12.0)
    assert result.peak_memory_bytes == {0: 180.0, 1: 85.0}
    assert result.peak_memory_bytes_time == {0: 0.0, 1: 3.0}
    # Static bytes add to every rank whatever runs.
    with_static = simulate(schedule, Costs(f=1, b=2, static_bytes=7.0, **_bytes(costs)))
    assert with_static.peak_memory_bytes == {0: 194.0, 1: 99.0}


def _bytes(costs: Costs) -> dict[str, object]:
    return {"activation_bytes": costs.activation_bytes, "transient_bytes": costs.transient_bytes}


def test_a_split_backward_holds_its_transient_on_the_larger_side_of_its_i() -> None:
    """One rank, one stage, one microbatch split: F [0,1], I [1,2], W [2,3]; activation 100, what
    W reads 150, transient 20. F holds 100 (+20: 120); I holds 100 before and 150 after (+20:
    170); W 150 before (+20: 170). Without the transient: 150, reached at I's end."""
    schedule = _schedule({0: ["0F0", "0I0", "0W0"]})
    costs = Costs(f=1, i=1, w=1, activation_bytes=100.0, weight_grad_bytes=150.0, transient_bytes=20.0)
    result = simulate(schedule, costs)
    assert result.peak_memory_bytes == {0: 170.0}
    assert result.peak_memory_bytes_time == {0: 2.0}  # I's end, where it trades 100 for 150
    plain = simulate(schedule, Costs(f=1, i=1, w=1, activation_bytes=100.0, weight_grad_bytes=150.0))
    assert plain.peak_memory_bytes == {0: 150.0} and plain.peak_memory_bytes_time == {0: 2.0}


def test_a_forward_only_step_counts_no_transient() -> None:
    """A transient is what a stage with a backward allocates: a forward-only step holds none."""
    schedule = _schedule({0: ["0F0", "0F1"]})
    result = simulate(schedule, Costs(f=1, activation_bytes=100.0, transient_bytes=50.0))
    assert result.peak_memory_bytes == {0: 100.0}


@pytest.mark.parametrize("name", [n for n in schedule_names() if n != "ForwardOnly"])
@pytest.mark.parametrize("lowered", [False, True])
def test_the_peak_lies_between_the_most_held_and_that_plus_the_largest_transient(name: str, lowered: bool) -> None:
    """On every named schedule, compute-only and lowered, with random per-stage bytes: the peak
    with transients is at least the peak without them (a rank can reach that while idle, waiting
    with buffers it cannot free yet) and at most that plus the rank's largest transient (the old,
    looser promise)."""
    rng = random.Random(sum(map(ord, name)))
    p, m = 2, 4
    try:
        schedule = build_schedule(name, p, m, 2)
    except ScheduleError:  # (a single-stage family: one stage per rank)
        schedule = build_schedule(name, p, m)
    if lowered:
        schedule = schedule.lower()
    n = schedule.num_stages
    held = {
        "activation_bytes": [float(rng.randint(50, 150)) for _ in range(n)],
        "weight_grad_bytes": [float(rng.randint(50, 200)) for _ in range(n)],
        "message_bytes": [float(rng.randint(5, 30)) for _ in range(n)],
    }
    transient = [float(rng.randint(0, 100)) for _ in range(n)]
    without = simulate(schedule, Costs(f=1, i=1, w=1, comm=0.1, **held)).peak_memory_bytes
    with_ = simulate(schedule, Costs(f=1, i=1, w=1, comm=0.1, transient_bytes=transient, **held)).peak_memory_bytes
    assert without is not None and with_ is not None
    for r in range(p):
        mine = [transient[s] for s in schedule.stages_of(r)]
        assert without[r] - 1e-9 <= with_[r] <= without[r] + max(mine) + 1e-9, (r, without, with_)


def test_a_backward_in_one_pass_holds_its_own_transient_and_a_split_one_does_not() -> None:
    """``b_transient_bytes`` is B's alone (issue 37): one rank, one stage, one microbatch,
    activation 100, what W reads 150, transient 20 (F, I, W), B's 70.

    F [0,1], B [1,3]: F holds 100 (+20: 120); B holds 100 from its start until its end frees it
    (+70: 170). Peak 170 at B's start (t=1); with one transient for all (20) it was 120.

    F [0,1], I [1,2], W [2,3]: no B runs, so B's 70 is never charged: F 100 (+20: 120), I 100
    before and 150 after (+20: 170), W 150 (+20: 170). Peak 170 at I's end (t=2); a B transient
    of 500 changes nothing (one transient for all at 500 would say 650)."""
    whole = _schedule({0: ["0F0", "0B0"]})
    costs = Costs(f=1, b=2, activation_bytes=100.0, transient_bytes=20.0, b_transient_bytes=70.0)
    got = simulate(whole, costs)
    assert got.peak_memory_bytes == {0: 170.0} and got.peak_memory_bytes_time == {0: 1.0}
    one = simulate(whole, Costs(f=1, b=2, activation_bytes=100.0, transient_bytes=20.0))
    assert one.peak_memory_bytes == {0: 120.0}  # b_transient_bytes defaults to transient_bytes
    split = _schedule({0: ["0F0", "0I0", "0W0"]})
    held = {"activation_bytes": 100.0, "weight_grad_bytes": 150.0, "transient_bytes": 20.0}
    for b_transient in (70.0, 500.0):
        got = simulate(split, Costs(f=1, i=1, w=1, b_transient_bytes=b_transient, **held))  # type: ignore[arg-type]
        assert got.peak_memory_bytes == {0: 170.0} and got.peak_memory_bytes_time == {0: 2.0}
    old = simulate(split, Costs(f=1, i=1, w=1, **{**held, "transient_bytes": 500.0}))  # type: ignore[arg-type]
    assert old.peak_memory_bytes == {0: 650.0}


def test_only_a_b_transient_charges_b_alone() -> None:
    """``b_transient_bytes`` without ``transient_bytes``: F, I and W allocate nothing beyond what
    is held. F [0,1] holds 100 (100), B [1,3] 100 (+30: 130); peak 130 at t=1."""
    got = simulate(_schedule({0: ["0F0", "0B0"]}), Costs(f=1, b=2, activation_bytes=100.0, b_transient_bytes=30.0))
    assert got.peak_memory_bytes == {0: 130.0} and got.peak_memory_bytes_time == {0: 1.0}


def test_the_b_transient_reads_writes_and_cuts_like_the_other_byte_costs() -> None:
    costs = Costs.parse("f=1,b=2,transient_bytes=4:6,b_transient_bytes=8:12")
    assert costs.b_transient_bytes == (8.0, 12.0)
    assert Costs.parse(str(costs)) == costs
    assert costs.transients(2) == ([4.0, 6.0], [8.0, 12.0])
    assert Costs(transient_bytes=5.0).transients(2) == ([5.0, 5.0], [5.0, 5.0])
    assert Costs().transients(2) is None
    assert Costs.per_rank(b_transient_bytes=8.0).cut_into(2).b_transient_bytes == 4.0
    with pytest.raises(ScheduleError):
        Costs(transient_bytes=[1.0, 2.0], b_transient_bytes=[1.0, 2.0, 3.0])
