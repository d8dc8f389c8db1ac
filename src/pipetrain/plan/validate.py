"""Validation: reject a schedule that cannot run, before anything runs.

The rules are those of ``docs/semantics.md``. Each failure raises :class:`ScheduleError` naming the
rank, the step, the action and the broken rule (``rank 1, step 5, action 1B3: ...``).

Whether the per-rank programs deadlock is decided by abstract execution: every rank runs its list
in order, an action runs once what it needs has run (on a lowered schedule: once its RECV has
completed under the NCCL group model), and ranks left waiting are reported with what they wait
for. All checks are linear in the number of actions.

A sound schedule, the common case, is accepted by a fast path (:func:`_accepts`: one scan that
also matches and groups the SEND/RECV, then one run, keeping nothing for messages; under the
strict model a lowered schedule whose messages sit where a unit-time run of its compute says they
can is proven by that run alone, :func:`_timed_proof`); whatever it cannot prove sound goes
through the full checks (:func:`_check`), which find the broken rule and word it. The fast path
only ever accepts, so verdicts and messages are the full checks'.
"""

# ruff: noqa: N803, N806 - S, M, SM, R: stages, microbatches, their product, ranks (the papers' notation)

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import NoReturn

from pipetrain.plan._graph import (
    OVERLAP,
    RECV_B,
    RECV_F,
    REDUCE_GRAD,
    RESHARD,
    SEND_B,
    SEND_F,
    UNSHARD,
    B,
    F,
    I,
    W,
    gc_paused,
)
from pipetrain.plan.actions import Action
from pipetrain.plan.dependencies import (
    C_F,
    C_I,
    C_W,
    NUM_KEY_BLOCKS,
    RECEIVED,
    SENT,
    W_DONE,
    X_DONE,
    Dependencies,
    Ids,
)
from pipetrain.plan.errors import ScheduleError
from pipetrain.plan.execution import Walk
from pipetrain.plan.schedule import Schedule, first_naming

__all__ = ["validate"]

MATCHING = ("nccl", "gloo")

_COMPLETENESS = "every (stage, microbatch) needs one F and either one B or one I and one W"
_X_B, _X_I = 1, 2  # x_kind codes (0: no B or I seen yet)


def _where(rank: int, step: int, action: object) -> str:
    return f"rank {rank}, step {step}, action {action}"


@dataclass
class _Index:
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


def validate(schedule: Schedule, *, matching: str = "nccl") -> None:
    """Raise :class:`ScheduleError` if ``schedule`` breaks a rule of docs/semantics.md.

    ``matching`` is the backend's model for a lowered schedule's SEND/RECV (docs/semantics.md,
    "Matching"): ``"nccl"`` (the default and the strict one) pairs a rank pair's operations in
    posting order and runs a rank's groups one after another; ``"gloo"`` pairs them per peer in
    order too, but each operation progresses on its own, which is what early receives need.
    """
    if matching not in MATCHING:
        raise ScheduleError(f"matching must be one of {', '.join(map(repr, MATCHING))}, not {matching!r}")
    with gc_paused():
        _validate(schedule, strict=matching == "nccl")


def check_structure(schedule: Schedule) -> int:
    """The checks of :func:`validate` short of executing the programs (for ``lower``, whose
    unit-time run of a compute schedule decides whether it runs to the end).

    Returns how many actions are not compute (SEND/RECV, UNSHARD/RESHARD, REDUCE_GRAD): ``lower``
    refuses a schedule that has any, and learns it from this scan instead of its own.
    """
    with gc_paused():
        return _structure(schedule).lowered_actions


def _structure(schedule: Schedule) -> _Index:
    if schedule.num_microbatches < 1:
        raise ScheduleError("the schedule has no compute actions: it needs at least one microbatch")
    index = _scan(schedule)
    _check_completeness(index)
    return index


def _validate(schedule: Schedule, *, strict: bool = True) -> None:
    if not _accepts(schedule, strict):
        _check(schedule, strict)


def _check(schedule: Schedule, strict: bool) -> None:
    """The full checks, which find what is wrong and word it (every rule, in a fixed order)."""
    index = _structure(schedule)
    comm = _CommPlan(index) if index.comm_rank else None
    if index.reduce:
        _check_reduce_grad(index)
    _execute(index, comm, strict)


