"""Communication: a lowered schedule's SEND/RECV, matched per rank pair and grouped per rank.

Each message is sent once after its producer and received once before its user, every product
that crosses ranks is carried, and the k-th SEND from rank a to rank b carries what the k-th RECV
on b from a expects (FIFO order). The groups built here are what the abstract execution posts.
"""

# ruff: noqa: N806 - S, M, SM, R: stages, microbatches, their product, ranks (the papers' notation)

from __future__ import annotations

from typing import NoReturn

from pipetrain.plan._graph import RECV_B, RECV_F, SEND_B, SEND_F
from pipetrain.plan.actions import Action
from pipetrain.plan.dependencies import C_F, C_I, RECEIVED, Dependencies
from pipetrain.plan.errors import ScheduleError
from pipetrain.plan.validate.index import Index, node_name, where


class CommPlan:
    """SEND/RECV of a lowered schedule: matched per rank pair (FIFO) and grouped per rank.

    ``group`` g on a rank is a maximal run of consecutive SEND/RECV actions (an idle step ends a
    run). Ops are numbered in scan order; ``peer[op]`` is the matching op on the other rank and
    ``token[op]`` the message a RECV delivers (-1 for a SEND).
    """

    def __init__(self, index: Index) -> None:
        ids, rank_of, node_step = index.ids, index.rank_of, index.node_step
        S, M, SM = ids.S, ids.M, ids.SM
        R = index.schedule.num_ranks
        n = len(index.comm_rank)
        self.op_rank = index.comm_rank
        self.op_step = index.comm_step
        self.op_action: list[Action] = index.comm_action
        self.op_msg = [0] * n
        self.token = [-1] * n
        self.peer = [-1] * n
        self.op_group = [0] * n
        self.group_ops: list[list[int]] = []
        self.group_rank: list[int] = []
        self.group_start: list[int] = []
        self.rank_groups: list[list[int]] = [[] for _ in range(R)]
        send_op = [-1] * (2 * SM)
        recv_op = [-1] * (2 * SM)
        sends: dict[int, list[int]] = {}
        recvs: dict[int, list[int]] = {}
        op_msg, token, op_group = self.op_msg, self.token, self.op_group
        group_ops, group_rank, group_start, rank_groups = (
            self.group_ops,
            self.group_rank,
            self.group_start,
            self.rank_groups,
        )
        gid = -1
        has_backward = index.has_backward
        msg_base = RECEIVED * SM
        self.deps = deps = Dependencies(S, M, rank_of, lowered=True)
        routes = deps.routes
        last_rank, last_step = -1, -2
        current: list[int] = []
        for op, (rank, step, action) in enumerate(zip(self.op_rank, self.op_step, self.op_action, strict=True)):
            # msg: the producer's F or X node id, which is also the message id.
            kind = action.kind
            msg, src, dst = routes[kind][action.stage]
            msg += action.microbatch  # type: ignore[operator]
            is_send = kind is SEND_F or kind is SEND_B
            if dst < 0 or src < 0 or (msg >= SM and not has_backward):  # (the core's routes stay in range)
                _endpoint_error(index, rank, step, action)
            if rank_of[src] == rank_of[dst]:
                raise ScheduleError(
                    f"{where(rank, step, action)}: stages {src} and {dst} both live on rank {rank}; stages on the "
                    "same rank pass tensors in memory, with no SEND/RECV between them"
                )
            if is_send:
                if send_op[msg] >= 0 or not 0 <= node_step[msg] < step:
                    _order_error(index, rank, step, action, send_op[msg], msg, self.op_step)
                send_op[msg] = op
                sends.setdefault(rank * R + rank_of[dst], []).append(op)
            else:
                user = msg + (dst - src) * M  # the same product's node on the receiving stage
                if recv_op[msg] >= 0 or node_step[user] < step:
                    _order_error(index, rank, step, action, recv_op[msg], user, self.op_step)
                recv_op[msg] = op
                recvs.setdefault(rank_of[src] * R + rank, []).append(op)
                token[op] = msg_base + msg
            op_msg[op] = msg
            if rank != last_rank or step != last_step + 1:
                gid += 1
                current = []
                group_ops.append(current)
                group_rank.append(rank)
                group_start.append(step)
                rank_groups[rank].append(gid)
            current.append(op)
            op_group[op] = gid
            last_rank, last_step = rank, step
        self._check_carried(index, send_op, recv_op)
        self._match_fifo(index, sends, recvs)

    def _check_carried(self, index: Index, send_op: list[int], recv_op: list[int]) -> None:
        """Every dependency between stages on different ranks has one SEND and one RECV."""
        ids, rank_of, node_step = index.ids, index.rank_of, index.node_step
        S, M, SM = ids.S, ids.M, ids.SM
        deps = self.deps
        leaves = deps.sends
        for s in range(S):
            for grad, cross in ((0, leaves[C_F][s]), (1, leaves[C_I][s])):
                if not cross or (grad and not index.has_backward):
                    continue
                lo = grad * SM + s * M
                if min(send_op[lo : lo + M]) >= 0 and min(recv_op[lo : lo + M]) >= 0:
                    continue
                for msg in range(lo, lo + M):
                    send, recv = deps.message_actions(msg)
                    if send_op[msg] < 0:
                        raise ScheduleError(
                            f"{where(rank_of[s], node_step[msg], node_name(index, msg))}: its output goes to stage "
                            f"{recv.stage} on rank {rank_of[recv.stage]}, but no {send} follows it"
                        )
                    if recv_op[msg] < 0:
                        user = deps.consumer(msg)
                        raise ScheduleError(
                            f"{where(rank_of[recv.stage], node_step[user], node_name(index, user))}: needs "
                            f"{producer_name(deps, send)} from rank {rank_of[s]}, but no {recv} comes before it (the {send} at "
                            f"step {self.op_step[send_op[msg]]} on rank {rank_of[s]} has no matching RECV)"
                        )

    def _match_fifo(self, index: Index, sends: dict[int, list[int]], recvs: dict[int, list[int]]) -> None:
        """The k-th SEND from a to b must carry what the k-th RECV on b from a expects."""
        R = index.schedule.num_ranks
        op_msg, peer = self.op_msg, self.peer
        for pair, send_list in sends.items():
            recv_list = recvs.get(pair, [])
            if [op_msg[o] for o in send_list] != [op_msg[o] for o in recv_list]:
                a_rank, b_rank = divmod(pair, R)
                for k, (s_op, r_op) in enumerate(zip(send_list, recv_list, strict=False)):
                    if op_msg[s_op] != op_msg[r_op]:
                        raise ScheduleError(
                            f"{where(b_rank, self.op_step[r_op], self.op_action[r_op])}: FIFO order mismatch: message "
                            f"{k + 1} from rank {a_rank} to rank {b_rank} is {self.op_action[s_op]} (rank {a_rank}, "
                            f"step {self.op_step[s_op]}), but this RECV expects {producer_name(self.deps, self.op_action[r_op])}; "
                            "sends and receives between two ranks must be posted in the same order"
                        )
                raise AssertionError("unreachable: every message has one SEND and one RECV")  # pragma: no cover
            for s_op, r_op in zip(send_list, recv_list, strict=True):
                peer[s_op] = r_op
                peer[r_op] = s_op


