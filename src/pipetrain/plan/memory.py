"""The memory model: what each rank holds over a simulated step (docs/semantics.md, "Memory").

One implementation, read by :func:`~pipetrain.plan.simulate` (and so by every planner that
scores with it). Per rank:

- *activations*: the (stage, microbatch) activation is held from the start of its F until its
  last backward ends (B, or W when split; F's end in a forward-only schedule); with
  ``Costs.weight_grad_bytes`` a split backward holds that instead from the end of its I until
  its W ends (what W reads: its layers' inputs and output gradients);
- *message buffers* (with ``Costs.message_bytes``): a stage's output crossing to another rank is
  a buffer on the sender from the SEND's post (compute-only: the F's end) until the message is
  surely delivered (lowered: the sender used a later message of its receiver's; compute-only:
  delivery), and on the receiver from the RECV's post (compute-only: delivery) until the
  receiving stage's last backward of it ends (its input is kept for backward); a gradient
  likewise from the I/B that makes it until delivery, and from its RECV until the I/B that uses
  it ends; between stages of one rank a gradient is held from the I/B that makes it until the
  I/B that uses it ends;
- *static*: the sum of ``static_bytes`` of the rank's stages, held throughout;
- *transient*: while a compute action (F, B, I, W, or an overlapped pair) of a stage with a
  backward runs, that stage's ``transient_bytes`` (a B, and the B of an overlapped pair:
  ``b_transient_bytes``, by default the same; a pair: its parts' largest): what the action
  allocates beyond what is held before and after it and frees by its end (a recomputed stage's
  rebuilt activations, a layer's workspace). It counts at that action's own time, on what is
  held then: from the action's start (before its own allocations) until what it leaves at its
  end is counted (after its frees).

peak bytes = static + the peak over time of (activations and buffers held + the transient of the
action running then, if any). A transient is counted on the most held at any moment of its
action, so the promise bounds a step that reaches its transient at the worst moment; it no longer
adds a rank's largest transient to a peak of held bytes that no action of that stage overlaps
(issue 37: 1F1B's first rank was promised 0.87 of what it held, its peak of held bytes falling
between actions, with received gradients posted early, and its transient inside a B).
"""

from __future__ import annotations

from dataclasses import dataclass

from pipetrain.plan.actions import Action, ActionKind
from pipetrain.plan.costs import Costs
from pipetrain.plan.dependencies import (
    C_B,
    C_F,
    C_I,
    C_OVERLAP,
    C_RECV_B,
    C_RECV_F,
    C_SEND_B,
    C_SEND_F,
    CODE,
)

__all__ = ["Cells", "Peaks", "peak_memory", "record_part"]

_LATE = 1 << 62  # event order of a delivery: after everything a rank starts at the same time
# Event order offset of what an action leaves at its end (the input gradient it made, what an I
# keeps for its W): after that action's own frees (the activation, the received gradient), before
# the next action's changes (issue 37: a last stage's B counted its gradient on top of the
# activations it had freed, 1F1B's last rank 537 KB promised where 471 KB is held).
_MADE = 0.25
Event = tuple[int, Action, float, float, int]  # (rank, action, start, end, predecessor)
Change = tuple[float, float, int, int, float]  # (time, event order, 0 alloc | 1 free, count delta, bytes delta)
# A compute action's transient is a pair of markers among a rank's changes, (time, event order,
# flag, 0, transient bytes): _OPEN sorts before the action's own allocation at its start, _CLOSE
# after what it leaves at its end (its event order + _MADE).
_OPEN, _CLOSE = -1, 2
Key = tuple[int, int, int]  # a message's SEND or RECV: (kind code, stage, microbatch)


@dataclass
class Peaks:
    """Per rank: peak activations held (count) and, when costs give bytes, the peak in bytes."""

    count: dict[int, int]
    count_time: dict[int, float]
    bytes: dict[int, float] | None
    bytes_time: dict[int, float] | None


@dataclass
class Cells:
    """Per (stage, microbatch) cell, index ``stage * M + microbatch``: when its activation is
    allocated and freed, and (event, end) of its F and of its input-gradient backward (I or B)."""

    alloc_at: list[float]
    alloc_ev: list[int]
    free_at: list[float | None]
    free_ev: list[int]
    f_end: list[tuple[int, float] | None]
    grad_end: list[tuple[int, float] | None]
    split: list[bool]  # the input gradient came from an I (a W follows)