# ------------------------------------------------------------------ fast acceptance
def _accepts(schedule: Schedule, strict: bool) -> bool:
    """True only if ``schedule`` passes every check below: one scan and one abstract execution.

    The common case, a sound schedule, pays for one pass over its actions (the SEND/RECV matched
    and grouped on the way) and one run, with no positions, steps or names kept for messages.
    False means "not proven here", never "invalid": the full checks then decide and word the
    error, so verdicts and messages are theirs. Hence every rule is checked here at least as
    strictly as there (anything unusual, e.g. OVERLAP_F_B, simply answers False).
    """
    try:
        return _fast_run(schedule, strict)
    except (AttributeError, IndexError, TypeError, ValueError):  # malformed actions: the full checks say which
        return False


def _fast_run(schedule: Schedule, strict: bool) -> bool:
    S, M = schedule.num_stages, schedule.num_microbatches
    if M < 1:
        return False
    SM = S * M
    R = schedule.num_ranks
    rank_of = [schedule.stage_to_rank.get(s, -1) for s in range(S)]
    deps = Dependencies(S, M, rank_of, lowered=False)  # (routes and sends do not depend on lowering)
    # SEND/RECV ops are numbered 2 * message (+ 1 for the RECV): an op's peer is op ^ 1. Per
    # SEND/RECV kind and stage: (twice the message base, the (sender, receiver) FIFO list, and for
    # a RECV the offset from the message to its user's node); no list where no message crosses.
    pairs: dict[int, tuple[list[int], list[int]]] = {}  # per (sender, receiver): messages sent, received
    routes = []
    for kind in (SEND_F, SEND_B, RECV_F, RECV_B):
        row: list[tuple[int, list[int] | None, int]] = []
        for base, src, dst in deps.routes[kind]:
            a, b = (rank_of[src], rank_of[dst]) if src >= 0 and dst >= 0 else (-1, -1)
            ends = None if a < 0 or b < 0 or a == b else pairs.setdefault(a * R + b, ([], []))
            row.append((2 * base, None if ends is None else ends[kind is RECV_F or kind is RECV_B], (dst - src) * M))
        routes.append(row)
    send_f, send_b, recv_f, recv_b = routes
    # A W whose one need is its own I (scanned before it on this rank, which the scan checks) and
    # whose product nothing waits for cannot block: it stays out of the run (a third of the parts).
    w_waits = any(deps.need_keys[C_W][s] != (X_DONE * SM + s * M,) for s in range(S)) or any(
        W_DONE * SM <= key < (W_DONE + 1) * SM for rows in deps.need_keys for keys in rows for key in keys
    )
    # A lowered schedule (more actions than compute parts) checked under the strict model may be
    # proven by its unit-time run (see _timed_proof), whose times count the W like any part.
    keep_w = w_waits or (strict and sum(map(len, schedule.actions.values())) > 3 * SM)
    node_step = [-1] * (3 * SM)
    x_kind = bytearray(SM)
    shard = bytearray(S)  # 0 before any UNSHARD, 1 unsharded, 2 resharded
    first_unshard = [-1] * S
    reduce: list[tuple[int, int]] = []
    # Per op, its group (-1: not in the schedule); per group, its ops (gops[g_first[g]:
    # g_first[g + 1]]) and its rank.
    op_group = [-1] * (4 * SM)
    gops: list[int] = []
    g_first: list[int] = []
    g_rank: list[int] = []
    programs: list[list[int]] = []  # compute nodes, and -(g + 1) for communication group g
    g = -1
    for rank in range(R):
        program: list[int] = []
        programs.append(program)
        append = program.append
        last = -2  # step of the rank's last SEND/RECV
        for step, action in enumerate(schedule.actions[rank]):
            if action is None:
                continue
            if type(action) is not Action:
                return False
            s, kind, m, _ = action
            if kind is F or kind is I or kind is W or kind is B:
                if s >= S or rank_of[s] != rank or m >= M or shard[s] == 2:  # type: ignore[operator]  # (None: TypeError, caught)
                    return False
                sm = s * M + m  # type: ignore[operator]
                if kind is F:
                    if node_step[sm] >= 0:
                        return False
                    node_step[sm] = step
                    append(sm)
                elif kind is W:
                    node = 2 * SM + sm
                    if node_step[node] >= 0 or x_kind[sm] != _X_I:  # (so its I comes first on this rank)
                        return False
                    node_step[node] = step
                    if keep_w:
                        append(node)
                else:
                    if x_kind[sm]:
                        return False
                    x_kind[sm] = _X_I if kind is I else _X_B
                    node_step[SM + sm] = step
                    append(SM + sm)
            elif kind is SEND_F or kind is SEND_B or kind is RECV_F or kind is RECV_B:
                if s >= S or rank_of[s] != rank or m >= M:  # type: ignore[operator]
                    return False
                if step != last + 1:  # a new group
                    g += 1
                    g_first.append(len(gops))
                    g_rank.append(rank)
                    append(-g - 1)
                last = step
                if kind is SEND_F or kind is SEND_B:
                    base, fifo, _ = (send_f if kind is SEND_F else send_b)[s]
                    op = base + 2 * m  # type: ignore[operator]
                    if fifo is None or op_group[op] >= 0 or node_step[op >> 1] < 0:  # after its producer
                        return False
                else:
                    base, fifo, shift = (recv_f if kind is RECV_F else recv_b)[s]
                    op = base + 2 * m + 1  # type: ignore[operator]
                    if fifo is None or op_group[op] >= 0 or node_step[(op >> 1) + shift] >= 0:  # before its user
                        return False
                op_group[op] = g
                fifo.append(op >> 1)
                gops.append(op)
            elif kind is UNSHARD or kind is RESHARD or kind is REDUCE_GRAD:
                if s >= S or rank_of[s] != rank or m is not None:
                    return False
                if kind is UNSHARD:
                    if shard[s] == 1:
                        return False
                    shard[s] = 1
                    if first_unshard[s] < 0:
                        first_unshard[s] = step
                elif kind is RESHARD:
                    if shard[s] != 1:
                        return False
                    shard[s] = 2
                else:
                    reduce.append((s, step))
            else:  # OVERLAP_F_B, or an unknown kind
                return False
    g_first.append(len(gops))

    # Completeness: every F; with any backward, every X, and a W exactly where X is an I (a W
    # was accepted only after an I of its cell, so equal counts mean equal sets).
    has_backward = max(x_kind, default=0) > 0
    if min(node_step[:SM]) < 0:
        return False
    if has_backward and (min(node_step[SM : 2 * SM]) < 0 or SM - node_step[2 * SM :].count(-1) != x_kind.count(_X_I)):
        return False
    # No compute of a stage before its first UNSHARD.
    for s, first in enumerate(first_unshard):
        if first >= 0:
            for block in range(3):
                cells = node_step[block * SM + s * M : block * SM + s * M + M]
                if min((v for v in cells if v >= 0), default=first) < first:
                    return False
    # REDUCE_GRAD: one per stage, after the stage's last B or W (a W comes after its I).
    if reduce:
        if not has_backward or len({s for s, _ in reduce}) != len(reduce):
            return False
        for s, step in reduce:
            lo = s * M
            if max(node_step[SM + lo : SM + lo + M]) > step or max(node_step[2 * SM + lo : 2 * SM + lo + M]) > step:
                return False
    lowered = bool(gops)
    if lowered:
        # Gradients only with a backward; every crossing product sent and received; the k-th
        # SEND from a to b carries the k-th RECV's message (then each op's peer is its message's).
        if not has_backward and max(op_group[2 * SM :]) >= 0:
            return False
        for block, leaves in ((0, deps.sends[C_F]), (1, deps.sends[C_I])):
            if block and not has_backward:
                continue
            for s in range(S):
                if leaves[s]:
                    lo = 2 * (block * SM + s * M)
                    if min(op_group[lo : lo + 2 * M]) < 0:
                        return False
        if any(sent != got for sent, got in pairs.values()):
            return False
    if (
        lowered
        and strict
        and (keep_w or _X_I not in x_kind)  # (the proof's times count every W)
        and _timed_proof(programs, *deps.flat_needs((C_F, C_I, C_W)), gops, g_first, g_rank)
    ):
        return True
    received = RECEIVED * SM if lowered else 0
    need1, need2 = deps.flat_needs((C_F, C_I, C_W), cross_offset=received)  # (see _node_needs)
    return _fast_execute(programs, need1, need2, received, strict, gops, g_first, g_rank, op_group)


