"""A second validator, written from docs/semantics.md alone, slow and plain on purpose.

It shares nothing with :mod:`pipetrain.plan.validate` but the Action and Schedule types: its own
placement, completeness, message, FSDP and REDUCE_GRAD checks, and its own abstract execution
under both matching models (nccl: a rank's communication groups run one after another; gloo:
every posted operation progresses on its own; an operation completes once both ends have
started). ``accepts(schedule, matching)`` says whether the schedule is sound; tests compare that
verdict with validate's on mutated schedules. (Origin: helper-22's fuzzing reference, session 15.)
"""

from __future__ import annotations

from pipetrain.plan import Action, ActionKind, Schedule

K = ActionKind
COMPUTE = {K.F, K.B, K.I, K.W}
COMM = {K.SEND_F, K.SEND_B, K.RECV_F, K.RECV_B}
Product = tuple[str, int, int]  # ("F" | "X" | "W", stage, microbatch): X is the B or the I
Message = tuple[str, int, int, int]  # ("F" | "B", from stage, to stage, microbatch)


class RejectedError(Exception):
    """The schedule breaks a rule (the message says which, loosely)."""


def accepts(schedule: Schedule, matching: str = "nccl") -> bool:
    try:
        _check(schedule, matching)
    except RejectedError:
        return False
    return True


def _parts(action: Action) -> list[Action]:
    return list(action.sub_actions or ()) if action.kind is K.OVERLAP_F_B else [action]


def _product(part: Action) -> Product:
    assert part.microbatch is not None
    return ("F" if part.kind is K.F else "W" if part.kind is K.W else "X", part.stage, part.microbatch)


def _message(op: Action) -> Message:
    s, m = op.stage, op.microbatch
    assert m is not None
    return {
        K.SEND_F: ("F", s, s + 1, m),
        K.RECV_F: ("F", s - 1, s, m),
        K.SEND_B: ("B", s, s - 1, m),
        K.RECV_B: ("B", s + 1, s, m),
    }[op.kind]