def peak_memory(
    rank_of: list[int],
    n_mb: int,
    n_rk: int,
    cells: Cells,
    costs: Costs,
    events: list[Event] | None,
    outputs_until: float | None = None,
    confirmed: dict[int, dict[Action, list[Action]]] | None = None,
) -> Peaks:
    """Peaks by a sweep over each rank's allocations and frees (``events``: the simulation's, for
    message buffers; None skips them; ``confirmed``: a lowered schedule's
    :func:`~pipetrain.plan.delivery.confirmed_sends`). ``outputs_until``: the step's end, where the last stage
    kept every microbatch's output (``return_outputs``) and merges them into one more copy.

    Changes at one time sort by the event that makes them (the rank's program order), then an
    action's allocation before its own free: with positive durations that is "frees first", and
    with zero durations a forward still holds its activation until its backward. What an action
    leaves at its end (the gradient an I or B makes, what an I keeps for W) comes after that
    action's frees: the runtime frees the activations as its backward goes, and what the action
    holds beyond before and after is its transient. A delivery frees
    after everything else at its time (the runtime sees a send complete only at its next action).
    """
    n_st = len(rank_of)
    per_rank: list[list[Change]] = [[] for _ in range(n_rk)]
    act = None if costs.activation_bytes is None else costs.per_stage("activation_bytes", n_st)
    wgrad = None if costs.weight_grad_bytes is None else costs.per_stage("weight_grad_bytes", n_st)
    for idx in range(n_st * n_mb):
        if cells.f_end[idx] is None:
            continue  # never computed
        s = idx // n_mb
        r = rank_of[s]
        b = act[s] if act is not None else 0.0
        per_rank[r].append((cells.alloc_at[idx], cells.alloc_ev[idx], 0, 1, b))
        freed = cells.free_at[idx]
        if freed is None:
            continue
        i_end = cells.grad_end[idx]
        if wgrad is not None and cells.split[idx] and i_end is not None:
            # From the I on, the microbatch holds what its W reads instead.
            per_rank[r].append((i_end[1], i_end[0] + _MADE, 0, 0, wgrad[s] - b))
            b = wgrad[s]
        per_rank[r].append((freed, cells.free_ev[idx], 1, -1, -b))
    in_bytes = costs.in_bytes
    if costs.message_bytes is not None and events is not None:
        sizes = costs.per_stage("message_bytes", n_st)
        _message_buffers(per_rank, rank_of, n_mb, cells, sizes, costs.comm, events, confirmed or {})
    if outputs_until is not None and costs.message_bytes is not None:
        _kept_outputs(per_rank[rank_of[-1]], cells, n_mb, costs.per_stage("message_bytes", n_st)[-1], outputs_until)
    peaks = Peaks({}, {}, {} if in_bytes else None, {} if in_bytes else None)
    static = _per_rank_sum(costs, "static_bytes", rank_of, n_rk)
    throughout, marked = _transients(per_rank, rank_of, n_mb, cells, costs, events)
    for r in range(n_rk):
        best, at, best_b, at_b = _sweep(per_rank[r], marked[r])
        peaks.count[r], peaks.count_time[r] = best, at
        if peaks.bytes is not None and peaks.bytes_time is not None:
            peaks.bytes[r] = static[r] + best_b + throughout[r]
            peaks.bytes_time[r] = at_b
    return peaks


def _sweep(changes: list[Change], marked: bool) -> tuple[int, float, float, float]:
    """(peak count, its time, peak bytes with the running action's transient, its time) of one
    rank's changes, in their order (``marked``: they hold transient markers)."""
    held = best = 0
    held_b = best_b = running = 0.0
    at = at_b = 0.0
    ordered = sorted(changes)
    if not marked:  # no transient: the plain sweep
        for t, _, _, dc, db in ordered:
            held += dc
            if held > best:
                best, at = held, t
            held_b += db
            if held_b > best_b:
                best_b, at_b = held_b, t
        return best, at, best_b, at_b
    for t, _, flag, dc, db in ordered:
        if flag == _CLOSE:
            running = 0.0
            continue
        if flag == _OPEN:
            running = db
        else:
            held += dc
            if held > best:
                best, at = held, t
            held_b += db
        if held_b + running > best_b:
            best_b, at_b = held_b + running, t
    return best, at, best_b, at_b