def _timed_proof(
    programs: list[list[int]],
    need1: list[int],
    need2: list[int],
    gops: list[int],
    g_first: list[int],
    g_rank: list[int],
) -> bool:
    """True if the SEND/RECV sit where a unit-time run of the compute proves no deadlock (strict model).

    Run the compute parts in unit time, a crossing input counting as there when its producer ends
    (``need1``/``need2``: unlowered rules), and give each message the time T its producer ends.
    If on every rank (i) the messages' times never decrease, (ii) those of equal time are in one
    group, and (iii) every compute part before a group started before each of its times, then by
    induction on T every group holding a time-T message starts once the messages before T have
    completed, so every message completes and every rank runs to its end. (The scan has checked
    the rest: each message sent once after its producer, received once before its user, FIFO
    order.) This is how ``lower`` places messages (:mod:`~pipetrain.plan.passes.communication`),
    so its output is proven here with one run of the compute and no run of the messages; False
    means "not proven" and the full run of the messages decides.
    """
    R = len(programs)
    end = [-1] * len(need1) + [0]  # end[-1]: a need of -1 (none) has always ended
    waiter = [-1] * len(end)
    bound = [0] * len(g_rank)  # per group, when the compute before it ends: its times must not be earlier
    pc = [0] * R
    free = [0] * R
    queue = list(range(R))
    while queue:
        r = queue.pop()
        program = programs[r]
        n = len(program)
        i = pc[r]
        t = free[r]
        while i < n:
            x = program[i]
            if x < 0:
                bound[-x - 1] = t
                i += 1
                continue
            k = need1[x]
            e = end[k]
            if e < 0:
                waiter[k] = r
                break
            if e > t:
                t = e
            k = need2[x]
            e = end[k]
            if e < 0:
                waiter[k] = r
                break
            if e > t:
                t = e
            t += 1
            end[x] = t
            if waiter[x] >= 0:
                queue.append(waiter[x])
            i += 1
        pc[r] = i
        free[r] = t
    if any(pc[r] != len(programs[r]) for r in range(R)):
        return False  # (a rank waits: the full run finds out why)
    last_rank, last_time, last_group = -1, -1, -1
    for g, r in enumerate(g_rank):
        if r != last_rank:
            last_rank, last_time = r, -1
        low = bound[g]
        for k in range(g_first[g], g_first[g + 1]):
            time = end[gops[k] >> 1]  # (an op's message is named by its producer's node)
            if time < low or time < last_time or (time == last_time and g != last_group):
                return False
            last_time, last_group = time, g
    return True


