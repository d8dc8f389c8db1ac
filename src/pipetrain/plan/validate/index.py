"""What one scan of the rank programs learns (:class:`Index`), and the wording every check shares.

The scan (:mod:`.structure`) fills an :class:`Index`; the later checks (communication, FSDP and
gradients, abstract execution) read only it, never the schedule's actions again.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from pipetrain.plan._graph import I
from pipetrain.plan.actions import Action
from pipetrain.plan.dependencies import Ids
from pipetrain.plan.schedule import Schedule

COMPLETENESS = "every (stage, microbatch) needs one F and either one B or one I and one W"
X_B, X_I = 1, 2  # x_kind codes (0: no B or I seen yet)


def where(rank: int, step: int, action: object) -> str:
    return f"rank {rank}, step {step}, action {action}"


@dataclass
class Index:
    """What one scan of the rank programs learns; the later checks read only this."""

    schedule: Schedule
    ids: Ids
    rank_of: list[int]
    node_step: list[int]  # step of each compute node on its rank, -1 when absent
    x_kind: bytearray  # per (s, m): whether X is a B or an I
    has_backward: bool = False
    # SEND/RECV in scan order as three parallel lists (no tuple per op: there are many).
    comm_rank: list[int] = field(default_factory=list)
    comm_step: list[int] = field(default_factory=list)
    comm_action: list[Action] = field(default_factory=list)
    reduce: list[tuple[int, int, Action]] = field(default_factory=list)
    lowered_actions: int = 0  # SEND/RECV, UNSHARD/RESHARD and REDUCE_GRAD seen
    # Each rank's program as the abstract execution runs it: a compute part's node, 3SM + j for
    # the j-th OVERLAP_F_B (in ``overlaps``), -(k + 1) for the k-th SEND/RECV; FSDP actions and
    # REDUCE_GRAD, which wait for nothing, are left out.
    programs: list[list[int]] = field(default_factory=list)
    overlaps: list[Action] = field(default_factory=list)


def node_name(index: Index, node: int) -> str:
    """A compute node as its action's text (an X node as the B or I the schedule holds)."""
    ids = index.ids
    action = ids.node_action(node)
    if ids.SM <= node < 2 * ids.SM and index.x_kind[node - ids.SM] == X_I:
        action = Action(action.stage, I, action.microbatch)
    return str(action)
