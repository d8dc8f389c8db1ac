"""Structure: one scan of the rank programs, then completeness.

The scan checks placement, ranges, duplicates and the FSDP state of every action, and records in
an :class:`~.index.Index` where every compute part runs and what the later checks need (the
SEND/RECV in order, the REDUCE_GRAD, each rank's program as integers). Completeness: every
(stage, microbatch) has its F and its backward.
"""

# ruff: noqa: N803, N806 - S, M, SM: stages, microbatches, their product (the papers' notation)

from __future__ import annotations

from pipetrain.plan._graph import OVERLAP, REDUCE_GRAD, RESHARD, UNSHARD, B, F, I, W
from pipetrain.plan.actions import Action
from pipetrain.plan.dependencies import Ids
from pipetrain.plan.errors import ScheduleError
from pipetrain.plan.schedule import Schedule, first_naming
from pipetrain.plan.validate.gradients import check_unshard_first
from pipetrain.plan.validate.index import COMPLETENESS, X_B, X_I, Index, where

_NUMBERING = "microbatches must be numbered 0..M-1 without gaps, with an F on every stage for each"


def structure(schedule: Schedule) -> Index:
    """The scan and the completeness check: every check short of matching messages and running."""
    if schedule.num_microbatches < 1:
        raise ScheduleError("the schedule has no compute actions: it needs at least one microbatch")
    index = _scan(schedule)
    _check_completeness(index)
    return index


def _scan(schedule: Schedule) -> Index:
    """Check placement, ranges, duplicates and FSDP state; record where every compute part runs."""
    ids = Ids(schedule.num_stages, schedule.num_microbatches)
    S, M, SM = ids.S, ids.M, ids.SM
    rank_of = [schedule.stage_to_rank.get(s, -1) for s in range(S)]
    index = Index(schedule, ids, rank_of, [-1] * (3 * SM), bytearray(SM))
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
            code = X_B if pk is B else X_I
            if x_kind[sm] and x_kind[sm] != code:
                other = "I" if code == X_B else "B"
                raise ScheduleError(
                    f"{where(rank, step, action)}: stage {s} microbatch {m} already has "
                    f"{s}{other}{m} at step {node_step[node]}; {COMPLETENESS}, never B together with I"
                )
            x_kind[sm] = code
        if node_step[node] >= 0:
            raise ScheduleError(
                f"{where(rank, step, action)}: duplicate {part}, already at step {node_step[node]}; {COMPLETENESS}"
            )
        if shard[s] == 2:
            raise ScheduleError(
                f"{where(rank, step, action)}: stage {s} is sharded here; an UNSHARD must precede its compute "
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
                            x_kind[sm] = X_I
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
                        raise ScheduleError(f"{where(rank, step, action)}: stage {s} is already unsharded")
                    shard[s] = 1
                    if first_unshard[s] < 0:
                        first_unshard[s] = step
                elif kind is RESHARD:
                    if shard[s] != 1:
                        raise ScheduleError(
                            f"{where(rank, step, action)}: stage {s} is not unsharded here; a RESHARD must follow "
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
    check_unshard_first(index, first_unshard)
    return index


def _check_place(
    action: Action, rank: int, step: int, rank_of: list[int], M: int, *, whole: Action | None = None
) -> None:
    """Raise if ``action`` names a stage not on ``rank`` or a microbatch out of range."""
    s = action.stage
    m = action.microbatch
    if s < len(rank_of) and rank_of[s] == rank and (m is None or m < M):
        return
    here = where(rank, step, whole or action)
    if s >= len(rank_of) or rank_of[s] < 0:
        raise ScheduleError(f"{here}: stage {s} does not exist (the schedule has {len(rank_of)} stages)")
    if rank_of[s] != rank:
        raise ScheduleError(f"{here}: stage {s} lives on rank {rank_of[s]}; each stage lives on exactly one rank")
    if action.kind.needs_microbatch and (m is None or m >= M):
        raise ScheduleError(f"{here}: microbatch {m} is out of range (the schedule has {M} microbatches)")


def _check_completeness(index: Index) -> None:
    """Every (stage, microbatch) has its F and its backward; on a gap, the clearest reason."""
    try:
        _check_cells(index)
    except ScheduleError:
        stray = _past_the_count(index)  # a stray large microbatch explains a gap better
        if stray is None:
            raise
        raise ScheduleError(stray) from None


def _past_the_count(index: Index) -> str | None:
    """The error for the first action past the microbatches the schedule runs, if it has one.

    The number of microbatches is the largest one named plus one, so a stray ``0B9`` among eight
    makes ten, and the first cell found incomplete is then some innocent ``0F0``. When microbatch k
    has no forward on any stage and none above it has one on every stage, the schedule runs
    0..k-1: name the first action past that range instead. (A microbatch above k with all its
    forwards is a real one: k was left out, which the cell check says.) Runs only on a schedule
    already found incomplete.
    """
    M, S, node_step = index.ids.M, index.ids.S, index.node_step
    k = next((m for m in range(M) if all(node_step[s * M + m] < 0 for s in range(S))), M)
    if k in (0, M) or any(all(node_step[s * M + m] >= 0 for s in range(S)) for m in range(k + 1, M)):
        return None
    for rank in range(index.schedule.num_ranks):
        for step, action in enumerate(index.schedule.actions[rank]):
            if action is None:
                continue
            for part in action.parts:
                m = part.microbatch
                if m is not None and m >= k:
                    return (
                        f"{where(rank, step, action)}: microbatch {m} is outside 0..{k - 1} (no stage has a forward "
                        f"of microbatch {k}); {_NUMBERING}"
                    )
    return None  # (a count given larger than any microbatch named: the gap is the message)


def _check_cells(index: Index) -> None:
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
                for step, what in ((x_step, f"{s}{'I' if x_kind[sm] == X_I else 'B'}{m}"), (w_step, f"{s}W{m}")):
                    if step >= 0:
                        raise ScheduleError(
                            f"rank {rank}, step {step}, action {what}: its forward {s}F{m} is missing; {COMPLETENESS}"
                        )
                why = ""
                if m == M - 1:  # the count comes from the largest index: say which action set it
                    named = first_naming(index.schedule.actions, m)
                    why = f" (the schedule has {M} microbatches because {named} names microbatch {m})" if named else ""
                raise ScheduleError(
                    f"rank {rank}: stage {s} microbatch {m} has no forward {s}F{m}{why}; {COMPLETENESS}"
                )
            if not backward:
                continue
            if x_step < 0:
                here = where(rank, f_step, Action(s, F, m))
                if w_step >= 0:
                    raise ScheduleError(
                        f"{where(rank, w_step, Action(s, W, m))}: needs {s}I{m}, which is missing; {COMPLETENESS}"
                    )
                raise ScheduleError(f"{here}: has no backward ({s}B{m}, or {s}I{m} and {s}W{m}); {COMPLETENESS}")
            if x_kind[sm] == X_I and w_step < 0:
                raise ScheduleError(f"{where(rank, x_step, Action(s, I, m))}: has no matching {s}W{m}; {COMPLETENESS}")
            if x_kind[sm] == X_B and w_step >= 0:
                raise ScheduleError(
                    f"{where(rank, w_step, Action(s, W, m))}: stage {s} microbatch {m} already has a full backward "
                    f"{s}B{m} (step {x_step}); {COMPLETENESS}, never B together with W"
                )
