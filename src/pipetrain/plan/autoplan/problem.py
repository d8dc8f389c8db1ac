"""A scheduling problem as flat integer tables, and the makespan evaluation the search runs
thousands of times.

An action is a *code*: ``kind * SM + s * M + m`` with kind F=0, I=1, W=2, B=3 (``SM`` = stages
× microbatches). A rank's program is a list of codes in the order it runs them. Two products are
consumed by other actions: the forward output of (s, m) (slot ``s*M + m``) and its input-gradient,
made by I or B (slot ``SM + s*M + m``). The dependency rules are DESIGN.md §2's, the same that
``validate`` and ``simulate`` apply: F(s,m) needs F(s-1,m); I/B(s,m) need F(s,m) and, unless s is
the last stage, the input-gradient of (s+1,m); W(s,m) needs I(s,m). A product crossing ranks
arrives ``comm`` after its action ends.

Memory is a property of the order alone: a rank holds the activation of (s, m) from the start of
F(s,m) to the end of B(s,m), or, split, to the end of I(s,m) and then what W reads
(``held_after_i``) until W(s,m) ends, on top of what it holds whatever the order (``base``); so its
peak is the largest prefix sum of its program. This is :mod:`pipetrain.plan.memory`'s model for
those parts, exactly; what it makes of message buffers between ranks depends on timing, which
the planners check by simulating what they return.
"""

from __future__ import annotations

import copy
import math
from collections.abc import Sequence
from dataclasses import dataclass

from pipetrain.plan.actions import Action, ActionKind
from pipetrain.plan.costs import Costs
from pipetrain.plan.dependencies import C_B, C_F, C_I, C_W, Dependencies
from pipetrain.plan.errors import ScheduleError
from pipetrain.plan.schedule import Schedule

__all__ = ["KIND_B", "KIND_F", "KIND_I", "KIND_W", "Problem"]

KIND_F, KIND_I, KIND_W, KIND_B = 0, 1, 2, 3
_KINDS = (ActionKind.F, ActionKind.I, ActionKind.W, ActionKind.B)
_KIND_CODE = {ActionKind.F: KIND_F, ActionKind.I: KIND_I, ActionKind.W: KIND_W, ActionKind.B: KIND_B}
INFEASIBLE = math.inf

Orders = list[list[int]]
"""One program (a list of action codes) per rank."""


