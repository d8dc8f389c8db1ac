"""Cost-model simulation of a schedule: how long, how idle, how much memory, and where.

Semantics (docs/semantics.md, "Simulation"):

- Each rank runs its list in order, one action at a time. An action starts when its rank is
  free and its inputs have arrived; idle steps (None) take no time.
- Inputs (DESIGN.md §2): F(s,m) needs F(s-1,m); B(s,m) and I(s,m) need F(s,m) and the
  input-gradient of (s+1,m) (from B or I) unless s is the last stage; W(s,m) needs I(s,m).
  An input produced on another rank arrives ``comm`` after the producing action ends; between
  stages on the same rank it is there at once.
- In a lowered schedule (one holding SEND/RECV) data between ranks travels only as messages:
  a SEND waits for its producer, a message is usable at max(SEND post + ``comm``, RECV post),
  and the consumer waits for it. SEND/RECV/UNSHARD/RESHARD/REDUCE_GRAD take the rank time the
  cost model gives them (0 by default: posted and run in the background).
- OVERLAP_F_B waits for the inputs of all its parts, takes ``Costs.overlapped`` of their
  durations, and its parts' outputs are ready when it ends.
- Memory (:mod:`pipetrain.plan.memory`): the activation of (s,m) is held on rank(s) from the
  start of F(s,m) until the end of B(s,m), or of W(s,m) when the backward is split; forward-only
  schedules free it when F ends. With byte costs, message buffers and static bytes count too,
  and a compute action's stage's transient bytes while that action runs. At equal times a rank's
  allocations and frees count in its program order (an action ending when the next starts frees
  first), so zero-duration actions still hold memory.
- ``busy`` is time spent in compute actions; ``bubble`` = 1 - busy / (ranks * makespan).

The times form a longest-path problem over a DAG (rank order plus data edges), solved by one
pass that advances each rank until it waits for a value not yet computed: O(actions), and the
result does not depend on the order ranks are visited. Actions that can never run (a cycle of
waits) raise ScheduleError naming each waiting rank, step, action and what it waits for.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from functools import cached_property
from typing import Any, NamedTuple

from pipetrain.plan._graph import gc_paused
from pipetrain.plan._text import count
from pipetrain.plan.actions import Action
from pipetrain.plan.costs import Costs
from pipetrain.plan.delivery import confirmed_sends
from pipetrain.plan.dependencies import (
    C_B,
    C_F,
    C_I,
    C_OVERLAP,
    C_RECV_B,
    C_REDUCE,
    C_RESHARD,
    C_SEND_B,
    C_SEND_F,
    C_UNSHARD,
    C_W,
    CODE,
    NUM_KEY_BLOCKS,
    RECEIVED,
    SENT,
    Dependencies,
    Ids,
    kind_code,
)
from pipetrain.plan.errors import ScheduleError
from pipetrain.plan.execution import Walk
from pipetrain.plan.memory import Cells, peak_memory, record_part
from pipetrain.plan.schedule import Schedule
from pipetrain.plan.timeline import Timeline, TimelineEvent
from pipetrain.plan.validate import check_structure, validate

__all__ = ["SimResult", "simulate"]


@dataclass
class SimResult:
    """What a simulation found. Times are in the cost model's units.

    ``peak_memory[rank]`` is the peak number of (stage, microbatch) activations held, reached
    first at ``peak_memory_time[rank]``; ``peak_memory_bytes`` is set when the costs give any
    byte size: static bytes + the peak over time of activations and message buffers held plus the
    transient of the action running then (:mod:`pipetrain.plan.memory`). ``costs`` are the
    per-stage costs simulated (a rank's share cut into this schedule's stages). ``lower_bound`` is
    a makespan no order of these actions can beat: the larger of the longest dependency chain
    and, over ranks, the rank's compute time plus the earliest time its first input can arrive.
    """

    schedule_name: str
    num_ranks: int
    num_stages: int
    num_microbatches: int
    costs: Costs
    makespan: float
    busy: dict[int, float]
    span: dict[int, tuple[float, float]]
    peak_memory: dict[int, int]
    peak_memory_time: dict[int, float]
    peak_memory_bytes: dict[int, float] | None
    peak_memory_bytes_time: dict[int, float] | None
    lower_bound: float
    num_sends: int
    lowered: bool
    _events: list[tuple[int, Action, float, float, int]] = field(repr=False, default_factory=list)
    _values: list[float | None] | None = field(repr=False, default=None)  # lowered: message post times
    _deps: Dependencies | None = field(repr=False, default=None)  # lowered: what each message carries

    @property
    def idle(self) -> dict[int, float]:
        """Per rank, the part of the makespan not spent computing."""
        return {r: self.makespan - b for r, b in self.busy.items()}

    @property
    def span_idle(self) -> dict[int, float]:
        """Per rank, idle time between its first compute's start and its last compute's end.

        This is the bubble of the Zero Bubble paper's Table 2 (a rank that starts late because
        its first input arrives late is not idle by this measure).
        """
        return {r: max(0.0, end - start - self.busy[r]) for r, (start, end) in self.span.items()}

    @property
    def bubble(self) -> float:
        """1 - busy / (ranks * makespan): the idle fraction of the pipeline."""
        if self.makespan <= 0:
            return 0.0
        return 1.0 - sum(self.busy.values()) / (self.num_ranks * self.makespan)

    @property
    def max_peak_memory(self) -> int:
        return max(self.peak_memory.values(), default=0)

    @cached_property
    def timeline(self) -> Timeline:
        """Every action with its start and end (SEND/RECV: from post until the message is delivered)."""
        return Timeline(
            num_ranks=self.num_ranks,
            events=[_event(rank, action, start, end) for rank, action, start, end, _ in self._sorted_events],
            title=self.title,
            source="simulated",
            unit="",
        )

    @cached_property
    def critical_path(self) -> list[TimelineEvent]:
        """The chain of actions, each waiting for the previous one, that ends last."""
        events = self._events
        if not events:
            return []
        last = max(range(len(events)), key=lambda k: (events[k][3], -k))
        chain: list[TimelineEvent] = []
        k = last
        while k >= 0:
            rank, action, start, end, pred = events[k]
            chain.append(_event(rank, action, start, end))
            k = pred
        chain.reverse()
        return chain

    @property
    def title(self) -> str:
        name = self.schedule_name or "schedule"
        return (
            f"{name}: {count(self.num_ranks, 'ranks')}, {count(self.num_stages, 'stages')}, "
            f"{count(self.num_microbatches, 'microbatches')}"
            f" | makespan {self.makespan:g}, bubble {100 * self.bubble:.1f}%, peak activations {self.max_peak_memory}"
        )

    @cached_property
    def _sorted_events(self) -> list[tuple[int, Action, float, float, int]]:
        events = self._events
        if self._values is not None:
            assert self._deps is not None
            events = _with_delivery_times(events, self._values, self._deps, self.costs.comm)
        return sorted(events, key=lambda e: (e[0], e[2], e[3]))

    def summary(self) -> dict[str, Any]:
        """A JSON-ready summary (what ``pipetrain simulate --json`` prints)."""
        out: dict[str, Any] = {
            "schedule": self.schedule_name,
            "num_ranks": self.num_ranks,
            "num_stages": self.num_stages,
            "num_microbatches": self.num_microbatches,
            "costs": str(self.costs),
            "lowered": self.lowered,
            "makespan": self.makespan,
            "bubble": self.bubble,
            "lower_bound": self.lower_bound,
            "busy": {str(r): v for r, v in self.busy.items()},
            "idle": {str(r): v for r, v in self.idle.items()},
            "span_idle": {str(r): v for r, v in self.span_idle.items()},
            "peak_memory": {str(r): v for r, v in self.peak_memory.items()},
            "peak_memory_time": {str(r): v for r, v in self.peak_memory_time.items()},
            "num_sends": self.num_sends,
            "critical_path": [f"r{e.rank}:{e.action}" for e in self.critical_path],
        }
        if self.peak_memory_bytes is not None and self.peak_memory_bytes_time is not None:
            out["peak_memory_bytes"] = {str(r): v for r, v in self.peak_memory_bytes.items()}
            out["peak_memory_bytes_time"] = {str(r): v for r, v in self.peak_memory_bytes_time.items()}
        return out


def _event(rank: int, action: Action, start: float, end: float) -> TimelineEvent:
    return TimelineEvent(rank, str(action), action.kind.value, action.stage, action.microbatch, start, end)


Needs = tuple[tuple[int, float], ...]
"""(value-table key, latency added); for templates the key still lacks ``+ microbatch``."""


class _Tables(NamedTuple):
    """The dependency core's rules with this cost model's latencies and durations."""

    needs: list[list[Needs]]  # [code][stage]
    makes: list[list[tuple[int, ...]]]  # [code][stage]
    duration: list[list[float]]  # [code][stage], rank time


def _tables(deps: Dependencies, costs: Costs) -> _Tables:
    comm, n_st = costs.comm, deps.S
    needs = [[tuple((key, comm if crosses else 0.0) for key, crosses in row) for row in rows] for rows in deps.needs]
    duration = [costs.per_stage(name, n_st) for name in ("f", "b", "i", "w")]
    duration += [[0.0] * n_st, [costs.send] * n_st, [costs.send] * n_st, [costs.recv] * n_st, [costs.recv] * n_st]
    return _Tables(needs, deps.makes, duration)


def _overlap_op(
    action: Action, tables: _Tables, n_mb: int, costs: Costs
) -> tuple[Needs, tuple[int, ...], float, list[float]]:
    """Needs, products, duration and per-part shares of an OVERLAP_F_B (parts in order)."""
    needs: list[tuple[int, float]] = []
    makes: list[int] = []
    solo: list[float] = []
    for part in action.parts:
        code, s, m = kind_code(part.kind), part.stage, part.microbatch
        assert m is not None
        needs += [(key + m, lat) for key, lat in tables.needs[code][s] if key + m not in makes]
        makes += [key + m for key in tables.makes[code][s]]
        solo.append(tables.duration[code][s])
    duration = costs.overlapped(solo)
    total = sum(solo)
    shares = [d * duration / total if total > 0 else 0.0 for d in solo]
    return tuple(needs), tuple(makes), duration, shares


def simulate(
    schedule: Schedule, costs: Costs | None = None, *, check: bool = True, keep_outputs: bool = False
) -> SimResult:
    """Simulate ``schedule`` under ``costs`` (default: F=1, I=W=1, B=2, comm 0); see the module docs.

    ``check`` first applies :func:`~pipetrain.plan.validate.validate`'s rules, so a broken
    schedule is refused, not timed: for a compute schedule the structural ones (each action placed
    on its stage's rank, every (stage, microbatch) forwarded once and backwarded once; deadlocks
    are found by the simulation itself), for a lowered one all of them under gloo's matching model,
    which is the simulation's (each message's SEND and RECV once, in matching order, REDUCE_GRAD
    once per stage after its last backward, ...). ``check=False`` skips them (about 15 % of the
    time for a compute schedule) for schedules known to be well formed, such as the generators'
    output. ``keep_outputs``: the last stage keeps each microbatch's output until the step ends
    and merges them there (the runtime's ``step(..., return_outputs=True)``); with
    ``Costs.message_bytes`` the memory counts them.
    """
    with gc_paused():  # many small acyclic objects: the cyclic collector only costs time here
        if check:
            if schedule.is_lowered:
                validate(schedule, matching="gloo")  # (its scan checks the structure too)
            else:
                check_structure(schedule)
        return _simulate(schedule, costs, keep_outputs)


def _simulate(schedule: Schedule, costs: Costs | None, keep_outputs: bool = False) -> SimResult:
    costs = Costs() if costs is None else costs.for_schedule(schedule)  # (a rank's share: cut per stage)
    n_st, n_mb, n_rk = schedule.num_stages, schedule.num_microbatches, schedule.num_ranks
    n_cells = n_st * n_mb
    rank_of = [schedule.stage_to_rank.get(s, -1) for s in range(n_st)]
    comm = costs.comm
    programs = [schedule.actions[r] for r in range(n_rk)]

    # Which backward frees an activation: B, or W when split; forward-only frees at F's end.
    has_w = [False] * n_cells
    any_backward = False
    lowered = False
    codes = CODE
    for listed in programs:
        for a in listed:
            if a is None:
                continue
            subs = a.sub_actions
            for part in (a,) if subs is None else subs:
                code = codes[part.kind]
                if code == C_W:
                    has_w[part.stage * n_mb + (part.microbatch or 0)] = True
                    any_backward = True
                elif code == C_B or code == C_I:
                    any_backward = True
                elif C_SEND_F <= code <= C_RECV_B:
                    lowered = True
    deps = Dependencies(n_st, n_mb, rank_of, lowered=lowered)
    tables = _tables(deps, costs)
    t_needs, t_makes, t_dur = tables
    other_dur = {C_UNSHARD: costs.unshard, C_RESHARD: costs.reshard, C_REDUCE: costs.reduce_grad}
    part_dur: list[list[float | None]] = [[None] * n_cells for _ in range(4)]

    def account(code: int, idx: int, d: float, start: float, end: float, eid: int) -> None:
        """Record a compute part's duration and its activation's alloc/free times (and event)."""
        part_dur[code][idx] = d
        record_part(cells, code, idx, eid, end)
        if code == C_F:
            alloc_at[idx] = start
            alloc_ev[idx] = eid
            if not any_backward:
                free_at[idx] = end
                free_ev[idx] = eid
        elif code == C_W or (code == C_B and not has_w[idx]):
            free_at[idx] = end
            free_ev[idx] = eid

    # ---------------------------------------------------------------- run
    value: list[float | None] = [None] * (NUM_KEY_BLOCKS * n_cells)
    producer = [-1] * (NUM_KEY_BLOCKS * n_cells)
    clock = [0.0] * n_rk
    last_event = [-1] * n_rk
    events: list[tuple[int, Action, float, float, int]] = []
    busy = [0.0] * n_rk
    first_start = [-1.0] * n_rk
    last_end = [0.0] * n_rk
    # Event numbers of the allocating and freeing actions: they order a rank's memory changes that
    # happen at one time (all of them, when costs are 0) the way the rank runs them.
    cells = Cells(
        [0.0] * n_cells,
        [0] * n_cells,
        [None] * n_cells,
        [0] * n_cells,
        [None] * n_cells,
        [None] * n_cells,
        [False] * n_cells,
    )
    alloc_at, alloc_ev, free_at, free_ev = cells.alloc_at, cells.alloc_ev, cells.free_at, cells.free_ev
    waiting_on: dict[int, int] = {}
    num_sends = 0
    last_delivery = 0.0
    walk = Walk.of(schedule.actions, n_rk, first=0)
    pc, waiters, ready = walk.pc, walk.waiting, walk.queue
    for r in walk.ranks():
        program = walk.programs[r]
        n = len(program)
        k = pc[r]
        t = clock[r]
        pred0 = last_event[r]
        while k < n:
            a = program[k]
            code = CODE[a.kind]
            s = a.stage
            m = a.microbatch
            if code < C_OVERLAP or C_OVERLAP < code <= C_RECV_B:
                assert m is not None
                needs = t_needs[code][s]
                makes = t_makes[code][s]
                d = t_dur[code][s]
            elif code == C_OVERLAP:
                needs, makes, d, shares = _overlap_op(a, tables, n_mb, costs)
                m = 0
            else:
                needs, makes, d, m = (), (), other_dur[code], 0
            start = t
            pred = pred0
            blocked = -1
            for key, latency in needs:
                v = value[key + m]
                if v is None:
                    blocked = key + m
                    break
                v += latency
                if v > start:
                    start = v
                    pred = producer[key + m]
            if blocked >= 0:
                waiters.setdefault(blocked, []).append(r)
                waiting_on[r] = blocked
                break
            end = start + d
            eid = len(events)
            events.append((r, a, start, end, pred))
            pred0 = eid
            for key in makes:
                value[key + m] = end
                producer[key + m] = eid
                if key + m in waiters:
                    ready.extend(waiters.pop(key + m))
            if code <= C_OVERLAP:
                busy[r] += d
                if first_start[r] < 0:
                    first_start[r] = start
                last_end[r] = end
                if code == C_OVERLAP:
                    for part, share in zip(a.parts, shares, strict=True):
                        assert part.microbatch is not None
                        account(kind_code(part.kind), part.stage * n_mb + part.microbatch, share, start, end, eid)
                else:
                    account(code, s * n_mb + m, d, start, end, eid)
            elif code == C_SEND_F or code == C_SEND_B:
                num_sends += 1
                if end + comm > last_delivery:
                    last_delivery = end + comm
            t = end
            k += 1
        pc[r] = k
        clock[r] = t
        last_event[r] = pred0
        if k == n:
            waiting_on.pop(r, None)

    stuck = walk.stuck()
    if stuck:
        # One wording for one broken schedule: validate names the rule ("1B0 needs 1F0, which rank
        # 1 runs later (step 2)"); this pass's own account is the fallback.
        validate(schedule)
        at = [walk.step(r, pc[r]) for r in range(n_rk)]
        raise ScheduleError(_deadlock_message(schedule, at, waiting_on, stuck, n_cells, n_mb))

    makespan = max(max(clock, default=0.0), last_delivery)  # a step ends when every message is delivered

    confirmed = confirmed_sends(schedule) if lowered and costs.message_bytes is not None else None
    peaks = peak_memory(rank_of, n_mb, n_rk, cells, costs, events, makespan if keep_outputs else None, confirmed)
    return SimResult(
        schedule_name=schedule.name,
        num_ranks=n_rk,
        num_stages=n_st,
        num_microbatches=n_mb,
        costs=costs,
        makespan=makespan,
        busy={r: busy[r] for r in range(n_rk)},
        span={r: (max(first_start[r], 0.0), last_end[r]) for r in range(n_rk)},
        peak_memory=peaks.count,
        peak_memory_time=peaks.count_time,
        peak_memory_bytes=peaks.bytes,
        peak_memory_bytes_time=peaks.bytes_time,
        lower_bound=_lower_bound(
            Dependencies(n_st, n_mb, rank_of, lowered=False) if lowered else deps, part_dur, busy, comm, n_rk
        ),
        num_sends=num_sends,
        lowered=lowered,
        _events=events,
        _values=value if lowered else None,
        _deps=deps if lowered else None,
    )


def _with_delivery_times(
    events: list[tuple[int, Action, float, float, int]],
    value: list[float | None],
    deps: Dependencies,
    comm: float,
) -> list[tuple[int, Action, float, float, int]]:
    """SEND/RECV events last from their post until the message is usable on the receiver."""
    n_cells = deps.SM
    out: list[tuple[int, Action, float, float, int]] = []
    for rank, action, start, end, pred in events:
        if action.kind.is_comm:
            node = deps.carried(action)
            if node >= 0:  # a message no stage makes has no delivery
                send, recv = value[SENT * n_cells + node], value[RECEIVED * n_cells + node]
                if send is not None:
                    delivered = send + comm if recv is None else max(send + comm, recv)
                    end = max(end, delivered)
        out.append((rank, action, start, end, pred))
    return out


def _lower_bound(
    deps: Dependencies,  # unlowered: products, not messages
    part_dur: list[list[float | None]],
    busy: list[float],
    comm: float,
    n_rk: int,
) -> float:
    """max(longest dependency chain, max over ranks of lead + compute time + trail).

    A rank's lead is the earliest any of its actions can start (its first input's arrival); its
    trail is the shortest chain of work that must follow any of its actions. Parts of an
    overlapped pair count with their share of the pair's time. The chains follow the dependency
    core's rules, over its products (F, X, W) in an order where every need comes first.
    """
    inf = float("inf")
    n_st, n_mb, n_cells = deps.S, deps.M, deps.SM
    pf, pb, pi, pw = part_dur
    # A product's duration per cell: F; X is B's or I's (a cell has one); W.
    dur = [pf, [b if b is not None else i for b, i in zip(pb, pi, strict=True)], pw]
    needs = {
        (block, s): [(key // n_cells, (key % n_cells) // n_mb, crosses) for key, crosses in deps.needs[code][s]]
        for block, code in ((0, C_F), (1, C_I), (2, C_W))
        for s in range(n_st)
    }
    order = _needs_first(needs)
    lead = [inf] * n_rk
    trail = [inf] * n_rk
    # Earliest start of every part (needs first); then the longest chain from each part's start to
    # the end of what needs it (consumers first).
    chain = _chains(order, needs, dur, deps, comm, lead)
    users: dict[tuple[int, int], list[tuple[int, int, bool]]] = {node: [] for node in needs}
    for (block, s), wanted_by in needs.items():
        for b, s2, crosses in wanted_by:
            users[(b, s2)].append((block, s, crosses))
    _chains(order[::-1], users, dur, deps, comm, trail)
    per_rank = max((lead[r] + busy[r] + trail[r] for r in range(n_rk) if lead[r] != inf), default=0.0)
    return max(chain, per_rank)


def _chains(
    order: list[tuple[int, int]],
    links: dict[tuple[int, int], list[tuple[int, int, bool]]],
    dur: list[list[float | None]],
    deps: Dependencies,
    comm: float,
    least_per_rank: list[float],
) -> float:
    """Longest chains through ``links`` (needs, or users), parts visited in ``order``: lowers each
    rank's ``least_per_rank`` to the shortest chain before one of its parts, returns the longest
    chain through a part."""
    n_mb = deps.M
    value: list[list[float]] = [[0.0] * deps.SM for _ in range(3)]
    longest = 0.0
    for block, s in order:
        r, rows, out, base = deps.rank_of[s], dur[block], value[block], s * n_mb
        linked = [(value[b], dur[b], s2 * n_mb, comm if crosses else 0.0) for b, s2, crosses in links[(block, s)]]
        least = least_per_rank[r]
        for m in range(n_mb):
            d = rows[base + m]
            if d is None:
                continue
            before = 0.0
            for v, present, offset, lat in linked:
                if present[offset + m] is not None:
                    x = v[offset + m] + lat
                    if x > before:
                        before = x
            if before < least:
                least = before
            x = out[base + m] = before + d
            if x > longest:
                longest = x
        least_per_rank[r] = least
    return longest


def _needs_first(needs: dict[tuple[int, int], list[tuple[int, int, bool]]]) -> list[tuple[int, int]]:
    """The products (block, stage) in an order where each comes after those it needs."""
    order: list[tuple[int, int]] = []
    placed: set[tuple[int, int]] = set()
    pending = list(needs)
    while pending:
        later = []
        for node in pending:
            if all((b, s) in placed for b, s, _ in needs[node]):
                order.append(node)
                placed.add(node)
            else:
                later.append(node)
        if len(later) == len(pending):  # pragma: no cover - the rules form no cycle
            raise AssertionError("the dependency rules have a cycle")
        pending = later
    return order


def _deadlock_message(
    schedule: Schedule, pc: list[int], waiting_on: dict[int, int], stuck: list[int], n_cells: int, n_mb: int
) -> str:
    ids = Ids(schedule.num_stages, n_mb)
    lines = []
    for r in stuck:
        action = schedule.actions[r][pc[r]]
        key = waiting_on.get(r)
        if key is None:
            what = "an input"
        elif key < SENT * n_cells:
            node = ids.node_action(key)
            what = f"{node} (on rank {schedule.stage_to_rank.get(node.stage)})"
        else:
            block = key // n_cells
            rank_of = [schedule.stage_to_rank.get(s, -1) for s in range(schedule.num_stages)]
            deps = Dependencies(schedule.num_stages, n_mb, rank_of, lowered=False)
            send, recv = deps.message_actions(key - (SENT if block < RECEIVED else RECEIVED) * n_cells)
            what = (
                f"message {send} from rank {schedule.stage_to_rank.get(send.stage)}"
                if block < RECEIVED
                else f"its {recv}"
            )
        lines.append(f"rank {r} at step {pc[r]} ({action}) waits for {what}")
    return "deadlock: no rank can proceed; " + "; ".join(lines)