def _fast_execute(
    programs: list[list[int]],
    need1: list[int],
    need2: list[int],
    received: int,
    strict: bool,
    gops: list[int],
    g_first: list[int],
    g_rank: list[int],
    op_group: list[int],
) -> bool:
    """:func:`_execute`'s run on :func:`_fast_run`'s programs: True if every rank runs to its end.

    A RECV op completing makes key ``received + message``; ``need1`` and ``need2`` wait for that.
    """
    R = len(programs)
    # done[-1] is set: a need of -1 (none) is always there. At most one rank waits for a key in a
    # run that ends (a rank waiting for its own later product never ends), so waiter[key] is that
    # rank; an overwritten waiter stays stuck, which only sends the schedule to the full checks.
    num_keys = NUM_KEY_BLOCKS * len(need1) // 3
    done = bytearray(num_keys + 1)
    done[-1] = 1
    waiter = [-1] * (num_keys + 1)
    num_groups = len(g_rank)
    remaining = [g_first[g + 1] - g_first[g] for g in range(num_groups)]
    started = bytearray(num_groups)
    # A rank's groups are numbered in a row: head[r] is its next group to start (strict: the one
    # that must end before the next starts), issued[r] the one after the last it posted.
    head = [0] * R
    for g in range(num_groups - 1, -1, -1):
        head[g_rank[g]] = g
    issued = list(head)
    end_group = list(head)
    for g, r in enumerate(g_rank):
        end_group[r] = g + 1
    pc = [0] * R
    queue = list(range(R))

    def start(g: int) -> int:
        """Post group g: each op whose peer's group has started completes (its message is
        received); returns how many of g's ops remain."""
        started[g] = 1
        left = remaining[g]
        for k in range(g_first[g], g_first[g + 1]):
            op = gops[k]
            og = op_group[op ^ 1]
            if started[og]:
                left -= 1
                og_left = remaining[og] - 1
                remaining[og] = og_left
                t = received + (op >> 1)
                done[t] = 1
                if waiter[t] >= 0:
                    queue.append(waiter[t])
                if not og_left:
                    queue.append(g_rank[og])
        remaining[g] = left
        return left

    while queue:
        r = queue.pop()
        h = head[r]
        if h < issued[r]:  # strict: start the groups it posted while an earlier one ran
            while h < issued[r]:
                if (started[h] or start(h)) and remaining[h]:
                    break
                h += 1
            head[r] = h
        program = programs[r]
        n = len(program)
        i = pc[r]
        while i < n:
            x = program[i]
            if x >= 0:
                t = need1[x]
                if done[t]:
                    t = need2[x]
                    if done[t]:
                        done[x] = 1
                        if waiter[x] >= 0:
                            queue.append(waiter[x])
                        i += 1
                        continue
                waiter[t] = r
                break
            g = -x - 1
            i += 1
            issued[r] = g + 1
            if strict and head[r] != g:
                continue  # an earlier group has not ended: this one starts after it
            k = g_first[g]
            if g_first[g + 1] - k == 1:  # most groups hold one op: start() inline
                op = gops[k]
                og = op_group[op ^ 1]
                started[g] = 1
                if started[og]:
                    remaining[g] = 0
                    og_left = remaining[og] - 1
                    remaining[og] = og_left
                    t = received + (op >> 1)
                    done[t] = 1
                    if waiter[t] >= 0:
                        queue.append(waiter[t])
                    if not og_left:
                        queue.append(g_rank[og])
                    head[r] = g + 1
                elif not strict:
                    head[r] = g + 1
            elif not start(g) or not strict:
                head[r] = g + 1
        pc[r] = i
    return all(pc[r] == len(programs[r]) and head[r] == end_group[r] for r in range(R))


