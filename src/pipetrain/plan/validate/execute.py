"""Abstract execution: run every rank's program and name each rank that never finishes.

An action runs once what it needs has run (on a lowered schedule: once its RECV has completed
under the backend's matching model); ranks left waiting are reported with what they wait for and,
for communication, why the operation they wait on never completes.
"""

# ruff: noqa: N806 - M, SM, R: microbatches, stages × microbatches, ranks (the papers' notation)

from __future__ import annotations

from collections.abc import Callable

from pipetrain.plan._graph import REDUCE_GRAD, RESHARD, UNSHARD
from pipetrain.plan.actions import Action
from pipetrain.plan.dependencies import C_F, C_I, C_W, RECEIVED, SENT, Dependencies
from pipetrain.plan.errors import ScheduleError
from pipetrain.plan.execution import Walk
from pipetrain.plan.validate.communication import CommPlan
from pipetrain.plan.validate.index import Index, node_name, where


def execute(index: Index, comm: CommPlan | None, strict: bool = True) -> None:
    """Run every rank's program abstractly; raise naming each stuck rank if some never finish.

    Tokens are the dependency core's keys: compute products (done when the part ran) and, on
    lowered schedules, messages (done as received when the RECV carrying it completed). What an
    action waits for is the core's rule; the programs are the scan's integer encoding of them.
    ``strict``: a rank's communication groups run one after another (NCCL); otherwise every
    posted operation progresses on its own (gloo).
    """
    schedule = index.schedule
    ids, rank_of = index.ids, index.rank_of
    M, SM = ids.M, ids.SM
    R = schedule.num_ranks
    lowered = comm is not None
    deps = Dependencies(ids.S, M, rank_of, lowered=lowered)
    sent_base = SENT * SM
    need1, need2 = _node_needs(deps)
    n_nodes = 3 * SM
    done = bytearray(deps.num_keys)
    blocked = [-1] * R

    # Communication state (lowered schedules only).
    issued = [0] * R
    head = [0] * R
    if comm is not None:
        group_ops, group_rank, rank_groups = comm.group_ops, comm.group_rank, comm.rank_groups
        op_group, peer, token = comm.op_group, comm.peer, comm.token
        remaining = [len(g) for g in group_ops]
        started = bytearray(len(group_ops))
    else:
        group_ops, group_rank, rank_groups, op_group, peer, token = [], [], [], [], [], []
        remaining, started = [], bytearray()

    def start_groups(rank: int) -> None:
        """Start this rank's issued groups in order (strict: while the one before has ended)."""
        groups = rank_groups[rank]
        h = head[rank]
        while h < issued[rank]:
            g = groups[h]
            if not started[g]:
                started[g] = 1
                for op in group_ops[g]:
                    other = peer[op]
                    og = op_group[other]
                    if started[og]:
                        # Both ends posted: the pair completes; the RECV delivers its message.
                        remaining[g] -= 1
                        remaining[og] -= 1
                        t = token[op] if token[op] >= 0 else token[other]
                        done[t] = 1
                        if waiting:
                            woken = waiting.pop(t, None)
                            if woken:
                                queue.extend(woken)
                        if not remaining[og]:
                            queue.append(group_rank[og])
            if remaining[g] and strict:
                break
            h += 1
        head[rank] = h

    def same_rank_later(rank: int, step: int, action: Action, need: int) -> ScheduleError:
        return ScheduleError(
            f"{where(rank, step, action)}: needs {node_name(index, need)}, which rank {rank} runs later "
            f"(step {index.node_step[need]}); a dependency on the same rank must come first"
        )

    walk = Walk(index.programs, schedule.actions, _runs)
    programs, pc, waiting, queue = walk.programs, walk.pc, walk.waiting, walk.queue
    overlaps = index.overlaps
    for r in walk.ranks():
        if head[r] < issued[r]:  # start the groups it posted that could not start before
            start_groups(r)
        program = programs[r]
        n = len(program)
        i = pc[r]
        while i < n:
            x = program[i]
            if 0 <= x < n_nodes:  # a compute part: runs once its (at most two) inputs are there
                t = need1[x]
                if t < 0 or done[t]:
                    t = need2[x]
                    if t < 0 or done[t]:
                        done[x] = 1
                        if waiting:
                            woken = waiting.pop(x, None)
                            if woken:
                                queue.extend(woken)
                        i += 1
                        continue
            elif x >= n_nodes:
                step = walk.step(r, i)
                t, ran = _run_overlap(index, deps, overlaps[x - n_nodes], r, step, done, same_rank_later)
                if t < 0:
                    for node in ran:
                        woken = waiting.pop(node, None)
                        if woken:
                            queue.extend(woken)
                    i += 1
                    continue
            else:  # SEND/RECV: post the group it starts
                assert comm is not None
                g = comm.op_group[-x - 1]
                issued[r] += 1
                i += len(group_ops[g])
                start_groups(r)
                continue
            if t < sent_base and rank_of[(t % SM) // M] == r:
                step = walk.step(r, i)
                raise same_rank_later(r, step, schedule.actions[r][step], t)  # type: ignore[arg-type]
            if blocked[r] != t:
                blocked[r] = t
                waiting.setdefault(t, []).append(r)
            break
        pc[r] = i

    stuck = [r for r in range(R) if pc[r] < len(programs[r]) or head[r] < len(rank_groups[r] if lowered else ())]
    if stuck:
        at = [walk.step(r, pc[r]) for r in range(R)]  # where each rank stands, as schedule steps
        reasons = [_stuck_reason(index, comm, r, at, blocked[r], head, started) for r in stuck]
        here, why = reasons[0]
        others = "".join(f"; also {w}: {y}" for w, y in reasons[1:8])
        more = f"; and {len(reasons) - 8} more stuck ranks" if len(reasons) > 8 else ""
        raise ScheduleError(f"{here}: deadlock: {why}{others}{more}")


def _runs(action: Action) -> bool:
    """Whether the abstract execution runs ``action`` (FSDP actions and REDUCE_GRAD wait for nothing)."""
    return action.kind is not UNSHARD and action.kind is not RESHARD and action.kind is not REDUCE_GRAD


def _node_needs(deps: Dependencies) -> tuple[list[int], list[int]]:
    """Per compute node (F, X, W), the keys it waits for: the core's rules (its flat tables), a
    product from another rank waited for, in a lowered schedule, as its message received (the RECV
    completing implies the SEND was posted)."""
    plain = Dependencies(deps.S, deps.M, deps.rank_of, lowered=False)
    # X is B's or I's product: the same needs.
    return plain.flat_needs((C_F, C_I, C_W), cross_offset=RECEIVED * deps.SM if deps.lowered else 0)


def _run_overlap(
    index: Index,
    deps: Dependencies,
    action: Action,
    rank: int,
    step: int,
    done: bytearray,
    later: Callable[[int, int, Action, int], ScheduleError],
) -> tuple[int, list[int]]:
    """Run an OVERLAP_F_B if every part's inputs are there (earlier parts count: the parts run in
    order): (-1, the keys it made); else (the key it waits on, [])."""
    M, SM = index.ids.M, index.ids.SM
    own = [deps.part_makes(part)[0] for part in action.parts]
    received = RECEIVED * SM  # (a message is waited for as received: see execute)
    pending = []
    for k, part in enumerate(action.parts):
        for t in deps.part_needs(part):
            if SENT * SM <= t < received or done[t] or t in own[:k]:
                continue
            if t in own:  # made by this part or a later one: it can never be there in time
                maker = action.parts[own.index(t)]
                raise ScheduleError(
                    f"{where(rank, step, action)}: its part {part} needs {node_name(index, t)}, which its later part "
                    f"{maker} makes; an OVERLAP_F_B's parts run in order, so put {maker} first"
                )
            pending.append(t)
    for t in pending:
        if t < SENT * SM and index.rank_of[(t % SM) // M] == rank:
            raise later(rank, step, action, t)
    if pending:
        return pending[0], []
    for node in own:
        done[node] = 1
    return -1, own


def _stuck_reason(
    index: Index, comm: CommPlan | None, rank: int, pc: list[int], token: int, head: list[int], started: bytearray
) -> tuple[str, str]:
    """Where ``rank`` is stuck and why, in words."""
    program = index.schedule.actions[rank]
    SM = index.ids.SM
    if pc[rank] < len(program):
        here = where(rank, pc[rank], program[pc[rank]])
        if token < SENT * SM:
            who = index.rank_of[(token % SM) // index.ids.M]
            return (
                here,
                f"waits for {node_name(index, token)} (rank {who}, step {index.node_step[token]}), which never runs",
            )
        assert comm is not None
        msg = token - (SENT if token < RECEIVED * SM else RECEIVED) * SM
        op = next(o for o in range(len(comm.op_msg)) if comm.op_msg[o] == msg and comm.token[o] >= 0)
        why = _op_reason(index, comm, op, pc, head, started)
        return here, f"waits for its {comm.op_action[op]} (step {comm.op_step[op]}), which {why}"
    assert comm is not None
    g = comm.rank_groups[rank][head[rank]]
    op = next(o for o in comm.group_ops[g] if not started[comm.op_group[comm.peer[o]]])
    why = _op_reason(index, comm, op, pc, head, started)
    return where(rank, comm.op_step[op], comm.op_action[op]), f"its communication group never ends: this op {why}"


def _op_reason(index: Index, comm: CommPlan, op: int, pc: list[int], head: list[int], started: bytearray) -> str:
    """Why communication op ``op`` never completes (its group or its peer's never starts)."""
    g = comm.op_group[op]
    if not started[g]:
        return f"never starts: {_group_blocker(index, comm, comm.group_rank[g], pc, head)}"
    other = comm.peer[op]
    o_rank, o_step = comm.op_rank[other], comm.op_step[other]
    return (
        f"never completes: the matching {comm.op_action[other]} (rank {o_rank}, step {o_step}) never starts, as "
        f"{_group_blocker(index, comm, o_rank, pc, head, o_step)}"
    )


def _group_blocker(index: Index, comm: CommPlan, rank: int, pc: list[int], head: list[int], step: int = -1) -> str:
    if step >= 0 and pc[rank] <= step:
        return f"rank {rank} never gets past step {pc[rank]}"
    blocker = comm.rank_groups[rank][head[rank]]
    first = comm.group_ops[blocker][0]
    return (
        f"rank {rank}'s earlier communication group at step {comm.group_start[blocker]} "
        f"({comm.op_action[first]}, ...) never ends (NCCL runs one group after another)"
    )