@dataclass(frozen=True)
class Problem:
    """Sizes, placement, per-stage durations and memory weights of one planning problem.

    ``weight[s]`` is what one activation of stage s costs against ``limit`` (bytes, or a stage's
    share of a rank's activations); ``limit`` None means unlimited. ``held_after_i[s]`` is what a
    split backward of stage s holds instead from its I's end until its W ends (empty: the weight),
    ``base[r]`` what rank r holds throughout (static bytes, its largest transient; empty: none).
    """

    num_ranks: int
    num_microbatches: int
    stage_to_rank: tuple[int, ...]
    f: tuple[float, ...]
    i: tuple[float, ...]
    w: tuple[float, ...]
    b: tuple[float, ...]
    comm: float
    weight: tuple[float, ...]
    limit: float | None
    placement: str
    held_after_i: tuple[float, ...] = ()
    base: tuple[float, ...] = ()

    @classmethod
    def build(
        cls,
        num_ranks: int,
        num_microbatches: int,
        stage_to_rank: Sequence[int],
        costs: Costs,
        weight: Sequence[float],
        limit: float | None,
        placement: str,
        held_after_i: Sequence[float] = (),
        base: Sequence[float] = (),
    ) -> Problem:
        n = len(stage_to_rank)
        return cls(
            num_ranks,
            num_microbatches,
            tuple(stage_to_rank),
            tuple(costs.per_stage("f", n)),
            tuple(costs.per_stage("i", n)),
            tuple(costs.per_stage("w", n)),
            tuple(costs.per_stage("b", n)),
            costs.comm,
            tuple(weight),
            limit,
            placement,
            tuple(held_after_i),
            tuple(base),
        )

    @property
    def num_stages(self) -> int:
        return len(self.stage_to_rank)

    @property
    def after_i(self) -> tuple[float, ...]:
        """Per stage, what a split backward holds from its I's end until its W ends."""
        return self.held_after_i or self.weight

    @property
    def hold(self) -> tuple[float, ...]:
        """Per stage, the most one (stage, microbatch) holds at any time of a split backward: a
        constructor that reserves it from F's start to W's end never goes over the limit."""
        return tuple(max(a, g) for a, g in zip(self.weight, self.after_i, strict=True))

    def room(self, rank: int) -> float | None:
        """What ``rank`` has for held activations under ``limit`` (None: unlimited)."""
        if self.limit is None:
            return None
        return self.limit - (self.base[rank] if self.base else 0.0)

    def retimed(
        self,
        f: Sequence[float],
        i: Sequence[float],
        w: Sequence[float],
        weight: Sequence[float],
        limit: float | None,
        b: Sequence[float] | None = None,
        held_after_i: Sequence[float] = (),
        base: Sequence[float] = (),
    ) -> Problem:
        """This layout with other per-stage durations (``b`` default ``i + w``), memory weights and limit
        (``held_after_i`` and ``base`` none unless given).

        The dependency tables are shared, not rebuilt (they are most of a problem's cost): a
        planner that scores one layout under many cuts of a model builds it once."""
        n = self.num_stages
        if not len(f) == len(i) == len(w) == len(weight) == n or (b is not None and len(b) != n):
            raise ScheduleError(f"retimed needs {n} values per stage")
        if len(held_after_i) not in (0, n) or len(base) not in (0, self.num_ranks):
            raise ScheduleError(f"retimed needs {n} values per stage and {self.num_ranks} per rank")
        new = copy.copy(self)
        values = {
            "f": tuple(f),
            "i": tuple(i),
            "w": tuple(w),
            "b": tuple(x + y for x, y in zip(i, w, strict=True)) if b is None else tuple(b),
            "weight": tuple(weight),
            "limit": limit,
            "held_after_i": tuple(held_after_i),
            "base": tuple(base),
        }
        for name, value in values.items():
            object.__setattr__(new, name, value)
        object.__setattr__(new, "_tables", self.tables.retimed(new))
        return new

    def __post_init__(self) -> None:
        if len(self.held_after_i) not in (0, self.num_stages) or len(self.base) not in (0, self.num_ranks):
            raise ScheduleError(f"a problem needs {self.num_stages} values per stage and {self.num_ranks} per rank")
        object.__setattr__(self, "_tables", _Tables(self))

    @property
    def tables(self) -> _Tables:
        return self._tables  # type: ignore[attr-defined, no-any-return]

    # ------------------------------------------------------------------ codes
    def code(self, kind: int, stage: int, microbatch: int) -> int:
        m = self.num_microbatches
        return kind * self.num_stages * m + stage * m + microbatch

    def decode(self, code: int) -> tuple[int, int, int]:
        """(kind, stage, microbatch) of a code."""
        m = self.num_microbatches
        kind, rest = divmod(code, self.num_stages * m)
        stage, mb = divmod(rest, m)
        return kind, stage, mb

    def stages_of(self, rank: int) -> list[int]:
        return [s for s, r in enumerate(self.stage_to_rank) if r == rank]

    # ------------------------------------------------------------ conversion
    def orders_of(self, schedule: Schedule) -> Orders:
        """The compute orders of a schedule with this layout (OVERLAP_F_B pairs run as their parts)."""
        if dict(schedule.stage_to_rank) != dict(enumerate(self.stage_to_rank)):
            raise ScheduleError("the schedule's placement differs from the problem's")
        orders: Orders = [[] for _ in range(self.num_ranks)]
        for rank, program in schedule.actions.items():
            for action in program:
                if action is None:
                    continue
                for part in action.parts:
                    kind = _KIND_CODE.get(part.kind)
                    if kind is not None and part.microbatch is not None:
                        orders[rank].append(self.code(kind, part.stage, part.microbatch))
        return orders

    def to_schedule(self, orders: Orders, name: str = "Auto") -> Schedule:
        """A compute-only Schedule running ``orders``, laid out on steps so that every action sits
        right of what it waits for (the rank's previous action and its inputs)."""
        t = self.tables
        step_of = [-1] * t.num_slots
        pointers = [0] * self.num_ranks
        next_step = [0] * self.num_ranks
        grid: dict[int, list[Action | None]] = {r: [] for r in range(self.num_ranks)}
        left = sum(len(o) for o in orders)
        while left:
            moved = False
            for rank in range(self.num_ranks):
                program = orders[rank]
                k = pointers[rank]
                while k < len(program):
                    c = program[k]
                    d1, d2 = t.dep1[c], t.dep2[c]
                    if (d1 >= 0 and step_of[d1] < 0) or (d2 >= 0 and step_of[d2] < 0):
                        break
                    step = max(next_step[rank], step_of[d1] + 1 if d1 >= 0 else 0, step_of[d2] + 1 if d2 >= 0 else 0)
                    row = grid[rank]
                    row.extend([None] * (step - len(row)))
                    kind, stage, mb = self.decode(c)
                    row.append(Action(stage, _KINDS[kind], mb))
                    if t.out[c] >= 0:
                        step_of[t.out[c]] = step
                    next_step[rank] = step + 1
                    k += 1
                    left -= 1
                    moved = True
                pointers[rank] = k
            if not moved:
                raise ScheduleError("these orders deadlock; no schedule can run them")
        return Schedule(
            grid,
            num_stages=self.num_stages,
            num_microbatches=self.num_microbatches,
            stage_to_rank=dict(enumerate(self.stage_to_rank)),
            name=name,
        )

    # ------------------------------------------------------------ evaluation
    def makespan(self, orders: Orders) -> float:
        """Simulated makespan of ``orders`` (``inf`` when they deadlock); each action starts when
        its rank is free and its inputs have arrived."""
        return self.score(orders)[0]

    def score(self, orders: Orders) -> tuple[float, float]:
        """(makespan, sum of the ranks' finishing times): the second breaks ties in the search,
        preferring orders that leave ranks free earlier."""
        t = self.tables
        needs, dur, out = t.needs, t.dur, t.out
        times = [-1.0] * t.num_slots
        pointers = [0] * self.num_ranks
        free = [0.0] * self.num_ranks
        ranks = range(self.num_ranks)
        while True:
            moved = False
            for r in ranks:
                program = orders[r]
                k = pointers[r]
                n = len(program)
                if k == n:
                    continue
                start_k = k
                now = free[r]
                while k < n:
                    c = program[k]
                    for d, lat in needs[c]:
                        x = times[d]
                        if x < 0:
                            break  # an input is not there yet: the rank waits here
                        x += lat
                        if x > now:
                            now = x
                    else:
                        now += dur[c]
                        d = out[c]
                        if d >= 0:
                            times[d] = now
                        k += 1
                        continue
                    break
                if k != start_k:
                    moved = True
                    pointers[r] = k
                    free[r] = now
            if not moved:
                break
        for r in ranks:
            if pointers[r] != len(orders[r]):
                return INFEASIBLE, INFEASIBLE
        return max(free), sum(free)

    def starts(self, orders: Orders) -> list[list[float]]:
        """Each action's start time, per rank and position (orders must not deadlock)."""
        t = self.tables
        times = [-1.0] * t.num_slots
        out: list[list[float]] = [[0.0] * len(o) for o in orders]
        pointers = [0] * self.num_ranks
        free = [0.0] * self.num_ranks
        moved = True
        while moved:
            moved = False
            for r in range(self.num_ranks):
                program, k, now = orders[r], pointers[r], free[r]
                while k < len(program):
                    c = program[k]
                    ready = now
                    blocked = False
                    for d, lat in t.needs[c]:
                        if times[d] < 0:
                            blocked = True
                            break
                        ready = max(ready, times[d] + lat)
                    if blocked:
                        break
                    out[r][k] = ready
                    now = ready + t.dur[c]
                    if t.out[c] >= 0:
                        times[t.out[c]] = now
                    k += 1
                    moved = True
                pointers[r], free[r] = k, now
        return out

    def peak(self, program: Sequence[int], rank: int | None = None) -> float:
        """Peak memory of one rank's program, in the units of ``limit``: its held activations, plus
        what the rank holds throughout when ``rank`` is given."""
        delta = self.tables.delta
        held = peak = 0.0
        for c in program:
            held += delta[c]
            if held > peak:
                peak = held
        return peak + (self.base[rank] if rank is not None and self.base else 0.0)

    def least_memory(self) -> float:
        """The memory one microbatch alone needs on its busiest rank: no order can need less."""
        per_rank = list(self.base) if self.base else [0.0] * self.num_ranks
        for s, r in enumerate(self.stage_to_rank):
            per_rank[r] += self.weight[s]
        return max(per_rank)

    def fits(self, orders: Orders) -> bool:
        if self.limit is None:
            return True
        bound = self.limit + 1e-9
        return all(self.peak(program, r) <= bound for r, program in enumerate(orders))

    def complete(self, orders: Orders) -> bool:
        """Every (stage, microbatch) has F, its backward (B, or I and W) exactly once."""
        seen = sorted(c for program in orders for c in program)
        if len(seen) != len(set(seen)):
            return False
        sm = self.num_stages * self.num_microbatches
        per_pair = [0] * sm
        for c in seen:
            kind, rest = divmod(c, sm)
            per_pair[rest] |= 1 << kind
        return all(bits in (0b0111, 0b1001) for bits in per_pair)


