"""torch 2.13's private lowering passes, step simulator and schedule checks, under torch's names
and with torch's outputs (``schedules._add_send_recv`` and friends), for code and tests that call
them directly.

pipetrain lowers with its own passes (:mod:`pipetrain.plan.lower`: deadlock-checked, receives
placed for the transport, see docs/semantics.md); these functions give what torch's give instead,
action for action, because callers compare against torch's positions. Each is a short rule over
per-rank action lists; actions come back under torch's field names (``_Action``).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from typing import Any

import torch.distributed as dist

from pipetrain.plan import Action, ActionKind, ScheduleError
from pipetrain.plan import Schedule as PlanSchedule
from pipetrain.plan._text import align_columns
from pipetrain.runtime.custom import CustomAction

__all__ = [
    "_add_reduce_grad",
    "_add_send_recv",
    "_add_unshard_reshard",
    "_batch_p2p",
    "_defer_recv_ops",
    "_format_pipeline_order",
    "_merge_bw",
    "_requires_reduce_grad",
    "_simulate_comms_compute",
    "_sorted_batch_p2p",
    "_validate_schedule",
]

_K = ActionKind
_Key = tuple[int, ActionKind, "int | None"]


def _key(stage: int, kind: ActionKind, mb: int | None) -> _Key:
    return (stage, kind, mb)


def _of(action: Action) -> _Key:
    return (action.stage, action.kind, action.microbatch)


def _parts(action: Action) -> tuple[Action, ...]:
    return action.sub_actions if action.sub_actions is not None else (action,)


def _requires_reduce_grad(action_type: ActionKind) -> bool:
    """The kinds after which a stage's gradients for a microbatch are complete (W, B)."""
    return action_type in (_K.W, _K.B)


def _merge_bw(compute_actions: Sequence[Action | None]) -> list[CustomAction]:
    """Blanks dropped; an I directly followed by the same stage and microbatch's W becomes one B."""
    actions = [a for a in compute_actions if a is not None]
    merged: list[CustomAction] = []
    i = 0
    while i < len(actions):
        a = actions[i]
        nxt = actions[i + 1] if i + 1 < len(actions) else None
        if a.kind is _K.I and nxt is not None and nxt.kind is _K.W and _of(nxt)[::2] == _of(a)[::2]:
            merged.append(CustomAction(a.stage, _K.B, a.microbatch))
            i += 2
        else:
            merged.append(CustomAction.of(a))
            i += 1
    return merged


def _add_reduce_grad(actions: Sequence[Action | None], n_microbatches: int) -> list[CustomAction]:
    """Blanks dropped; a stage's REDUCE_GRAD right after its ``n_microbatches``-th W or B."""
    done: dict[int, int] = {}
    out: list[CustomAction] = []
    for a in actions:
        if a is None:
            continue
        out.append(CustomAction.of(a))
        for part in _parts(a):
            if _requires_reduce_grad(part.kind):
                done[part.stage] = done.get(part.stage, 0) + 1
                if done[part.stage] == n_microbatches:
                    out.append(CustomAction(part.stage, _K.REDUCE_GRAD))
    return out


def _add_unshard_reshard(compute_actions: Sequence[Action | None], max_active_stages: int = 3) -> list[CustomAction]:
    """FSDP gathers: before each action, the next ``max_active_stages`` distinct stages to compute
    are unsharded (those no longer among them resharded first); all resharded at the end."""
    actions = list(compute_actions)
    active: set[int] = set()
    out: list[CustomAction] = []
    for i, a in enumerate(actions):
        if a is None:
            continue
        upcoming: list[int] = []
        for b in actions[i:]:
            if b is None:
                continue
            for part in _parts(b):
                if part.stage not in upcoming:
                    upcoming.append(part.stage)
                    if b.sub_actions is None and len(upcoming) == max_active_stages:
                        break
            if len(upcoming) >= max_active_stages:
                break
        for s in sorted(active - set(upcoming)):
            active.discard(s)
            out.append(CustomAction(s, _K.RESHARD))
        for s in upcoming:
            if s not in active:
                active.add(s)
                out.append(CustomAction(s, _K.UNSHARD))
        out.append(CustomAction.of(a))
    out.extend(CustomAction(s, _K.RESHARD) for s in sorted(active))
    return out