# --------------------------------------------------------------------------- structure
def _scan(schedule: Schedule) -> _Index:
    """Check placement, ranges, duplicates and FSDP state; record where every compute part runs."""
    ids = Ids(schedule.num_stages, schedule.num_microbatches)
    S, M, SM = ids.S, ids.M, ids.SM
    rank_of = [schedule.stage_to_rank.get(s, -1) for s in range(S)]
    index = _Index(schedule, ids, rank_of, [-1] * (3 * SM), bytearray(SM))
    node_step = index.node_step
    x_kind = index.x_kind
    # FSDP state per stage: 0 before any UNSHARD, 1 unsharded, 2 resharded.
    shard = bytearray(S)
    first_unshard = [-1] * S
    has_backward = False
    comm_rank, comm_step, comm_action = index.comm_rank, index.comm_step, index.comm_action

    def record(part: Action, rank: int, step: int, action: Action) -> int:
        """The slow path for one compute part (OVERLAP_F_B parts, and errors); its node."""
        nonlocal has_backward
        s, m, pk = part.stage, part.microbatch, part.kind
        if s >= S or rank_of[s] != rank or m is None or m >= M:
            _check_place(part, rank, step, rank_of, M, whole=action)
        assert m is not None
        sm = s * M + m
        if pk is F:
            node = sm
        elif pk is W:
            node = 2 * SM + sm
            has_backward = True
        else:
            node = SM + sm
            has_backward = True
            code = _X_B if pk is B else _X_I
            if x_kind[sm] and x_kind[sm] != code:
                other = "I" if code == _X_B else "B"
                raise ScheduleError(
                    f"{_where(rank, step, action)}: stage {s} microbatch {m} already has "
                    f"{s}{other}{m} at step {node_step[node]}; {_COMPLETENESS}, never B together with I"
                )
            x_kind[sm] = code
        if node_step[node] >= 0:
            raise ScheduleError(
                f"{_where(rank, step, action)}: duplicate {part}, already at step {node_step[node]}; {_COMPLETENESS}"
            )
        if shard[s] == 2:
            raise ScheduleError(
                f"{_where(rank, step, action)}: stage {s} is sharded here; an UNSHARD must precede its compute "
                "(and no RESHARD come between)"
            )
        node_step[node] = step
        return node

    n_nodes = 3 * SM
    overlaps = index.overlaps
    lowered_actions = 0
    for rank in range(schedule.num_ranks):
        program: list[int] = []
        index.programs.append(program)
        for step, action in enumerate(schedule.actions[rank]):
            if action is None:
                continue
            if type(action) is not Action:
                raise ScheduleError(f"rank {rank}, step {step}: expected an Action or None, got {action!r}")
            kind = action.kind
            if kind is F:
                # The common case, inline: a forward whose stage and microbatch are in range.
                s, m = action.stage, action.microbatch
                if s < S and rank_of[s] == rank and m < M and not shard[s] & 2:  # type: ignore[operator]
                    node = s * M + m  # type: ignore[operator]
                    if node_step[node] < 0:
                        node_step[node] = step
                        program.append(node)
                        continue
                program.append(record(action, rank, step, action))
            elif kind is W or kind is I:
                s, m = action.stage, action.microbatch
                if s < S and rank_of[s] == rank and m < M and not shard[s] & 2:  # type: ignore[operator]
                    sm = s * M + m  # type: ignore[operator]
                    node = 2 * SM + sm if kind is W else SM + sm
                    if node_step[node] < 0 and (kind is W or not x_kind[sm]):
                        node_step[node] = step
                        if kind is I:
                            x_kind[sm] = _X_I
                        has_backward = True
                        program.append(node)
                        continue
                program.append(record(action, rank, step, action))
            elif kind is B:
                program.append(record(action, rank, step, action))
            elif kind is OVERLAP:
                for part in action.parts:
                    record(part, rank, step, action)
                program.append(n_nodes + len(overlaps))
                overlaps.append(action)
            else:
                lowered_actions += 1
                s, m = action.stage, action.microbatch
                if s >= S or rank_of[s] != rank or (m is not None and m >= M):
                    _check_place(action, rank, step, rank_of, M)
                if kind is UNSHARD:
                    if shard[s] == 1:
                        raise ScheduleError(f"{_where(rank, step, action)}: stage {s} is already unsharded")
                    shard[s] = 1
                    if first_unshard[s] < 0:
                        first_unshard[s] = step
                elif kind is RESHARD:
                    if shard[s] != 1:
                        raise ScheduleError(
                            f"{_where(rank, step, action)}: stage {s} is not unsharded here; a RESHARD must follow "
                            "an UNSHARD of its stage"
                        )
                    shard[s] = 2
                elif kind is REDUCE_GRAD:
                    index.reduce.append((rank, step, action))
                else:
                    program.append(-len(comm_rank) - 1)
                    comm_rank.append(rank)
                    comm_step.append(step)
                    comm_action.append(action)
    index.has_backward = has_backward
    index.lowered_actions = lowered_actions
    _check_unshard_first(index, first_unshard)
    return index


