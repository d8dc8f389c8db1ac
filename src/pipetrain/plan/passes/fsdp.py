"""The FSDP pass: UNSHARD a stage shortly before it computes, RESHARD it when it must make room.

Each rank walks its compute actions. A stage is gathered up to ``prefetch`` compute actions before
each use (so the gather overlaps the compute before it) and freed right after its last use of the
step; between two uses it stays gathered while the rank has room. At most ``max_unsharded``
stages are gathered at once (torch's ``max_active_stages``, 3 by default there and here): a hard
cap, as torch's, except for an OVERLAP_F_B whose parts alone use more stages. To make room, the
stage idle over the whole prefetch window and used again furthest ahead is freed right after its
last use (Belady's rule, optimal for a plain cache; a heuristic here); a gather that still finds
no room waits until it does, at the latest right before its use. So with ``max_unsharded=1`` only
the stage computing is gathered (no prefetch across a change of stage), and with at least as many
as the rank holds each stage is gathered once per step. Linear in the number of actions for a
given limit and prefetch (torch 2.13's pass rescans the rest of the list per action: quadratic).
"""

from __future__ import annotations

from collections.abc import Sequence

from pipetrain.plan._graph import RECV_B, RECV_F, REDUCE_GRAD, RESHARD, SEND_B, SEND_F, UNSHARD
from pipetrain.plan.actions import Action, make_action
from pipetrain.plan.errors import ScheduleError
from pipetrain.plan.passes._insert import compute_actions, insert_around_compute, refuse_existing
from pipetrain.plan.schedule import Schedule

_SKIP_AFTER = frozenset({SEND_F, RECV_F, SEND_B, RECV_B, REDUCE_GRAD})

DEFAULT_MAX_UNSHARDED = 3
"""Stages a rank keeps gathered at once by default (torch's ``max_active_stages``)."""

Slots = list[list[Action] | None]


def add_fsdp(schedule: Schedule, prefetch: int = 1, max_unsharded: int | None = DEFAULT_MAX_UNSHARDED) -> Schedule:
    """Return ``schedule`` with UNSHARD/RESHARD for every stage (see the module docstring)."""
    check_fsdp_options(prefetch, max_unsharded)
    refuse_existing(schedule, frozenset({UNSHARD, RESHARD}), "UNSHARD/RESHARD actions")
    return fsdp_pass(schedule, prefetch, max_unsharded)


def check_fsdp_options(prefetch: object, max_unsharded: object) -> None:
    """Raise naming the bad option: ``prefetch`` an integer >= 0, ``max_unsharded`` one >= 1 or None."""
    if isinstance(prefetch, bool) or not isinstance(prefetch, int) or prefetch < 0:
        raise ScheduleError(f"FSDP prefetch must be an integer >= 0 (compute actions ahead), got {prefetch!r}")
    if max_unsharded is not None and (
        isinstance(max_unsharded, bool) or not isinstance(max_unsharded, int) or max_unsharded < 1
    ):
        raise ScheduleError(
            f"FSDP max_unsharded must be an integer >= 1 (stages gathered at once per rank) or None "
            f"(no limit), got {max_unsharded!r}"
        )


def fsdp_pass(schedule: Schedule, prefetch: int, max_unsharded: int | None) -> Schedule:
    """:func:`add_fsdp` without the argument and repeat checks (for ``lower``)."""
    out: dict[int, list[Action | None]] = {}
    unshard, reshard = fsdp_actions(schedule.num_stages)
    for r in range(schedule.num_ranks):
        program = schedule.actions[r]
        before, after = fsdp_slots(compute_actions(program), prefetch, max_unsharded, unshard, reshard)
        out[r] = insert_around_compute(program, before, after, _SKIP_AFTER)
    return schedule._derived(out)


def fsdp_actions(num_stages: int) -> tuple[list[Action], list[Action]]:
    """One UNSHARD and one RESHARD per stage, shared by every place that needs it (actions are
    immutable; building tens of thousands of equal ones would only cost time)."""
    return (
        [make_action(s, UNSHARD) for s in range(num_stages)],
        [make_action(s, RESHARD) for s in range(num_stages)],
    )


def fsdp_slots(
    computes: Sequence[Action],
    prefetch: int,
    max_unsharded: int | None,
    unshard: list[Action],
    reshard: list[Action],
) -> tuple[Slots, Slots]:
    """What goes before and after each compute action of one rank (indexed like ``computes``)."""
    n = len(computes)
    before: Slots = [None] * n
    after: Slots = [None] * n
    if not n:
        return before, after
    stages, _, _, subs = zip(*computes, strict=True)  # (columns, in C: this runs once per rank)
    if subs.count(None) == n:  # no OVERLAP_F_B: one stage per action
        first = {s: stages.index(s) for s in set(stages)}
        if max_unsharded is None or len(first) <= max_unsharded:
            # Room for every stage: gathered once, ``prefetch`` actions before its first use,
            # freed after its last.
            backwards = stages[::-1]
            for s in sorted(first, key=first.__getitem__):
                _add(before, max(0, first[s] - prefetch), unshard[s])
                _add(after, n - 1 - backwards.index(s), reshard[s])
            return before, after
    # Each stage's uses, in order (an OVERLAP_F_B uses the stages of its parts).
    uses: dict[int, list[int]] = {}
    for k, action in enumerate(computes):
        parts = action.sub_actions
        for s in dict.fromkeys(p.stage for p in parts) if parts is not None else (action.stage,):
            row = uses.get(s)
            if row is None:
                uses[s] = [k]
            else:
                row.append(k)
    if max_unsharded is None or len(uses) <= max_unsharded:  # (as above)
        for s, row in uses.items():
            _add(before, max(0, row[0] - prefetch), unshard[s])
            _add(after, row[-1], reshard[s])
        return before, after
    _bounded(computes, uses, prefetch, max_unsharded, before, after, unshard, reshard)
    return before, after