def _sends_to_other_rank(a: Action, stage_to_rank: Callable[[int], int], num_stages: int) -> bool:
    if a.kind is _K.F:
        return a.stage != num_stages - 1 and stage_to_rank(a.stage + 1) != stage_to_rank(a.stage)
    if a.kind in (_K.I, _K.B):
        return a.stage != 0 and stage_to_rank(a.stage - 1) != stage_to_rank(a.stage)
    return False


def _inputs_here(a: Action, seen: set[_Key], num_stages: int) -> bool:
    """Whether ``a``'s input is on its rank by now: received, or made by a stage of the same rank."""
    if a.kind is _K.F and a.stage != 0:
        return _key(a.stage, _K.RECV_F, a.microbatch) in seen or _key(a.stage - 1, _K.F, a.microbatch) in seen
    if a.kind in (_K.I, _K.B) and a.stage != num_stages - 1:
        return (
            _key(a.stage, _K.RECV_B, a.microbatch) in seen
            or _key(a.stage + 1, _K.I, a.microbatch) in seen
            or _key(a.stage + 1, _K.B, a.microbatch) in seen
        )
    return True


def _add_send_recv(
    compute_actions: dict[int, list[Action | None]], stage_to_rank: Callable[[int], int], num_stages: int
) -> dict[int, list[CustomAction]]:
    """torch's lowering: ranks take turns placing their next compute action once its input is
    on the rank; its send follows it, and the matching receive is appended to the receiver's
    list at that moment (so receives sit as early as their send allows). AssertionError when
    no rank can place anything (a malformed order)."""
    pending = {r: list(compute_actions[r]) for r in sorted(compute_actions) if compute_actions[r]}
    out: dict[int, list[CustomAction]] = {r: [] for r in compute_actions}
    seen: dict[int, set[_Key]] = {r: set() for r in compute_actions}
    while pending:
        progress = False
        for rank in sorted(pending):
            a = pending[rank][0]
            if a is not None:
                if not all(_inputs_here(p, seen[rank], num_stages) for p in _parts(a)):
                    continue
                out[rank].append(CustomAction.of(a))
                for p in _parts(a):
                    seen[rank].add(_of(p))
                    if _sends_to_other_rank(p, stage_to_rank, num_stages):
                        forward = p.kind is _K.F
                        send = CustomAction(p.stage, _K.SEND_F if forward else _K.SEND_B, p.microbatch)
                        peer_stage = p.stage + 1 if forward else p.stage - 1
                        recv = CustomAction(peer_stage, _K.RECV_F if forward else _K.RECV_B, p.microbatch)
                        out[rank].append(send)
                        seen[rank].add(_of(send))
                        peer = stage_to_rank(peer_stage)
                        out.setdefault(peer, []).append(recv)
                        seen.setdefault(peer, set()).add(_of(recv))
            pending[rank].pop(0)
            if not pending[rank]:
                del pending[rank]
            progress = True
        if not progress:
            raise AssertionError("Malformed compute schedule, can't schedule sends/recvs")
    return out


