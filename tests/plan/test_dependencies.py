"""One dependency core, one verdict: validate, simulate, lowering and the search's problem agree.

Every consumer of the rules reads :mod:`pipetrain.plan.dependencies`; these properties check that
they reach the same verdict on the same schedule (runs / cannot run) and the same times, over
named schedules and mutations of them that break order, completeness or communication.
"""

from __future__ import annotations

import math

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from pipetrain.plan import Costs, Schedule, ScheduleError, build_schedule, schedule_names, simulate
from pipetrain.plan.actions import Action, ActionKind
from pipetrain.plan.autoplan.problem import Problem
from pipetrain.plan.dependencies import CODE, Dependencies
from pipetrain.plan.passes._timing import unit_time_run
from pipetrain.plan.passes.early_recv import post_receives_early
from pipetrain.plan.validate import validate
from support.schedules import build_or_none
from support.schedules import mutate as mutate_schedule

NAMES = [n for n in schedule_names() if n != "ForwardOnly"]


def _verdict(fn: object, *args: object, **kwargs: object) -> str | None:
    try:
        fn(*args, **kwargs)  # type: ignore[operator]
    except ScheduleError as err:
        return str(err)
    return None


def _problem(schedule: Schedule, costs: Costs) -> Problem:
    rank_of = [schedule.stage_to_rank[s] for s in range(schedule.num_stages)]
    return Problem.build(
        schedule.num_ranks, schedule.num_microbatches, rank_of, costs, [1.0] * len(rank_of), None, "loop"
    )


CONFIGS = st.tuples(st.sampled_from(NAMES), st.integers(2, 4), st.integers(1, 8))


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(config=CONFIGS, data=st.data(), mutate=st.booleans())
def test_compute_schedules_get_one_verdict(config: tuple[str, int, int], data: st.DataObject, mutate: bool) -> None:
    """validate, simulate, lower (its unit-time run) and the search's problem agree on whether a
    compute schedule runs; where it runs, they agree on its times."""
    schedule = build_or_none(*config)
    if schedule is None:
        return
    if mutate:
        schedule = mutate_schedule(schedule, data)
    costs = Costs(f=1.0, i=1.5, w=0.5, b=2.0, comm=0.25)

    validated = _verdict(validate, schedule)
    simulated = _verdict(simulate, schedule, costs)
    lowered = _verdict(lambda: schedule.lower())
    assert (validated is None) == (simulated is None) == (lowered is None), (validated, simulated, lowered)
    # One wording for one broken schedule: simulate and lower name what validate names.
    assert simulated == validated and lowered == validated

    overlapped = any(a is not None and a.sub_actions for p in schedule.actions.values() for a in p)
    if not overlapped:  # the search's problem runs parts, not OVERLAP_F_B pairs
        problem = _problem(schedule, costs)
        orders = problem.orders_of(schedule)
        runs = problem.complete(orders) and problem.makespan(orders) < math.inf
        backward = any(a is not None and a.kind is not ActionKind.F for p in schedule.actions.values() for a in p)
        if not backward:  # the search plans training: a forward-only schedule is no order of it
            assert not problem.complete(orders)
        else:
            assert runs == (validated is None)
            if runs:
                assert problem.makespan(orders) == pytest.approx(simulate(schedule, costs).makespan)
    if validated is None and not overlapped:  # (an OVERLAP_F_B pair is one unit there)
        unit = Costs(f=1.0, i=1.0, w=1.0, b=1.0, comm=0.0)
        assert unit_time_run(schedule).makespan == pytest.approx(simulate(schedule, unit).makespan)


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(config=CONFIGS, data=st.data(), mutate=st.booleans(), ahead=st.integers(0, 3))
def test_lowered_schedules_agree_across_matching_models(
    config: tuple[str, int, int], data: st.DataObject, mutate: bool, ahead: int
) -> None:
    """What runs under NCCL's strict matching runs under gloo's; the simulation accepts exactly
    what gloo's model does; early receives keep a schedule valid under gloo; lowering never makes
    a schedule faster."""
    schedule = build_or_none(*config)
    if schedule is None:
        return
    costs = Costs(f=1.0, i=1.0, w=1.0, b=2.0, comm=0.5)
    lowered = schedule.lower()
    if ahead:
        early = post_receives_early(lowered, ahead)
        validate(early, matching="gloo")
        assert simulate(early, costs).makespan <= simulate(lowered, costs).makespan + 1e-9
    if mutate:
        lowered = mutate_schedule(lowered, data)
    strict = _verdict(validate, lowered)
    loose = _verdict(validate, lowered, matching="gloo")
    simulated = _verdict(simulate, lowered, costs)
    if strict is None:
        assert loose is None
    assert (loose is None) == (simulated is None), (loose, simulated)
    if loose is None:
        assert simulate(lowered, costs).makespan >= simulate(schedule, costs).makespan - 1e-9


def test_rules_by_hand() -> None:
    """The table says what DESIGN.md §2 says, on a 3-stage loop over 2 ranks."""
    deps = Dependencies(3, 4, [0, 1, 0], lowered=False)
    SM = 12

    def needs(text: str) -> list[int]:
        return deps.part_needs(Action.parse(text))  # type: ignore[arg-type]

    assert needs("0F1") == []
    assert needs("1F1") == [0 * 4 + 1]  # the output of 0F1
    assert needs("2B3") == [2 * 4 + 3]  # the last stage's B needs only its forward
    assert needs("1I2") == [1 * 4 + 2, SM + 2 * 4 + 2]  # its forward and 2I2's input-gradient
    assert needs("0W0") == [SM + 0]  # its I
    assert deps.sends[CODE["F"]] == [True, True, False] and deps.sends[CODE["I"]] == [False, True, True]

    lowered = Dependencies(3, 4, [0, 1, 0], lowered=True)
    f = lowered.part_needs(Action.parse("1F1"))  # type: ignore[arg-type]
    assert f == [3 * SM + 1, 5 * SM + 1]  # the message of 0F1: sent, and received
    send, recv = Action.parse("0SEND_F1"), Action.parse("1RECV_F1")
    assert lowered.carried(send) == lowered.carried(recv) == 1  # type: ignore[arg-type]
    assert lowered.route(Action.parse("1SEND_B2")) == (SM + 6, 1, 0)  # type: ignore[arg-type]
    assert lowered.consumer(SM + 6) == SM + 2 and lowered.consumer(1) == 5
    assert lowered.carried(Action.parse("0RECV_F1")) == -1  # type: ignore[arg-type]
    assert lowered.feeds == [[1, 2, -1], [-1, 0, 1]] and lowered.fed_by == [[-1, 0, 1], [1, 2, -1]]
    # Derived, not restated: the outgoing carriers follow the placement.
    assert [o and o[2] for o in deps.outgoing[CODE["F"]]] == [1, 2, None]


def test_matching_model_is_checked() -> None:
    with pytest.raises(ScheduleError, match="matching must be one of 'nccl', 'gloo', not 'mpi'"):
        validate(build_schedule("1F1B", 2, 2), matching="mpi")


def test_early_receives_pass_gloo_but_not_always_nccl() -> None:
    """The models differ: some early-receive schedule deadlocks under NCCL's strict order only."""
    found = False
    for name in ("1F1B", "Interleaved1F1B", "ZBVZeroBubble"):
        for ranks in (2, 3, 4):
            schedule = build_or_none(name, ranks, 2 * ranks)
            assert schedule is not None
            early = post_receives_early(schedule.lower(), 4)
            validate(early, matching="gloo")
            if _verdict(validate, early) is not None:
                found = True
    assert found
