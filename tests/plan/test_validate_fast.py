"""validate()'s fast path (``accepts``) agrees with its full checks (``_check``).

The fast path may only accept: a schedule it accepts must pass the full checks, or an invalid
schedule would get through. And on schedules without OVERLAP_F_B (which it leaves to the full
checks) it should accept every sound one, or it costs time for nothing. Both are checked on every
generator's schedules, compute-only and lowered, and on random edits of them.
"""

from __future__ import annotations

import pytest
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from pipetrain.plan import Schedule, ScheduleError, schedule_names
from pipetrain.plan.actions import Action, ActionKind
from pipetrain.plan.validate import _check
from pipetrain.plan.validate import fast as fast_module
from pipetrain.plan.validate.fast import accepts
from support.schedules import build_or_none
from support.schedules import mutate as mutate_schedule

NAMES = schedule_names()


def _has_overlap(schedule: Schedule) -> bool:
    return any(a is not None and a.sub_actions is not None for a in schedule.iter_actions())


def _full_verdict(schedule: Schedule, strict: bool) -> bool:
    try:
        _check(schedule, strict)
    except ScheduleError:
        return False
    return True


def _agree(schedule: Schedule) -> None:
    for strict in (True, False):
        fast = accepts(schedule, strict)
        full = _full_verdict(schedule, strict)
        assert not fast or full, "the fast path accepted a schedule the full checks reject"
        if not _has_overlap(schedule):
            assert fast == full, "the fast path refused a sound schedule"


def _variants(schedule: Schedule) -> list[Schedule]:
    backward = schedule.has_backward
    out = [schedule, schedule.lower(), schedule.lower(fsdp=True, grad_reduce=backward, prefetch=2)]
    if backward:
        out.append(schedule.lower(merge_iw=True, grad_reduce=True, fsdp=True))
        out.append(schedule.lower(recv_ahead=2))
    out.append(schedule.lower(comms=False, fsdp=True))
    return out


@pytest.mark.parametrize("name", NAMES)
def test_named_schedules_take_the_fast_path(name: str) -> None:
    for p, m in ((2, 3), (3, 5), (4, 8)):
        schedule = build_or_none(name, p, m)
        if schedule is None:
            continue
        for variant in _variants(schedule):
            _agree(variant)


@settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    config=st.tuples(st.sampled_from(NAMES), st.integers(2, 4), st.integers(1, 8)),
    variant=st.integers(0, 5),
    data=st.data(),
)
def test_fast_path_agrees_on_edited_schedules(config: tuple[str, int, int], variant: int, data: st.DataObject) -> None:
    schedule = build_or_none(*config)
    if schedule is None:
        return
    variants = _variants(schedule)
    _agree(mutate_schedule(variants[variant % len(variants)], data, idle=True))


def test_malformed_cells_go_to_the_full_checks() -> None:
    bad = Schedule({0: [Action.parse("0F0"), Action.parse("0B0")]})._derived({0: ["0F0"]})  # type: ignore[list-item]
    assert not accepts(bad, True)
    with pytest.raises(ScheduleError, match="expected an Action or None"):
        bad.validate()


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    config=st.tuples(st.sampled_from(["ZBVZeroBubble", "InterleavedZeroBubble", "ZBH1", "ZBH2"]), st.integers(2, 4)),
    lowered=st.booleans(),
    data=st.data(),
)
def test_a_moved_w_is_judged_as_the_full_checks_judge_it(
    config: tuple[str, int], lowered: bool, data: st.DataObject
) -> None:
    """W parts stay out of the fast path's run (their one need, the I, is checked by the scan to
    come first on the rank): moving a W anywhere on its rank must not change the verdict."""
    name, p = config
    schedule = build_or_none(name, p, 2 * p)
    if schedule is None:
        return
    if lowered:
        schedule = schedule.lower(fsdp=data.draw(st.booleans()), grad_reduce=True)
    rows = {r: list(row) for r, row in schedule.actions.items()}
    ws = [(r, k) for r, row in rows.items() for k, a in enumerate(row) if a is not None and a.kind is ActionKind.W]
    if not ws:
        return
    r, k = data.draw(st.sampled_from(ws))
    w = rows[r].pop(k)
    rows[r].insert(data.draw(st.integers(0, len(rows[r]))), w)
    _agree(schedule._derived(rows))


def _proof_verdicts(schedule: Schedule) -> tuple[list[bool], bool]:
    """What the unit-time proof said (empty: not tried) and whether the messages were run, under
    the strict model."""
    said: list[bool] = []
    ran: list[bool] = []
    proof, execute = fast_module._timed_proof, fast_module._fast_execute

    def spy_proof(*args: object) -> bool:
        said.append(proof(*args))  # type: ignore[arg-type]
        return said[-1]

    def spy_execute(*args: object) -> bool:
        ran.append(True)
        return execute(*args)  # type: ignore[arg-type]

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(fast_module, "_timed_proof", spy_proof)
        patch.setattr(fast_module, "_fast_execute", spy_execute)
        accepts(schedule, True)
    return said, bool(ran)


@pytest.mark.parametrize("name", NAMES)
def test_lowered_schedules_are_proven_without_running_their_messages(name: str) -> None:
    """lower() places messages as the unit-time proof needs: it proves every one, with no run of the messages."""
    for p, m in ((2, 3), (3, 5), (4, 8)):
        schedule = build_or_none(name, p, m)
        if schedule is None or _has_overlap(schedule):
            continue
        backward = schedule.has_backward
        for low in (schedule.lower(), schedule.lower(fsdp=True, grad_reduce=backward, max_unsharded=1)):
            if not low.is_lowered or not any(a.kind.value.startswith("SEND") for a in low.iter_actions() if a):
                continue
            assert _proof_verdicts(low) == ([True], False), (name, p, m)


@settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    config=st.tuples(st.sampled_from(NAMES), st.integers(2, 4), st.integers(1, 6)),
    data=st.data(),
)
def test_the_proof_only_accepts_what_the_run_of_the_messages_accepts(
    config: tuple[str, int, int], data: st.DataObject
) -> None:
    """Edits that reorder a lowered schedule's SEND/RECV: whatever the unit-time proof accepts,
    the full strict checks accept too."""
    schedule = build_or_none(*config)
    if schedule is None or _has_overlap(schedule):
        return
    low = schedule.lower()
    programs = {r: list(low.actions[r]) for r in range(low.num_ranks)}
    for _ in range(data.draw(st.integers(1, 3), label="swaps")):
        r = data.draw(st.sampled_from(sorted(programs)), label="rank")
        # A SEND swapped with a nearby RECV keeps each direction's FIFO order, so the scan passes
        # and the order between the directions, which may deadlock, is what is judged.
        sends = [i for i, a in enumerate(programs[r]) if a is not None and a.kind.value.startswith("SEND")]
        recvs = [i for i, a in enumerate(programs[r]) if a is not None and a.kind.value.startswith("RECV")]
        if not sends or not recvs:
            continue
        i = data.draw(st.sampled_from(sends), label="send")
        near = sorted(recvs, key=lambda j: abs(j - i))[:3]  # (far moves mostly cross a producer or user)
        j = data.draw(st.sampled_from(near), label="recv")
        programs[r][i], programs[r][j] = programs[r][j], programs[r][i]
    edited = low._derived(programs)
    said, _ = _proof_verdicts(edited)
    event(f"proof: {said}")
    if said == [True]:
        assert _full_verdict(edited, True), "the proof accepted a schedule the full checks reject"