def _check_unshard_first(index: _Index, first_unshard: list[int]) -> None:
    """A stage that has UNSHARD actions must not compute before its first one."""
    SM, M = index.ids.SM, index.ids.M
    node_step = index.node_step
    for s, first in enumerate(first_unshard):
        if first < 0:
            continue
        # Any node of the stage computed before ``first``? (A min over slices: one check per node.)
        if all(min(node_step[g * SM + s * M : g * SM + s * M + M]) >= first for g in range(3)):
            continue
        steps = [(node_step[g * SM + s * M + m], g * SM + s * M + m) for g in range(3) for m in range(M)]
        early = min(((st, node) for st, node in steps if st >= 0), default=(first, -1))
        if early[0] < first:
            raise ScheduleError(
                f"{_where(index.rank_of[s], early[0], _node_name(index, early[1]))}: stage {s} is sharded here; "
                "an UNSHARD must precede its compute (and no RESHARD come between)"
            )


def _check_place(
    action: Action, rank: int, step: int, rank_of: list[int], M: int, *, whole: Action | None = None
) -> None:
    """Raise if ``action`` names a stage not on ``rank`` or a microbatch out of range."""
    s = action.stage
    m = action.microbatch
    if s < len(rank_of) and rank_of[s] == rank and (m is None or m < M):
        return
    where = _where(rank, step, whole or action)
    if s >= len(rank_of) or rank_of[s] < 0:
        raise ScheduleError(f"{where}: stage {s} does not exist (the schedule has {len(rank_of)} stages)")
    if rank_of[s] != rank:
        raise ScheduleError(f"{where}: stage {s} lives on rank {rank_of[s]}; each stage lives on exactly one rank")
    if action.kind.needs_microbatch and (m is None or m >= M):
        raise ScheduleError(f"{where}: microbatch {m} is out of range (the schedule has {M} microbatches)")