def _defer_recv_ops(actions: dict[int, list[Action]], stage_to_rank: Callable[[int], int]) -> dict[int, list[Action]]:
    """Each receive moved as late as its consumer allows, except that a rank sending to a
    higher rank first posts the receives it awaits from that rank (lower rank receives first:
    no circular wait). AssertionError for a receive nothing consumes."""

    def recv_peer(a: Action) -> int:
        return stage_to_rank(a.stage - 1 if a.kind is _K.RECV_F else a.stage + 1)

    def send_peer(a: Action) -> int:
        return stage_to_rank(a.stage + 1 if a.kind is _K.SEND_F else a.stage - 1)

    result: dict[int, list[Action]] = {}
    for rank, row in actions.items():
        out: list[Action] = []
        held: dict[_Key, Action] = {}
        for a in row:
            if a.kind in (_K.RECV_F, _K.RECV_B):
                held[_of(a)] = a
                continue
            if a.kind in (_K.SEND_F, _K.SEND_B) and rank < send_peer(a):
                for k in [k for k, r in held.items() if recv_peer(r) == send_peer(a)]:
                    out.append(held.pop(k))
            for p in _parts(a):
                wanted = _K.RECV_F if p.kind is _K.F else _K.RECV_B if p.kind in (_K.B, _K.I) else None
                if wanted is not None and _key(p.stage, wanted, p.microbatch) in held:
                    out.append(held.pop(_key(p.stage, wanted, p.microbatch)))
            out.append(a)
        if held:
            raise AssertionError(
                f"Malformed input schedule on rank {rank}: leftover RECV ops with no consumer found: "
                f"{list(held.values())}. Every RECV must be consumed by a downstream compute op."
            )
        result[rank] = out
    return result


def _ready(a: Action, done: dict[int, set[_Key]], stage_to_rank: Callable[[int], int], num_stages: int) -> bool:
    """Whether torch's dry run may run ``a`` now, given what each rank has ``done``."""
    mine, mb = done[stage_to_rank(a.stage)], a.microbatch
    if a.kind in (_K.F, _K.I, _K.B):
        return _inputs_here(a, mine, num_stages)
    if a.kind is _K.W:
        return True
    if a.kind is _K.SEND_F:
        return _key(a.stage, _K.F, mb) in mine
    if a.kind is _K.SEND_B:
        return _key(a.stage, _K.I, mb) in mine or _key(a.stage, _K.B, mb) in mine
    if a.kind is _K.RECV_F:
        return _key(a.stage - 1, _K.SEND_F, mb) in done[stage_to_rank(a.stage - 1)]
    if a.kind is _K.RECV_B:
        return _key(a.stage + 1, _K.SEND_B, mb) in done[stage_to_rank(a.stage + 1)]
    raise ValueError(f"Unsupported action type {a}")


def _simulate_comms_compute(
    pipeline_order: dict[int, list[Action | None]], stage_to_rank: Callable[[int], int], num_stages: int
) -> dict[int, list[Action | None]]:
    """torch's dry run in lock-step: each step every rank runs its next action if ready (a send
    after its compute, a receive after the peer's send, a compute once its input is on the rank),
    else idles (None), and an idle rank may still take its action once the others moved that
    step. The number of steps is torch's metric for lowering passes; ValueError on a stall."""
    todo = {r: [a for a in pipeline_order[r] if a is not None] for r in sorted(pipeline_order)}
    grid: dict[int, list[Action | None]] = {r: [] for r in todo}
    done: dict[int, set[_Key]] = {r: set() for r in todo}

    def ready(a: Action) -> bool:
        return _ready(a, done, stage_to_rank, num_stages)

    def prune() -> None:
        for r in [r for r, row in todo.items() if not row]:
            del todo[r]

    while todo:
        progress = False
        for rank in sorted(todo):
            if not todo[rank]:
                continue
            if ready(todo[rank][0]):
                a = todo[rank].pop(0)
                grid[rank].append(a)
                done[rank].add(_of(a))
                progress = True
            else:
                grid[rank].append(None)
        prune()
        for rank in sorted(todo):
            if grid[rank][-1] is None and ready(todo[rank][0]):
                a = todo[rank].pop(0)
                grid[rank][-1] = a
                done[rank].add(_of(a))
        prune()
        if not progress:
            stuck = ", ".join(f"rank {r} at {row[0]}" for r, row in todo.items())
            raise ValueError(f"Schedule is not progressing: {stuck}")
    return grid


