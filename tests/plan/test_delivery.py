"""plan.delivery: a send is confirmed only where its receiver surely posted its RECV."""

from __future__ import annotations

import pytest

from pipetrain.plan import Action, ActionKind, build_schedule, schedule_names
from pipetrain.plan.delivery import confirmed_sends
from pipetrain.plan.passes.early_recv import post_receives_early

K = ActionKind


def _groups(actions: list[Action | None]) -> dict[Action, int]:
    """Each SEND/RECV -> the number of its posted group on its rank."""
    out: dict[Action, int] = {}
    group, in_group = 0, False
    for action in actions:
        if action is not None and action.kind.is_comm:
            out[action] = group
            in_group = True
        elif in_group:
            group, in_group = group + 1, False
    return out


def _takes(part: Action, num_stages: int) -> tuple[Action, Action] | None:
    """(the SEND, the RECV) of the message ``part`` uses, or None."""
    m = part.microbatch
    if part.kind is K.F and part.stage > 0:
        return Action(part.stage - 1, K.SEND_F, m), Action(part.stage, K.RECV_F, m)
    if part.kind in (K.I, K.B) and part.stage < num_stages - 1:
        return Action(part.stage + 1, K.SEND_B, m), Action(part.stage, K.RECV_B, m)
    return None


CASES = [(name, p, m) for name in schedule_names() for p, m in ((2, 4), (4, 8))]


@pytest.mark.parametrize(("name", "p", "m"), CASES)
@pytest.mark.parametrize("ahead", [0, 3])
def test_a_confirmed_send_was_surely_received(name: str, p: int, m: int, ahead: int) -> None:
    try:
        schedule = build_schedule(name, num_ranks=p, num_microbatches=m)
    except Exception:
        pytest.skip(f"{name} has no schedule at {p} ranks x {m} microbatches")
    low = schedule.lower()
    if ahead:
        low = post_receives_early(low, ahead)
    groups = {r: _groups(low.actions[r]) for r in low.actions}
    position = {r: {a: k for k, a in enumerate(low.actions[r]) if a is not None} for r in low.actions}
    confirmed = confirmed_sends(low)
    seen: set[Action] = set()
    count = 0
    for rank, by_action in confirmed.items():
        for consumer, sends in by_action.items():
            for send in sends:
                assert send not in seen, f"{send} confirmed twice"
                seen.add(send)
                count += 1
                assert position[rank][send] < position[rank][consumer], (
                    f"{send} confirmed at {consumer}, before its post"
                )
                receiver = low.stage_to_rank[send.stage + 1 if send.kind is K.SEND_F else send.stage - 1]
                recv = (
                    Action(send.stage + 1, K.RECV_F, send.microbatch)
                    if send.kind is K.SEND_F
                    else Action(send.stage - 1, K.RECV_B, send.microbatch)
                )
                # The consumer takes a message its receiver sent in a later group than the RECV.
                answers = [
                    groups[receiver][taken[0]]
                    for part in consumer.parts
                    if (taken := _takes(part, low.num_stages)) is not None
                    and low.stage_to_rank[taken[0].stage] == receiver
                ]
                assert any(g > groups[receiver][recv] for g in answers), (rank, str(consumer), str(send))
    if p > 1 and schedule.has_backward:
        assert count > 0  # some sends are released before the step's end