class _Tables:
    """Per-code dependency slots, latencies, durations, outputs and memory deltas, from the
    dependency core (:mod:`pipetrain.plan.dependencies`) with this problem's costs."""

    __slots__ = ("delta", "dep1", "dep2", "dur", "lat1", "lat2", "needs", "num_slots", "out", "rank", "users")

    def __init__(self, p: Problem) -> None:
        n_st, n_mb = p.num_stages, p.num_microbatches
        deps = Dependencies(n_st, n_mb, p.stage_to_rank, lowered=False)
        self.dep1, self.dep2, cross1, cross2, self.out = deps.flat((C_F, C_I, C_W, C_B))
        self.lat1 = [p.comm if c else 0.0 for c in cross1]
        self.lat2 = [p.comm if c else 0.0 for c in cross2]
        # The same as one tuple of (slot, latency) per code, for the evaluation loops.
        self.needs: list[tuple[tuple[int, float], ...]] = [
            ((d1, l1), (d2, l2)) if d2 >= 0 else ((d1, l1),) if d1 >= 0 else ()
            for d1, l1, d2, l2 in zip(self.dep1, self.lat1, self.dep2, self.lat2, strict=True)
        ]
        sm = n_st * n_mb
        self.num_slots = 3 * sm  # the F, X and W products
        # The inverse, per kind and stage of the producer: the (kind, stage) of the actions that
        # wait for its product, the backward kinds first (templates: the microbatch is the same).
        self.users: list[list[list[tuple[int, int]]]] = [[[] for _ in range(n_st)] for _ in range(4)]
        for kind in (KIND_I, KIND_B, KIND_F, KIND_W):
            for s in range(n_st):
                for slot, _ in self.needs[kind * sm + s * n_mb]:
                    block, stage = divmod(slot // n_mb, n_st)
                    for producer in (KIND_I, KIND_B) if block == 1 else (block,):
                        self.users[producer][stage].append((kind, s))
        self._costs(p)

    def retimed(self, p: Problem) -> _Tables:
        """These tables with ``p``'s durations and memory weights (same layout and latency)."""
        new = copy.copy(self)
        new._costs(p)
        return new

    def _costs(self, p: Problem) -> None:
        n_st, n_mb = p.num_stages, p.num_microbatches
        self.dur, self.rank, self.delta = [], [], []
        a, g = p.weight, p.after_i
        # Memory: F takes the activation, I trades it for what W reads, W frees that, B the activation.
        deltas = ([a[s] for s in range(n_st)], [g[s] - a[s] for s in range(n_st)], [-x for x in g], [-x for x in a])
        for durations, delta in zip((p.f, p.i, p.w, p.b), deltas, strict=True):
            for s in range(n_st):
                self.dur += [durations[s]] * n_mb
                self.rank += [p.stage_to_rank[s]] * n_mb
                self.delta += [delta[s]] * n_mb