def _bounded(
    computes: Sequence[Action],
    uses: dict[int, list[int]],
    prefetch: int,
    limit: int,
    before: Slots,
    after: Slots,
    unshard: list[Action],
    reshard: list[Action],
) -> None:
    """:func:`fsdp_slots` when the rank holds more stages than ``limit``: the walk of the module
    docstring, one compute action at a time (:class:`_CappedWalk`)."""
    walk = _CappedWalk(uses, limit, len(computes), after, reshard)
    for k, action in enumerate(computes):
        t = max(0, k - prefetch)
        walk.make_room_at(t, k)
        parts = action.sub_actions
        for s in dict.fromkeys(p.stage for p in parts) if parts is not None else (action.stage,):
            if walk.use(s, t, k):
                _add(before, walk.slot, unshard[s])
    for s, last in walk.held.items():  # each stage freed right after its last use
        _add(after, last, reshard[s])


class _CappedWalk:
    """The state of :func:`_bounded`'s walk.

    ``held`` maps each gathered stage to its latest use so far; after that use it stays gathered
    (its *tail*) until freed, which puts a RESHARD right after that use. ``occ[j]`` counts the
    stages gathered at compute action ``j`` other than by a tail. A stage not held when action
    ``k`` uses it is gathered at slot ``t = k - prefetch`` if the limit allows there and up to
    ``k``; while some of those actions are full, a stage gathered there by a tail and not used
    again before ``k`` is freed: one idle over the whole window, used again furthest ahead, first
    (Belady), else the one used least recently. Where none is left, the gather waits until after
    the last full action. Hence, whenever the stages used in the next ``prefetch + 1`` actions
    fit the limit, they are all gathered.
    """

    def __init__(self, uses: dict[int, list[int]], limit: int, n: int, after: Slots, reshard: list[Action]) -> None:
        self.uses, self.limit, self.never = uses, limit, n
        self.after, self.reshard = after, reshard
        self.held: dict[int, int] = {}
        self.occ = [0] * n
        self.seen = dict.fromkeys(uses, 0)  # per stage, how many of its uses have been walked
        self.freed_after: dict[int, int] = {}  # per stage, the use it was last freed after
        self.slot = 0  # where the last gather :meth:`use` asked for goes

    def next_use(self, s: int) -> int:
        row, seen = self.uses[s], self.seen[s]
        return row[seen] if seen < len(row) else self.never

    def count(self, j: int) -> int:
        """Stages gathered at compute action ``j`` (``j`` in the current window or later)."""
        return self.occ[j] + sum(1 for last in self.held.values() if last < j)

    def free_one(self, t: int, k: int, covering: int) -> bool:
        """Free a held stage whose tail covers action ``covering`` and that ``k`` does not use (in
        the class docstring's order); False if there is none."""
        held, next_use = self.held, self.next_use
        idle = [s for s, last in held.items() if last < covering and next_use(s) > k]
        if not idle:
            return False
        s = min(idle, key=lambda s: (max(held[s], t - 1), -next_use(s)))
        last = held.pop(s)
        _add(self.after, last, self.reshard[s])
        self.freed_after[s] = last
        return True

    def make_room_at(self, t: int, k: int) -> None:
        """Back within the limit at ``k`` (over it only after an OVERLAP_F_B using more stages)."""
        while self.count(k) > self.limit and self.free_one(t, k, k):
            pass

    def gather_slot(self, t: int, k: int) -> int:
        """Where a gather for use ``k`` goes, freeing stages as the class docstring says."""
        while True:
            full = next((j for j in range(k, t - 1, -1) if self.count(j) >= self.limit), -1)
            if full < 0:
                return t
            if not self.free_one(t, k, full):
                return min(full + 1, k)  # (k itself full: only an OVERLAP_F_B using too many stages)

    def use(self, s: int, t: int, k: int) -> bool:
        """Stage ``s`` computes at ``k``: True if it needs a gather (at :attr:`slot`)."""
        last = self.held.get(s)
        gather = False
        if last is not None:  # its tail up to k is now counted in occ
            first = max(last + 1, t)
        else:
            first = self.gather_slot(t, k)
            if self.freed_after.get(s, -2) + 1 == first:  # freed right before: keep it instead
                bucket = self.after[first - 1]
                assert bucket is not None
                bucket.remove(self.reshard[s])
                if not bucket:
                    self.after[first - 1] = None
            else:
                gather, self.slot = True, first
        occ = self.occ
        for j in range(first, k + 1):
            occ[j] += 1
        self.held[s] = k
        self.seen[s] += 1
        return gather


def _add(slots: Slots, k: int, action: Action) -> None:
    bucket = slots[k]
    if bucket is None:
        slots[k] = [action]
    else:
        bucket.append(action)