def _check(schedule: Schedule, matching: str) -> None:
    S, M, R = schedule.num_stages, schedule.num_microbatches, schedule.num_ranks
    owner = dict(schedule.stage_to_rank)
    if M < 1:
        raise RejectedError("no microbatch")

    # Placement, ranges, duplicates; where every compute part runs.
    where: dict[Product, tuple[int, int]] = {}
    backward_kind: dict[tuple[int, int], K] = {}
    has_backward = False
    ops: list[tuple[int, int, Action]] = []
    sharded_stages = set()
    for r in range(R):
        for step, action in enumerate(schedule.actions[r]):
            if action is None:
                continue
            for part in _parts(action):
                if not 0 <= part.stage < S or owner.get(part.stage) != r:
                    raise RejectedError(f"{part} off its stage's rank")
                if part.kind.needs_microbatch and not (part.microbatch is not None and 0 <= part.microbatch < M):
                    raise RejectedError(f"{part}: microbatch out of range")
                if part.kind in COMPUTE:
                    key = _product(part)
                    if part.kind is not K.F:
                        has_backward = True
                    if key[0] == "X":
                        backward_kind[key[1:]] = part.kind
                    if key in where:
                        raise RejectedError(f"{part} twice")
                    where[key] = (r, step)
                elif part.kind in COMM:
                    ops.append((r, step, part))
                elif part.kind is K.UNSHARD:
                    sharded_stages.add(part.stage)

    for s in range(S):
        for m in range(M):
            if ("F", s, m) not in where:
                raise RejectedError(f"no {s}F{m}")
            if has_backward and ("X", s, m) not in where:
                raise RejectedError(f"no backward of {s}, {m}")
            split = backward_kind.get((s, m)) is K.I
            if split != (("W", s, m) in where):
                raise RejectedError(f"{s}I{m} without its W, or a W without an I")

    # FSDP and gradient reduction, in program order.
    for r in range(R):
        state: dict[int, str] = {}
        reduced: set[int] = set()
        for action in schedule.actions[r]:
            if action is None:
                continue
            for part in _parts(action):
                s = part.stage
                if part.kind is K.UNSHARD:
                    if state.get(s) == "unsharded":
                        raise RejectedError(f"{part}: already unsharded")
                    state[s] = "unsharded"
                elif part.kind is K.RESHARD:
                    if state.get(s) != "unsharded":
                        raise RejectedError(f"{part}: not unsharded")
                    state[s] = "resharded"
                elif part.kind is K.REDUCE_GRAD:
                    if s in reduced or not has_backward:
                        raise RejectedError(f"{part}: twice, or nothing to reduce")
                    reduced.add(s)
                elif part.kind in COMPUTE:
                    if s in sharded_stages and state.get(s) != "unsharded":
                        raise RejectedError(f"{part} on a sharded stage")
                    if part.kind in (K.B, K.W) and s in reduced:
                        raise RejectedError(f"{part} after its REDUCE_GRAD")

    # Messages: each crossing product sent once after its producer and received once before its
    # user, between two ranks in the same order.
    sent: dict[Message, int] = {}
    received: dict[Message, int] = {}
    pair_order: dict[tuple[int, int, bool], list[Message]] = {}
    for i, (_, step, op) in enumerate(ops):
        msg = _message(op)
        kind, src, dst, m = msg
        if not (0 <= src < S and 0 <= dst < S) or owner[src] == owner[dst] or (kind == "B" and not has_backward):
            raise RejectedError(f"{op}: no such message")
        is_send = op.kind in (K.SEND_F, K.SEND_B)
        product: Product = ("F", src, m) if kind == "F" else ("X", src, m)
        user: Product = ("F", dst, m) if kind == "F" else ("X", dst, m)
        if is_send and (msg in sent or where[product][1] >= step):
            raise RejectedError(f"{op}: twice, or before its producer")
        if not is_send and (msg in received or where[user][1] <= step):
            raise RejectedError(f"{op}: twice, or after its user")
        (sent if is_send else received)[msg] = i
        pair_order.setdefault((owner[src], owner[dst], is_send), []).append(msg)
    if ops:
        for s in range(S):
            for m in range(M):
                crossing = []
                if s + 1 < S and owner[s] != owner[s + 1]:
                    crossing.append(("F", s, s + 1, m))
                if has_backward and s > 0 and owner[s] != owner[s - 1]:
                    crossing.append(("B", s, s - 1, m))
                if any(msg not in sent or msg not in received for msg in crossing):
                    raise RejectedError(f"a message of stage {s}, microbatch {m} is not sent and received")
        for (a, b, is_send), order in pair_order.items():
            if is_send and order != pair_order.get((a, b, False), []):
                raise RejectedError(f"rank {a} sends to rank {b} in another order than {b} receives")
    peer = {sent[msg]: received[msg] for msg in sent} | {received[msg]: sent[msg] for msg in sent}

    # Abstract execution: programs of compute items and communication groups (a run of
    # consecutive SEND/RECV; anything else, an idle step included, ends it).
    programs: list[list[tuple[str, object]]] = []
    groups: list[list[int]] = []
    rank_groups: list[list[int]] = [[] for _ in range(R)]
    group_of: dict[int, int] = {}
    index = {(r, step): i for i, (r, step, _) in enumerate(ops)}
    for r in range(R):
        program: list[tuple[str, object]] = []
        group = None
        for step, action in enumerate(schedule.actions[r]):
            if action is not None and action.kind in COMM:
                if group is None:
                    group = len(groups)
                    groups.append([])
                    rank_groups[r].append(group)
                    program.append(("group", group))
                groups[group].append(index[(r, step)])
                group_of[index[(r, step)]] = group
                continue
            group = None
            if action is not None and (action.kind in COMPUTE or action.kind is K.OVERLAP_F_B):
                program.append(("compute", _parts(action)))
        programs.append(program)

    done: set[Product] = set()
    posted = [False] * len(groups)
    started = [False] * len(groups)
    completed = [False] * len(ops)
    pc = [0] * R
    head = [0] * R  # nccl: each rank's first group that has not ended

    def needs(part: Action) -> list[Product]:
        s, m = part.stage, part.microbatch
        assert m is not None
        if part.kind is K.F:
            return [("F", s - 1, m)] if s > 0 else []
        if part.kind is K.W:
            return [("X", s, m)]
        return [("F", s, m)] + ([("X", s + 1, m)] if s < S - 1 else [])

    def there(need: Product, rank: int) -> bool:
        kind, s, m = need
        if ops and owner[s] != rank:  # lowered: a crossing input is there once its RECV completed
            return completed[received[("F", s, s + 1, m) if kind == "F" else ("B", s, s - 1, m)]]
        return need in done

    changed = True
    while changed:
        changed = False
        for r in range(R):
            if matching == "nccl":
                while head[r] < len(rank_groups[r]) and posted[rank_groups[r][head[r]]]:
                    g = rank_groups[r][head[r]]
                    if not started[g]:
                        started[g] = changed = True
                    if not all(completed[o] for o in groups[g]):
                        break
                    head[r] += 1
                    changed = True
            else:
                for g in rank_groups[r]:
                    if posted[g] and not started[g]:
                        started[g] = changed = True
        for i in range(len(ops)):
            if not completed[i] and started[group_of[i]] and started[group_of[peer[i]]]:
                completed[i] = changed = True
        for r in range(R):
            while pc[r] < len(programs[r]):
                what, item = programs[r][pc[r]]
                if what == "group":
                    posted[item] = True  # type: ignore[index]
                else:
                    parts: list[Action] = item  # type: ignore[assignment]
                    made: set[Product] = set()  # the parts of an OVERLAP_F_B run in order
                    for part in parts:
                        if not all(need in made or there(need, r) for need in needs(part)):
                            break
                        made.add(_product(part))
                    if len(made) < len(parts):
                        break
                    done.update(made)
                pc[r] += 1
                changed = True
    if any(pc[r] < len(programs[r]) for r in range(R)) or not all(completed):
        raise RejectedError("deadlock")
    if matching == "nccl" and any(head[r] < len(rank_groups[r]) for r in range(R)):
        raise RejectedError("deadlock: a communication group never ends")