def _transients(
    per_rank: list[list[Change]], rank_of: list[int], n_mb: int, cells: Cells, costs: Costs, events: list[Event] | None
) -> tuple[list[float], list[bool]]:
    """Each compute action's transient as markers among ``per_rank``'s changes (module docs), and
    per rank whether it got any; without ``events`` (no action times) each rank's largest instead,
    returned to hold throughout."""
    throughout = [0.0] * len(per_rank)
    marked = [False] * len(per_rank)
    both = _stage_transients(costs, cells, n_mb, len(rank_of))
    if both is None:
        return throughout, marked
    transient, b_transient = both
    if events is not None:
        _transient_markers(per_rank, transient, b_transient, events, marked)
        return throughout, marked
    for s, value in enumerate(transient):
        if rank_of[s] >= 0:
            throughout[rank_of[s]] = max(throughout[rank_of[s]], value, b_transient[s])
    return throughout, marked


def _stage_transients(costs: Costs, cells: Cells, n_mb: int, n_st: int) -> tuple[list[float], list[float]] | None:
    """Per stage, its (F, I and W's, B's) transients where it runs a backward (else 0: a
    forward-only step keeps none of what a backward allocates), B's only where one of its
    backwards is not split (else 0: it runs no B); None without transients."""
    values = costs.transients(n_st)
    if values is None:
        return None
    plain, b = values
    grad_end, split = cells.grad_end, cells.split
    cells_of = [range(s * n_mb, (s + 1) * n_mb) for s in range(n_st)]
    return (
        [plain[s] if any(grad_end[k] is not None for k in cells_of[s]) else 0.0 for s in range(n_st)],
        [b[s] if any(grad_end[k] is not None and not split[k] for k in cells_of[s]) else 0.0 for s in range(n_st)],
    )


def _transient_markers(
    per_rank: list[list[Change]],
    transient: list[float],
    b_transient: list[float],
    events: list[Event],
    marked: list[bool],
) -> None:
    """Each compute action's transient, from its start to its end (module docs), as markers
    (a B's, and an overlapped pair's B part's, from ``b_transient``); ``marked[rank]`` set where
    a rank got any."""
    if not any(transient) and not any(b_transient):
        return
    codes = CODE

    def of(part: Action) -> float:
        return b_transient[part.stage] if codes[part.kind] == C_B else transient[part.stage]

    for eid, (rank, action, start, end, _) in enumerate(events):
        code = codes[action.kind]
        if code > C_OVERLAP:
            continue
        value = max(of(p) for p in action.parts) if code == C_OVERLAP else of(action)
        if value > 0.0:
            changes = per_rank[rank]
            changes.append((start, eid, _OPEN, 0, value))
            changes.append((end, eid + _MADE, _CLOSE, 0, value))
            marked[rank] = True


def _kept_outputs(changes: list[Change], cells: Cells, n_mb: int, size: float, end: float) -> None:
    """The last stage's outputs, each from its F's end, and their merged copy at the step's end."""
    last = len(cells.f_end) - n_mb
    made = [cells.f_end[last + m] for m in range(n_mb)]
    for f in made:
        if f is not None:
            changes.append((f[1], f[0], 0, 0, size))
    changes.append((end, _LATE, 0, 0, size * sum(f is not None for f in made)))


def _per_rank_sum(costs: Costs, name: str, rank_of: list[int], n_rk: int) -> list[float]:
    out = [0.0] * n_rk
    if getattr(costs, name) is not None:
        for s, value in enumerate(costs.per_stage(name, len(rank_of))):
            if rank_of[s] >= 0:
                out[rank_of[s]] += value
    return out


