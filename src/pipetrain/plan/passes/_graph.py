"""Integer ids for the dependency graph of a schedule, shared by validation and the passes.

Every compute part is a node: ``F(s, m)``, ``X(s, m)`` (the part producing the input-gradient:
B or I) and ``W(s, m)``. A message between stages is ``msg``: the forward output of ``(s, m)``
sent to ``s + 1``, or the input-gradient of ``(s, m)`` sent to ``s - 1``. Plain integers keep the
checks linear and fast on schedules with hundreds of thousands of actions.
"""

from __future__ import annotations

import gc
from collections.abc import Iterator
from contextlib import contextmanager

from pipetrain.plan.actions import Action, ActionKind

F = ActionKind.F
B = ActionKind.B
I = ActionKind.I  # noqa: E741 - the token torch and the papers use
W = ActionKind.W
SEND_F = ActionKind.SEND_F
RECV_F = ActionKind.RECV_F
SEND_B = ActionKind.SEND_B
RECV_B = ActionKind.RECV_B
UNSHARD = ActionKind.UNSHARD
RESHARD = ActionKind.RESHARD
REDUCE_GRAD = ActionKind.REDUCE_GRAD
OVERLAP = ActionKind.OVERLAP_F_B


class Ids:
    """Node and message numbering for ``num_stages`` × ``num_microbatches``.

    Nodes: ``F`` at ``s*M + m``, ``X`` at ``SM + s*M + m``, ``W`` at ``2SM + s*M + m``.
    Messages: forward output of ``(s, m)`` at ``s*M + m``, input-gradient at ``SM + s*M + m``.
    """

    __slots__ = ("M", "S", "SM")

    def __init__(self, num_stages: int, num_microbatches: int) -> None:
        self.S = num_stages
        self.M = num_microbatches
        self.SM = num_stages * num_microbatches

    def node_action(self, node: int) -> Action:
        """The compute action a node stands for (X is written as B; callers refine it)."""
        group, rest = divmod(node, self.SM)
        stage, mb = divmod(rest, self.M)
        return Action(stage, (F, B, W)[group], mb)

    def message_actions(self, msg: int) -> tuple[Action, Action]:
        """The (SEND, RECV) pair carrying message ``msg``."""
        grad, rest = divmod(msg, self.SM)
        stage, mb = divmod(rest, self.M)
        if grad:
            return Action(stage, SEND_B, mb), Action(stage - 1, RECV_B, mb)
        return Action(stage, SEND_F, mb), Action(stage + 1, RECV_F, mb)


def cross_rank_flags(rank_of: list[int]) -> tuple[list[bool], list[bool]]:
    """For each stage: is the previous / next stage on another rank (a message, not memory)?"""
    n = len(rank_of)
    prev = [s > 0 and rank_of[s - 1] != rank_of[s] for s in range(n)]
    nxt = [s < n - 1 and rank_of[s + 1] != rank_of[s] for s in range(n)]
    return prev, nxt


@contextmanager
def gc_paused() -> Iterator[None]:
    """Pause the cyclic garbage collector while building large acyclic structures.

    Validation and lowering allocate hundreds of thousands of small objects and no cycles; with
    the collector running, its full passes over every live object make the work superlinear.
    """
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was_enabled:
            gc.enable()
