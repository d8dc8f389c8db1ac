"""The fast path: accept a sound schedule with one scan and one run, keeping nothing for messages.

The scan matches and groups the SEND/RECV on the way; under the strict model a lowered schedule
whose messages sit where a unit-time run of its compute says they can is proven by that run alone
(:func:`_timed_proof`). It only ever accepts: anything it cannot prove sound goes to the full
checks, which decide and word the error.
"""

# ruff: noqa: N806 - S, M, SM, R: stages, microbatches, their product, ranks (the papers' notation)

from __future__ import annotations

from pipetrain.plan._graph import (
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
)
from pipetrain.plan.actions import Action
from pipetrain.plan.dependencies import C_F, C_I, C_W, NUM_KEY_BLOCKS, RECEIVED, W_DONE, X_DONE, Dependencies
from pipetrain.plan.schedule import Schedule
from pipetrain.plan.validate.index import X_B, X_I


def accepts(schedule: Schedule, strict: bool) -> bool:
    """True only if ``schedule`` passes every one of the full checks: one scan and one abstract execution.

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
                    if node_step[node] >= 0 or x_kind[sm] != X_I:  # (so its I comes first on this rank)
                        return False
                    node_step[node] = step
                    if keep_w:
                        append(node)
                else:
                    if x_kind[sm]:
                        return False
                    x_kind[sm] = X_I if kind is I else X_B
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
    if has_backward and (min(node_step[SM : 2 * SM]) < 0 or SM - node_step[2 * SM :].count(-1) != x_kind.count(X_I)):
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
        and (keep_w or X_I not in x_kind)  # (the proof's times count every W)
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
    """The abstract execution (:func:`.execute.execute`) on :func:`_fast_run`'s programs: True if
    every rank runs to its end.

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
