"""When a rank knows for certain that a message it sent was delivered, whatever the timing.

A send completes once its receiver has posted the matching RECV. The sender cannot see that
post, but it sees its consequences: a message the receiver sent *after* posting that RECV (in the
receiver's program order; a group posts its sends before its receives, so only RECVs of earlier
groups count). So once the sender has taken such a message, or any later one from that receiver
(at the start of the compute action that uses it), the send is surely delivered, on any machine
and at any speed. The runtime waits for those sends there (an instant wait) and drops their
buffers; the memory model (:mod:`pipetrain.plan.memory`) frees them at the same point. A send
never so confirmed is waited for at the end of the step. (A message whose layout is new to its
receiver needs more than the RECV's post, so the runtime confirms only messages of a known layout:
from a schedule's second step with the same shapes on.)
"""

from __future__ import annotations

import heapq

from pipetrain.plan.actions import Action, ActionKind
from pipetrain.plan.schedule import Schedule

__all__ = ["confirmed_sends"]

_K = ActionKind
Message = tuple[bool, int, int]  # (forward, sending stage, microbatch)


def _message(action: Action) -> Message:
    """The message a SEND or RECV action carries."""
    m = action.microbatch or 0
    if action.kind is _K.SEND_F or action.kind is _K.SEND_B:
        return (action.kind is _K.SEND_F, action.stage, m)
    return (action.kind is _K.RECV_F, action.stage - 1 if action.kind is _K.RECV_F else action.stage + 1, m)


def _groups(actions: list[Action | None]) -> list[list[Action]]:
    """Each maximal run of consecutive SEND/RECV actions (one posted batch)."""
    out: list[list[Action]] = []
    group: list[Action] = []
    for action in actions:
        if action is not None and action.kind.is_comm:
            group.append(action)
        elif group:
            out.append(group)
            group = []
    if group:
        out.append(group)
    return out


def _numbering(schedule: Schedule) -> tuple[dict[Message, int], dict[Message, int]]:
    """Per message: its number among its sender's messages to that peer (in the sender's order),
    and the number of the first message back that its receiver posts after its RECV."""
    rank_of = schedule.stage_to_rank
    number: dict[Message, int] = {}
    answer: dict[Message, int] = {}
    for actions in schedule.actions.values():
        sent: dict[int, int] = {}  # peer -> messages sent to it so far
        for group in _groups(actions):
            for action in group:
                if action.kind is _K.SEND_F or action.kind is _K.SEND_B:
                    peer = rank_of[action.stage + 1 if action.kind is _K.SEND_F else action.stage - 1]
                    number[_message(action)] = sent.get(peer, 0)
                    sent[peer] = sent.get(peer, 0) + 1
            for action in group:
                if action.kind is _K.RECV_F or action.kind is _K.RECV_B:
                    message = _message(action)
                    answer[message] = sent.get(rank_of[message[1]], 0)
    return number, answer


def confirmed_sends(schedule: Schedule) -> dict[int, dict[Action, list[Action]]]:
    """Per rank: each compute action (top-level, as listed) -> this rank's SEND actions that are
    surely delivered once that action's received inputs arrived. Lowered schedules only."""
    rank_of = schedule.stage_to_rank
    number, answer = _numbering(schedule)
    out: dict[int, dict[Action, list[Action]]] = {}
    for rank, actions in schedule.actions.items():
        waiting: dict[int, list[tuple[int, int, Action]]] = {}  # peer -> heap of (answer needed, order, SEND)
        mine: dict[Action, list[Action]] = {}
        for k, action in enumerate(actions):
            if action is None:
                continue
            if action.kind is _K.SEND_F or action.kind is _K.SEND_B:
                sent = _message(action)
                peer = rank_of[action.stage + 1 if action.kind is _K.SEND_F else action.stage - 1]
                if sent in answer:
                    heapq.heappush(waiting.setdefault(peer, []), (answer[sent], k, action))
                continue
            if not action.kind.is_compute:
                continue
            for part in action.parts:  # the messages this compute takes, each from its sender
                if part.kind is _K.F and part.stage > 0:
                    message: Message = (True, part.stage - 1, part.microbatch or 0)
                elif (part.kind is _K.I or part.kind is _K.B) and part.stage < schedule.num_stages - 1:
                    message = (False, part.stage + 1, part.microbatch or 0)
                else:
                    continue
                peer, got = rank_of[message[1]], number.get(message)
                heap = waiting.get(peer)
                while got is not None and heap and heap[0][0] <= got:
                    mine.setdefault(action, []).append(heapq.heappop(heap)[2])
        out[rank] = mine
    return out