def _endpoint_error(index: Index, rank: int, step: int, action: Action) -> NoReturn:
    kind, s = action.kind, action.stage
    here = where(rank, step, action)
    if not index.has_backward and kind in (SEND_B, RECV_B):
        raise ScheduleError(f"{here}: a forward-only schedule sends no gradients")
    end = "last" if kind in (SEND_F, RECV_B) else "first"
    what = "forward" if kind in (SEND_F, RECV_F) else "gradient"
    raise ScheduleError(f"{here}: stage {s} is the {end} stage; there is no {what} message to carry")


def _order_error(
    index: Index, rank: int, step: int, action: Action, earlier_op: int, node: int, op_step: list[int]
) -> NoReturn:
    here = where(rank, step, action)
    if earlier_op >= 0:
        raise ScheduleError(f"{here}: duplicate {action}, already at step {op_step[earlier_op]}")
    node_step = index.node_step[node]
    if action.kind in (SEND_F, SEND_B):
        raise ScheduleError(
            f"{here}: sends the output of {node_name(index, node)} (step {node_step}), which has not run yet; "
            "a SEND must follow the action that produces its message"
        )
    raise ScheduleError(
        f"{here}: receives for {node_name(index, node)}, which already ran at step {node_step}; "
        "a RECV must come before the action that consumes it"
    )


def producer_name(deps: Dependencies, action: Action) -> str:
    """For a SEND or RECV, the message it carries in words."""
    node, src, _ = deps.route(action)
    if node < deps.SM:
        return f"the output of {src}F{action.microbatch}"
    return f"the input-gradient of stage {src} microbatch {action.microbatch}"