def _group_name(op: Any) -> str:
    group = getattr(op, "group", None)
    return "" if group is None else str(getattr(group, "group_name", id(group)))


def _batch_p2p(p2p_ops: Sequence[Any], desc: str | None = None) -> list[Any]:
    """Start ``torch.distributed.P2POp``s: per process group, only sends or only receives go out
    one by one (nothing to coalesce behind), a mix as one ``batch_isend_irecv`` (which pairs them
    without deadlock). The works, in that order."""
    del desc
    by_group: dict[str, list[Any]] = {}
    for op in p2p_ops:
        by_group.setdefault(_group_name(op), []).append(op)
    works: list[Any] = []
    for _, ops in sorted(by_group.items()):
        kinds = {op.op for op in ops}
        if kinds == {dist.isend}:
            works += [dist.isend(p.tensor, group=p.group, tag=p.tag, group_dst=p.group_peer) for p in ops]
        elif kinds == {dist.irecv}:
            works += [dist.irecv(p.tensor, group=p.group, tag=p.tag, group_src=p.group_peer) for p in ops]
        else:
            works += list(dist.batch_isend_irecv(list(ops)) or ())
    return works


def _sorted_batch_p2p(p2p_ops: Iterable[Any], desc: str | None = None) -> dict[int, list[Any]]:
    """:func:`_batch_p2p` per peer rank, peers in ascending order (skip connections cannot hang)."""
    by_peer: dict[int, list[Any]] = {}
    for op in p2p_ops:
        by_peer.setdefault(op.peer, []).append(op)
    return {peer: _batch_p2p(ops, desc) for peer, ops in sorted(by_peer.items())}


def _format_pipeline_order(pipeline_order: dict[int, list[Any]], error_step_number: int | None = None) -> str:
    """torch's debugging helper: a steps × ranks grid of ``pipeline_order`` (``{rank: [action or
    None, ...]}``), the step ``error_step_number`` marked. Any order prints, sound or not."""
    ranks = sorted(pipeline_order)
    steps = max((len(pipeline_order[r]) for r in ranks), default=0)
    label = len(str(max(steps - 1, 0)))
    rows = [[""] + [f"Rank {r}" for r in ranks]]
    for step in range(steps):
        cells = [pipeline_order[r][step] if step < len(pipeline_order[r]) else None for r in ranks]
        rows.append([f"Step {step:0{label}d}"] + ["" if a is None else str(a) for a in cells])
    lines = align_columns(rows, " ")
    if error_step_number is not None and 0 <= error_step_number < steps:
        lines[error_step_number + 1] += "  <-- ERROR HERE"
    return "\n".join(lines)


def _validate_schedule(
    actions: dict[int, list[Any]], pp_group_size: int, num_stages: int, num_microbatches: int
) -> dict[int, int]:
    """torch's check of a compute order, here pipetrain's (which also finds deadlocks): the
    stage → rank mapping, or AssertionError (torch's type) with pipetrain's message and the grid."""
    if len(actions) != pp_group_size or sorted(actions) != list(range(pp_group_size)):
        raise AssertionError(f"the schedule has ranks {sorted(actions)}, expected 0..{pp_group_size - 1}")
    try:
        schedule = PlanSchedule(
            {r: [None if a is None else Action.parse(str(a)) for a in row] for r, row in actions.items()},
            num_stages=num_stages,
            num_microbatches=num_microbatches,
        )
        schedule.validate()
        rows = schedule.actions.values()
        if not any(p.kind.is_backward for row in rows for a in row if a is not None for p in a.parts):
            # torch's check is of a training order; pipetrain's schedules may be forward-only.
            raise ScheduleError(
                f"no stage has a backward: each of the {num_stages} stages needs B (or I and W) for each of "
                f"the {num_microbatches} microbatches in a training schedule"
            )
    except ScheduleError as err:
        raise AssertionError(f"{err}\n\nFull pipeline schedule:\n{_format_pipeline_order(actions)}") from None
    return dict(schedule.stage_to_rank)