def _message_buffers(
    per_rank: list[list[Change]],
    rank_of: list[int],
    n_mb: int,
    cells: Cells,
    size: list[float],
    comm: float,
    events: list[Event],
    confirmed: dict[int, dict[Action, list[Action]]],
) -> None:
    """Add each message's buffers (see the module docs) to ``per_rank``."""
    posts: dict[Key, tuple[float, float]] = {}  # (code, stage, mb) -> (post time, event)
    for eid, (_, action, start, _, _) in enumerate(events):
        code = CODE[action.kind]
        if C_SEND_F <= code <= C_RECV_B and action.microbatch is not None:
            posts[(code, action.stage, action.microbatch)] = (start, eid)
    buffers = _Buffers(per_rank, posts, comm, _sure_delivered(events, confirmed) if posts else {})
    for s in range(len(rank_of) - 1):
        r0, r1, b = rank_of[s], rank_of[s + 1], size[s]
        if b == 0:
            continue
        for m in range(n_mb):
            out, nxt = s * n_mb + m, (s + 1) * n_mb + m
            f = cells.f_end[out]
            if f is None:
                continue
            g_up, g_here = cells.grad_end[nxt], cells.grad_end[out]
            end_here = None if g_here is None else (g_here[1], g_here[0])
            if r0 == r1:  # a gradient handed over in memory
                if g_up is not None:
                    buffers.hold(r0, b, (g_up[1], g_up[0] + _MADE), end_here)
                continue
            freed = cells.free_at[nxt]
            consumer = None if freed is None else (freed, cells.free_ev[nxt])
            buffers.message((C_SEND_F, s, m), (C_RECV_F, s + 1, m), r0, r1, b, (f[1], f[0]), consumer)
            if g_up is not None:
                made = (g_up[1], g_up[0] + _MADE)
                buffers.message((C_SEND_B, s + 1, m), (C_RECV_B, s, m), r1, r0, b, made, end_here)


def _sure_delivered(
    events: list[Event], confirmed: dict[int, dict[Action, list[Action]]]
) -> dict[Key, tuple[float, float]]:
    """For each SEND of a lowered schedule, when its rank is sure it was delivered: at the start of
    the compute that confirms it (:mod:`pipetrain.plan.delivery`), else at the step's end."""
    end = max((e[3] for e in events), default=0.0)
    sure: dict[Key, tuple[float, float]] = {}
    for eid, (rank, action, start, _, _) in enumerate(events):
        for send in confirmed.get(rank, {}).get(action, ()):
            assert send.microbatch is not None
            sure[(CODE[send.kind], send.stage, send.microbatch)] = (start, eid - 0.5)
    for _, action, _, _, _ in events:
        if (action.kind is ActionKind.SEND_F or action.kind is ActionKind.SEND_B) and action.microbatch is not None:
            sure.setdefault((CODE[action.kind], action.stage, action.microbatch), (end, float(_LATE)))
    return sure


class _Buffers:
    """The changes of message buffers: held from a start (time, event) until an end (or forever)."""

    def __init__(
        self,
        per_rank: list[list[Change]],
        posts: dict[Key, tuple[float, float]],
        comm: float,
        sure: dict[Key, tuple[float, float]],
    ) -> None:
        self.per_rank = per_rank
        self.posts = posts
        self.lowered = bool(posts)
        self.comm = comm
        self.sure = sure
        self.end = max((t for t, _ in posts.values()), default=0.0)

    def hold(self, r: int, b: float, start: tuple[float, float], end: tuple[float, float] | None) -> None:
        self.per_rank[r].append((start[0], start[1], 0, 0, b))
        if end is not None:
            self.per_rank[r].append((end[0], end[1], 1, 0, -b))

    def message(
        self,
        send_key: tuple[int, int, int],
        recv_key: tuple[int, int, int],
        sender: int,
        receiver: int,
        b: float,
        made: tuple[float, float],
        used: tuple[float, float] | None,
    ) -> None:
        """A message of ``b`` bytes made at ``made`` on ``sender``, used until ``used`` on ``receiver``.

        Lowered: held by the sender from its product (a gradient waits for its SEND in memory;
        an output is already counted in the stage's activation, so from the SEND's post) until
        it is sure to be delivered (:func:`_sure_delivered`), by the receiver from its RECV's post.
        Compute-only: sent when made, received on delivery."""
        if self.lowered:
            send, recv = self.posts.get(send_key), self.posts.get(recv_key)
            if send is None or recv is None:
                return
            delivered = (max(send[0] + self.comm, recv[0]), float(_LATE))
            sure = self.sure.get(send_key, delivered)
            self.hold(sender, b, send if send_key[0] == C_SEND_F else made, max(sure, delivered))
            self.hold(receiver, b, recv, used)
        else:
            arrives = made[0] + self.comm
            self.hold(sender, b, made, (arrives, float(_LATE)))
            self.hold(receiver, b, (arrives, -1.0), used)


def record_part(cells: Cells, code: int, idx: int, eid: int, end: float) -> None:
    """Note a compute part that makes a cell's output (F) or input gradient (I, B)."""
    if code == C_F:
        cells.f_end[idx] = (eid, end)
    elif code == C_I or code == C_B:
        cells.grad_end[idx] = (eid, end)
        cells.split[idx] = code == C_I