def _check_completeness(index: _Index) -> None:
    ids, rank_of, node_step, x_kind = index.ids, index.rank_of, index.node_step, index.x_kind
    S, M, SM = ids.S, ids.M, ids.SM
    backward = index.has_backward
    for s in range(S):
        rank = rank_of[s]
        for m in range(M):
            sm = s * M + m
            f_step = node_step[sm]
            x_step = node_step[SM + sm]
            w_step = node_step[2 * SM + sm]
            if f_step < 0:
                for step, what in ((x_step, f"{s}{'I' if x_kind[sm] == _X_I else 'B'}{m}"), (w_step, f"{s}W{m}")):
                    if step >= 0:
                        raise ScheduleError(
                            f"rank {rank}, step {step}, action {what}: its forward {s}F{m} is missing; {_COMPLETENESS}"
                        )
                why = ""
                if m == M - 1:  # the count comes from the largest index: say which action set it
                    named = first_naming(index.schedule.actions, m)
                    why = f" (the schedule has {M} microbatches because {named} names microbatch {m})" if named else ""
                raise ScheduleError(
                    f"rank {rank}: stage {s} microbatch {m} has no forward {s}F{m}{why}; {_COMPLETENESS}"
                )
            if not backward:
                continue
            if x_step < 0:
                here = _where(rank, f_step, Action(s, F, m))
                if w_step >= 0:
                    raise ScheduleError(
                        f"{_where(rank, w_step, Action(s, W, m))}: needs {s}I{m}, which is missing; {_COMPLETENESS}"
                    )
                raise ScheduleError(f"{here}: has no backward ({s}B{m}, or {s}I{m} and {s}W{m}); {_COMPLETENESS}")
            if x_kind[sm] == _X_I and w_step < 0:
                raise ScheduleError(
                    f"{_where(rank, x_step, Action(s, I, m))}: has no matching {s}W{m}; {_COMPLETENESS}"
                )
            if x_kind[sm] == _X_B and w_step >= 0:
                raise ScheduleError(
                    f"{_where(rank, w_step, Action(s, W, m))}: stage {s} microbatch {m} already has a full backward "
                    f"{s}B{m} (step {x_step}); {_COMPLETENESS}, never B together with W"
                )


# ---------------------------------------------------------------- communication
class _CommPlan:
    """SEND/RECV of a lowered schedule: matched per rank pair (FIFO) and grouped per rank.

    ``group`` g on a rank is a maximal run of consecutive SEND/RECV actions (an idle step ends a
    run). Ops are numbered in scan order; ``peer[op]`` is the matching op on the other rank and
    ``token[op]`` the message a RECV delivers (-1 for a SEND).
    """

    def __init__(self, index: _Index) -> None:
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
                    f"{_where(rank, step, action)}: stages {src} and {dst} both live on rank {rank}; stages on the "
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

    def _check_carried(self, index: _Index, send_op: list[int], recv_op: list[int]) -> None:
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
                            f"{_where(rank_of[s], node_step[msg], _node_name(index, msg))}: its output goes to stage "
                            f"{recv.stage} on rank {rank_of[recv.stage]}, but no {send} follows it"
                        )
                    if recv_op[msg] < 0:
                        user = deps.consumer(msg)
                        raise ScheduleError(
                            f"{_where(rank_of[recv.stage], node_step[user], _node_name(index, user))}: needs "
                            f"{producer_name(deps, send)} from rank {rank_of[s]}, but no {recv} comes before it (the {send} at "
                            f"step {self.op_step[send_op[msg]]} on rank {rank_of[s]} has no matching RECV)"
                        )

    def _match_fifo(self, index: _Index, sends: dict[int, list[int]], recvs: dict[int, list[int]]) -> None:
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
                            f"{_where(b_rank, self.op_step[r_op], self.op_action[r_op])}: FIFO order mismatch: message "
                            f"{k + 1} from rank {a_rank} to rank {b_rank} is {self.op_action[s_op]} (rank {a_rank}, "
                            f"step {self.op_step[s_op]}), but this RECV expects {producer_name(self.deps, self.op_action[r_op])}; "
                            "sends and receives between two ranks must be posted in the same order"
                        )
                raise AssertionError("unreachable: every message has one SEND and one RECV")  # pragma: no cover
            for s_op, r_op in zip(send_list, recv_list, strict=True):
                peer[s_op] = r_op
                peer[r_op] = s_op


def _endpoint_error(index: _Index, rank: int, step: int, action: Action) -> NoReturn:
    kind, s = action.kind, action.stage
    where = _where(rank, step, action)
    if not index.has_backward and kind in (SEND_B, RECV_B):
        raise ScheduleError(f"{where}: a forward-only schedule sends no gradients")
    end = "last" if kind in (SEND_F, RECV_B) else "first"
    what = "forward" if kind in (SEND_F, RECV_F) else "gradient"
    raise ScheduleError(f"{where}: stage {s} is the {end} stage; there is no {what} message to carry")


def _order_error(
    index: _Index, rank: int, step: int, action: Action, earlier_op: int, node: int, op_step: list[int]
) -> NoReturn:
    where = _where(rank, step, action)
    if earlier_op >= 0:
        raise ScheduleError(f"{where}: duplicate {action}, already at step {op_step[earlier_op]}")
    node_step = index.node_step[node]
    if action.kind in (SEND_F, SEND_B):
        raise ScheduleError(
            f"{where}: sends the output of {_node_name(index, node)} (step {node_step}), which has not run yet; "
            "a SEND must follow the action that produces its message"
        )
    raise ScheduleError(
        f"{where}: receives for {_node_name(index, node)}, which already ran at step {node_step}; "
        "a RECV must come before the action that consumes it"
    )


def producer_name(deps: Dependencies, action: Action) -> str:
    """For a SEND or RECV, the message it carries in words."""
    node, src, _ = deps.route(action)
    if node < deps.SM:
        return f"the output of {src}F{action.microbatch}"
    return f"the input-gradient of stage {src} microbatch {action.microbatch}"


# ------------------------------------------------------------ FSDP and gradients
def _check_reduce_grad(index: _Index) -> None:
    """One REDUCE_GRAD per stage, after the stage's last B or W."""
    ids, node_step = index.ids, index.node_step
    M, SM = ids.M, ids.SM
    seen: dict[int, int] = {}
    for rank, step, action in index.reduce:
        s = action.stage
        where = _where(rank, step, action)
        if not index.has_backward:
            raise ScheduleError(f"{where}: a forward-only schedule has no gradients to reduce")
        if s in seen:
            raise ScheduleError(f"{where}: duplicate REDUCE_GRAD for stage {s}, already at step {seen[s]}")
        seen[s] = step
        for m in range(M):
            sm = s * M + m
            last = node_step[2 * SM + sm] if index.x_kind[sm] == _X_I else node_step[SM + sm]
            if last > step:
                kind = "W" if index.x_kind[sm] == _X_I else "B"
                raise ScheduleError(
                    f"{_where(rank, last, Action.parse(f'{s}{kind}{m}'))}: backward of stage {s} after its "
                    f"{action} (step {step}); REDUCE_GRAD must follow the stage's last B or W"
                )


# ----------------------------------------------------------- abstract execution
def _execute(index: _Index, comm: _CommPlan | None, strict: bool = True) -> None:
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
            f"{_where(rank, step, action)}: needs {_node_name(index, need)}, which rank {rank} runs later "
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
        where, why = reasons[0]
        others = "".join(f"; also {w}: {y}" for w, y in reasons[1:8])
        more = f"; and {len(reasons) - 8} more stuck ranks" if len(reasons) > 8 else ""
        raise ScheduleError(f"{where}: deadlock: {why}{others}{more}")


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
    index: _Index,
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
    received = RECEIVED * SM  # (a message is waited for as received: see _execute)
    pending = []
    for k, part in enumerate(action.parts):
        for t in deps.part_needs(part):
            if SENT * SM <= t < received or done[t] or t in own[:k]:
                continue
            if t in own:  # made by this part or a later one: it can never be there in time
                maker = action.parts[own.index(t)]
                raise ScheduleError(
                    f"{_where(rank, step, action)}: its part {part} needs {_node_name(index, t)}, which its later part "
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


def _node_name(index: _Index, node: int) -> str:
    ids = index.ids
    action = ids.node_action(node)
    if ids.SM <= node < 2 * ids.SM and index.x_kind[node - ids.SM] == _X_I:
        action = Action(action.stage, I, action.microbatch)
    return str(action)


def _stuck_reason(
    index: _Index, comm: _CommPlan | None, rank: int, pc: list[int], token: int, head: list[int], started: bytearray
) -> tuple[str, str]:
    """Where ``rank`` is stuck and why, in words."""
    program = index.schedule.actions[rank]
    SM = index.ids.SM
    if pc[rank] < len(program):
        here = _where(rank, pc[rank], program[pc[rank]])
        if token < SENT * SM:
            who = index.rank_of[(token % SM) // index.ids.M]
            return (
                here,
                f"waits for {_node_name(index, token)} (rank {who}, step {index.node_step[token]}), which never runs",
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
    return _where(rank, comm.op_step[op], comm.op_action[op]), f"its communication group never ends: this op {why}"


def _op_reason(index: _Index, comm: _CommPlan, op: int, pc: list[int], head: list[int], started: bytearray) -> str:
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


def _group_blocker(index: _Index, comm: _CommPlan, rank: int, pc: list[int], head: list[int], step: int = -1) -> str:
    if step >= 0 and pc[rank] <= step:
        return f"rank {rank} never gets past step {pc[rank]}"
    blocker = comm.rank_groups[rank][head[rank]]
    first = comm.group_ops[blocker][0]
    return (
        f"rank {rank}'s earlier communication group at step {comm.group_start[blocker]} "
        f"({comm.op_action[first]}, ...) never ends (NCCL runs one group after another)"
    )
