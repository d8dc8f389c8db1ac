"""The search behind :func:`~pipetrain.plan.plan_pipeline`: cut, placement, recompute and order.

1. **Layouts.** Every number of stages per rank and placement allowed (by default 1 stage per
   rank, and 2 in a loop and in a V), each with the orders of every named schedule that builds
   for it (their per-rank counts of activations held at once, computed once).
2. **Hand splits** (:func:`~pipetrain.plan.pipeline.cuts.hand_splits`) at every layout, also 3
   and 4 stages per rank in a loop when the stages per rank are free: each with its best named
   schedule that fits, simulated. The best of them is the bar: the plan is never slower.
3. **Seeds.** The hand splits' cuts; with one stage per rank, for every named order, the cut that
   minimises the slowest stage subject to each rank's memory under that order, with the cheapest
   recompute choice per stage (a dynamic program over cuts, exact for its objective).
4. **Balance.** From each seed, hill climbing over cuts (a boundary moved by one or two layers)
   on a fast surrogate: the slowest rank's compute per microbatch (a V rank holds stages s and
   2P-1-s, a loop rank s, s+P, ...: the rank's sum is balanced, not the stages), after choosing
   per rank the recompute set (every subset of its stages) that fits its memory in the least time.
5. **Schedule.** From the best surrogate cuts, hill climbing on the simulated makespan of the
   best named order for each cut (the problem's dependency tables shared across cuts).
6. **Construct.** The best few (layout, cut, recompute) get the auto-scheduler's construction
   (:func:`pipetrain.plan.autoplan.construct`: list scheduling, periodic blocks, local search,
   CP-SAT where it fits), seeded with the named orders that fit, under each rank's own budget
   (memory limit - static - transient - buffer margin), expressed through per-stage weights.
   Where no named order fits any cut, this is what plans.
7. **Check.** Candidates best first are simulated with :func:`~pipetrain.plan.simulate` and the
   first whose simulated peak fits is the plan.
"""

from __future__ import annotations

import functools
import math
import random
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from itertools import combinations

from pipetrain.plan.autoplan import construct, exact, windows_fit
from pipetrain.plan.autoplan.problem import KIND_B, KIND_F, KIND_W, Orders, Problem
from pipetrain.plan.errors import ScheduleError
from pipetrain.plan.generators import build_schedule, family, schedule_names
from pipetrain.plan.generators._common import v_placement
from pipetrain.plan.pipeline.cuts import Cut, hand_splits, minmax_cut, sizes_of
from pipetrain.plan.pipeline.layers import format_bytes
from pipetrain.plan.pipeline.model import Profile, StageValues, Vectors, count_vectors, masks_of
from pipetrain.plan.schedule import Schedule
from pipetrain.plan.simulate import SimResult, simulate

__all__ = ["Candidate", "HandSplit", "Layout", "Search", "layouts_for"]

_EPS = 1e-9
_INF = math.inf
_WEIGHT_UNITS = 100_000  # a rank's budget in the construction's integer memory weights
_SEED_EXTRA_V = (3, 4)  # stages per rank tried as hand splits only (loop placement)
_PRELOAD_WORTH = 3.0  # seconds of time limit, at least, to spend one importing CP-SAT


# ------------------------------------------------------------------ layouts


@dataclass(frozen=True, eq=False)
class Named:
    """A named schedule's orders on a layout."""

    name: str
    orders: Orders
    vectors: list[Vectors]
    paired: bool  # holds OVERLAP_F_B pairs, which simulate times as one action


@dataclass(frozen=True, eq=False)
class Layout:
    """Stages per rank and placement, with the named schedules that build for them."""

    num_ranks: int
    num_microbatches: int
    v: int
    placement: str
    rank_of: tuple[int, ...]
    rank_stages: tuple[tuple[int, ...], ...]
    named: tuple[Named, ...]
    base: Problem

    @property
    def num_stages(self) -> int:
        return len(self.rank_of)

    @property
    def label(self) -> str:
        if self.v == 1:
            return "1 stage per rank"
        return f"{self.v} stages per rank, {'V' if self.placement == 'v' else 'loop'}"

    def cross_in(self, s: int) -> bool:
        return s > 0 and self.rank_of[s - 1] != self.rank_of[s]

    def cross_out(self, s: int) -> bool:
        return s + 1 < len(self.rank_of) and self.rank_of[s + 1] != self.rank_of[s]

    def schedule_of(self, name: str) -> Schedule:
        return build_schedule(name, self.num_ranks, self.num_microbatches, self.v)


@functools.lru_cache(maxsize=32)
def _layout(num_ranks: int, num_microbatches: int, v: int, placement: str, comm: float) -> Layout | None:
    if placement == "v":
        if v != 2:
            return None
        rank_of = tuple(v_placement(num_ranks)[s] for s in range(2 * num_ranks))
    else:
        rank_of = tuple(s % num_ranks for s in range(num_ranks * v))
    n = len(rank_of)
    rank_stages = tuple(tuple(s for s in range(n) if rank_of[s] == r) for r in range(num_ranks))
    one = (1.0,) * n
    base = Problem(num_ranks, num_microbatches, rank_of, one, one, one, (2.0,) * n, comm, one, None, placement)
    named: list[Named] = []
    seen: dict[tuple[tuple[int, ...], ...], int] = {}
    for name in schedule_names():
        fam = family(name)
        if name == "ForwardOnly" or fam.placement != placement:
            continue
        try:
            schedule = build_schedule(name, num_ranks, num_microbatches, v)
        except ScheduleError:
            continue
        if schedule.num_stages != n or any(schedule.stage_to_rank.get(s) != r for s, r in enumerate(rank_of)):
            continue
        orders = base.orders_of(schedule)
        key = tuple(tuple(o) for o in orders)
        paired = any(a is not None and a.sub_actions is not None for row in schedule.actions.values() for a in row)
        entry = Named(name, orders, count_vectors(base, orders, rank_stages), paired)
        if key in seen:
            # The same orders under two names: keep the single-stage family's (1F1B over Interleaved1F1B at v=1).
            k = seen[key]
            if fam.stages_per_rank == 1 and family(named[k].name).stages_per_rank != 1 and not paired:
                named[k] = entry
            continue
        seen[key] = len(named)
        named.append(entry)
    return Layout(num_ranks, num_microbatches, v, placement, rank_of, rank_stages, tuple(named), base)


def layouts_for(
    num_ranks: int,
    num_microbatches: int,
    num_layers: int,
    stages_per_rank: int | None,
    placement: str | None,
    comm: float,
) -> tuple[list[Layout], list[Layout]]:
    """(layouts searched, layouts tried only as hand splits) for these arguments."""
    if stages_per_rank is not None:
        choices = [stages_per_rank]
    elif placement == "v":
        choices = [2]
    else:
        choices = [1, 2]
    searched: list[Layout] = []
    for v in choices:
        places = [placement] if placement else (["loop", "v"] if v == 2 else ["loop"])
        for place in places:
            if place == "v" and v != 2:
                raise ScheduleError(f"placement 'v' needs 2 stages per rank, got stages_per_rank={v}")
            if num_layers < num_ranks * v:
                continue
            found = _layout(num_ranks, num_microbatches, v, place, comm)
            if found is not None:
                searched.append(found)
    extra: list[Layout] = []
    if stages_per_rank is None and placement in (None, "loop"):
        for v in _SEED_EXTRA_V:
            if num_layers >= num_ranks * v:
                found = _layout(num_ranks, num_microbatches, v, "loop", comm)
                if found is not None and found.named:
                    extra.append(found)
    return searched, extra


# ------------------------------------------------------------------ results


@dataclass(frozen=True)
class HandSplit:
    """A hand split (a peer's rule) on one layout, with its best named schedule that fits.

    ``schedule_name`` is None when no named schedule fits; ``makespan``, ``bubble`` and
    ``peak_memory_bytes`` then describe the named schedule that needs the least memory."""

    rule: str
    stages_per_rank: int
    placement: str
    sizes: tuple[int, ...]
    schedule_name: str | None
    makespan: float
    bubble: float
    peak_memory_bytes: dict[int, float]
    fits: bool
    closest: str = ""  # the named schedule needing least memory, when none fits

    @property
    def label(self) -> str:
        if self.stages_per_rank == 1:
            return "1 stage per rank"
        return f"{self.stages_per_rank} stages per rank, {'V' if self.placement == 'v' else 'loop'}"


@dataclass
class Candidate:
    """A plan the search found: its layout, cut, recompute set and orders (or named schedule)."""

    makespan: float  # by the fast evaluation (simulate's for named, unpaired orders)
    layout: Layout
    cut: Cut
    recompute: frozenset[int]
    named: str | None = None  # run this named schedule as built (else ``orders``)
    orders: Orders | None = None
    how: str = ""
    vectors: list[Vectors] | None = field(default=None, repr=False)  # of the named order used
    result: SimResult | None = field(default=None, repr=False)
    schedule: Schedule | None = field(default=None, repr=False)


# ------------------------------------------------------------------ search


class Search:
    """One plan_pipeline call's state: the profile, limit, caches and deadline."""

    def __init__(
        self,
        profile: Profile,
        num_ranks: int,
        num_microbatches: int,
        memory_limit: float | None,
        comm: float,
        deadline: float,
        time_limit: float,
        seed: int,
    ) -> None:
        self.profile = profile
        self.P = num_ranks
        self.M = num_microbatches
        self.limit = memory_limit
        self.comm = comm
        self.deadline = deadline
        self.time_limit = time_limit
        self.rng = random.Random(seed)
        self._values: dict[Cut, StageValues] = {}
        self._problems: dict[tuple[int, Cut, frozenset[int]], Problem] = {}
        self._true: dict[tuple[int, Cut], Candidate | None] = {}
        self.hand: list[HandSplit] = []
        self.baseline: list[Candidate] = []
        self.found: list[Candidate] = []
        self.hopeful: list[Candidate] = []  # fit the optimistic memory model only
        self.log: list[str] = []
        self._started = time.perf_counter()

    def note(self, phase: str) -> None:
        """Record the best fast makespan so far after ``phase`` (``PipelinePlan.notes``)."""
        pool = [*self.found, *self.baseline]
        best = min(pool, key=lambda c: c.makespan) if pool else None
        where = (
            f"best {best.makespan:.6g} ({best.layout.label}, {best.how})" if best is not None else "nothing fits yet"
        )
        self.log.append(f"{time.perf_counter() - self._started:6.2f} s  {phase}: {where}")

    # ---------------------------------------------------------------- values
    def values(self, cut: Cut) -> StageValues:
        got = self._values.get(cut)
        if got is None:
            got = self._values[cut] = StageValues.of(self.profile, cut)
        return got

    def left(self) -> float:
        return self.deadline - time.perf_counter()

    def margin(self, layout: Layout, sv: StageValues, r: int) -> float:
        """Message buffers beside the held activations on rank ``r``: one output being sent and
        one gradient received per stage whose next stage is on another rank, one gradient sent
        per stage whose input comes from another rank, and a gradient handed over in memory
        where two consecutive stages share the rank."""
        out = 0.0
        for s in layout.rank_stages[r]:
            if layout.cross_out(s):
                out += 2 * sv.msg[s]
            elif s + 1 < layout.num_stages:
                out += sv.msg[s]
            if layout.cross_in(s):
                out += 2 * sv.inp[s]
        return out

    def rank_choice(
        self,
        layout: Layout,
        sv: StageValues,
        r: int,
        vectors: Vectors,
        optimistic: bool = False,
    ) -> tuple[float, frozenset[int], float] | None:
        """(rank time, recompute set, peak bytes) of the fastest recompute set of rank ``r``'s
        stages whose memory fits under an order holding ``vectors``; None if none fits.
        ``optimistic`` leaves the message-buffer margin out: what it refuses cannot fit."""
        stages = layout.rank_stages[r]
        base_time = sum(sv.f[s] + sv.i[s] + sv.w[s] for s in stages)
        static = sum(sv.static[s] for s in stages)
        margin = 0.0 if optimistic else self.margin(layout, sv, r)
        best: tuple[float, frozenset[int], float] | None = None
        for mask in masks_of(stages):
            t = base_time + 2 * sum(sv.f[s] for s in mask)  # (rebuilt in I and in W)
            if best is not None and t > best[0] + _EPS:
                continue
            held = [sv.held(s, mask) + (sv.inp[s] if layout.cross_in(s) else 0.0) for s in stages]
            peak = max(sum(c * h for c, h in zip(vec, held, strict=True)) for vec in vectors)
            transient = max((sv.act[s] for s in mask), default=0.0)
            need = static + peak + transient + margin
            if self.limit is not None and need > self.limit + _EPS:
                continue
            if best is None or t < best[0] - _EPS or need < best[2]:
                best = (t, mask, need)
        return best

    def least_need(self, layout: Layout, sv: StageValues, r: int) -> float:
        """The least memory rank ``r`` needs: one microbatch of each of its stages held, at the
        recompute choice that needs least (fast model)."""
        stages = layout.rank_stages[r]
        static = sum(sv.static[s] for s in stages) + self.margin(layout, sv, r)
        least = _INF
        for mask in masks_of(stages):
            held = sum(sv.held(s, mask) + (sv.inp[s] if layout.cross_in(s) else 0.0) for s in stages)
            least = min(least, static + held + max((sv.act[s] for s in mask), default=0.0))
        return least

    def choose(
        self, layout: Layout, cut: Cut, vectors: Sequence[Vectors], optimistic: bool = False
    ) -> tuple[list[float], frozenset[int]] | None:
        """Per-rank times and the recompute set for an order holding ``vectors`` (None: no fit)."""
        sv = self.values(cut)
        times: list[float] = []
        chosen: set[int] = set()
        for r in range(self.P):
            got = self.rank_choice(layout, sv, r, vectors[r], optimistic=optimistic)
            if got is None:
                return None
            times.append(got[0])
            chosen |= got[1]
        return times, frozenset(chosen)

    def surrogate(self, layout: Layout, cut: Cut, options: Sequence[Sequence[Vectors]]) -> tuple[float, float, float]:
        """(slowest rank's time, sum of squares, 0) at the best of ``options`` (inf: none fits)."""
        best = (_INF, _INF, 0.0)
        for vectors in options:
            got = self.choose(layout, cut, vectors)
            if got is None:
                continue
            times = got[0]
            key = (max(times), sum(t * t for t in times), 0.0)
            if key < best:
                best = key
        return best

    # ------------------------------------------------------------ problems
    def problem(self, layout: Layout, cut: Cut, recompute: frozenset[int], budgeted: bool = False) -> Problem | None:
        """The scheduling problem of a cut (durations with recompute). ``budgeted``: memory weights
        are each stage's held bytes over its rank's budget (limit - static - transient - margin) in
        integer units of ``1/_WEIGHT_UNITS`` of it (rounded up), and the limit is that unit count;
        None when a rank has no budget left."""
        key = (id(layout), cut, recompute)
        sv = self.values(cut)
        n = layout.num_stages
        f = list(sv.f)
        # (a recomputed stage rebuilds in I and again in W: StageValues.costs)
        i = [sv.i[s] + (sv.f[s] if s in recompute else 0.0) for s in range(n)]
        w = [sv.w[s] + (sv.f[s] if s in recompute else 0.0) for s in range(n)]
        held = [sv.held(s, recompute) + (sv.inp[s] if layout.cross_in(s) else 0.0) for s in range(n)]
        if not budgeted or self.limit is None:
            got = self._problems.get(key)
            if got is None:
                got = self._problems[key] = layout.base.retimed(f, i, w, held, None)
            return got
        weight = [0.0] * n
        for r, stages in enumerate(layout.rank_stages):
            static = sum(sv.static[s] for s in stages)
            transient = max((sv.act[s] for s in stages if s in recompute), default=0.0)
            budget = self.limit - static - transient - self.margin(layout, sv, r)
            if budget <= 0:
                return None
            for s in stages:
                weight[s] = float(math.ceil(held[s] / budget * _WEIGHT_UNITS - 1e-9))
        return layout.base.retimed(f, i, w, weight, float(_WEIGHT_UNITS))

    def fits(
        self, layout: Layout, cut: Cut, recompute: frozenset[int], orders: Orders, optimistic: bool = False
    ) -> bool:
        """Whether ``orders`` fit every rank's memory (fast model) with this recompute set."""
        if self.limit is None:
            return True
        sv = self.values(cut)
        sm = layout.num_stages * self.M
        for r, program in enumerate(orders):
            stages = layout.rank_stages[r]
            held = {s: sv.held(s, recompute) + (sv.inp[s] if layout.cross_in(s) else 0.0) for s in stages}
            now = peak = 0.0
            for code in program:
                kind, rest = divmod(code, sm)
                if kind == KIND_F:
                    now += held[rest // self.M]
                    peak = max(peak, now)
                elif kind == KIND_W or kind == KIND_B:
                    now -= held[rest // self.M]
            static = sum(sv.static[s] for s in stages)
            transient = max((sv.act[s] for s in stages if s in recompute), default=0.0)
            margin = 0.0 if optimistic else self.margin(layout, sv, r)
            if static + peak + transient + margin > self.limit + _EPS:
                return False
        return True

    # ------------------------------------------------------------ scores
    def true_score(self, layout: Layout, cut: Cut) -> Candidate | None:
        """The best named order for this cut (each with its cheapest fitting recompute set),
        by the simulated makespan of its orders."""
        key = (id(layout), cut)
        if key in self._true:
            return self._true[key]
        best: Candidate | None = None
        hopeful: Candidate | None = None  # faster, fits only without the buffer margin: simulate decides
        for named in layout.named:
            for optimistic in (False, True):
                got = self.choose(layout, cut, named.vectors, optimistic=optimistic)
                if got is None:
                    continue
                recompute = got[1]
                problem = self.problem(layout, cut, recompute)
                assert problem is not None
                makespan = problem.makespan(named.orders)
                cand = Candidate(
                    makespan,
                    layout,
                    cut,
                    recompute,
                    named=None if named.paired else named.name,
                    orders=named.orders,
                    how=f"{named.name} order" + (" (pairs run one part after the other)" if named.paired else ""),
                    vectors=named.vectors,
                )
                if not optimistic:
                    if best is None or makespan < best.makespan - _EPS:
                        best = cand
                elif hopeful is None or makespan < hopeful.makespan - _EPS:
                    hopeful = cand
        if hopeful is not None and (best is None or hopeful.makespan < best.makespan - _EPS):
            self.hopeful.append(hopeful)
        self._true[key] = best
        return best

    # ------------------------------------------------------------ hand splits
    def hand_split(self, layout: Layout, rule: str, cut: Cut) -> None:
        """Every named schedule on this cut without recompute, simulated; the best that fits
        becomes a baseline candidate and a :class:`HandSplit` row."""
        sv = self.values(cut)
        costs = sv.costs(frozenset(), self.comm)
        problem = self.problem(layout, cut, frozenset())
        assert problem is not None
        ranked: list[tuple[float, Named]] = []
        least: tuple[float, Named] | None = None
        for named in layout.named:
            if self.fits(layout, cut, frozenset(), named.orders, optimistic=True):
                ranked.append((problem.makespan(named.orders), named))
            else:
                need = self._need(layout, cut, named)
                if least is None or need < least[0]:
                    least = (need, named)
        ranked.sort(key=lambda x: x[0])
        if not ranked and least is not None:
            ranked.append((0.0, least[1]))  # simulated for the closest miss it shows
        best: tuple[Named, SimResult, Schedule] | None = None
        closest: tuple[float, Named, SimResult] | None = None
        for _, named in ranked:
            schedule = layout.schedule_of(named.name)
            result = simulate(schedule, costs, check=False)
            peak = max((result.peak_memory_bytes or {0: 0.0}).values())
            if self.limit is None or peak <= self.limit + _EPS:
                if best is None or result.makespan < best[1].makespan - _EPS:
                    best = (named, result, schedule)
                if not named.paired:
                    break  # sorted by this makespan, which simulate reproduces for unpaired orders
            elif closest is None or peak < closest[0]:
                closest = (peak, named, result)
        sizes = tuple(sizes_of(cut))
        if best is not None:
            named, result, schedule = best
            self.hand.append(
                HandSplit(
                    rule,
                    layout.v,
                    layout.placement,
                    sizes,
                    named.name,
                    result.makespan,
                    result.bubble,
                    dict(result.peak_memory_bytes or {}),
                    True,
                )
            )
            cand = Candidate(
                result.makespan, layout, cut, frozenset(), named=named.name, how=f"hand split: {rule}, {named.name}"
            )
            cand.result, cand.schedule = result, schedule
            self.baseline.append(cand)
        elif closest is not None:
            _, named, result = closest
            self.hand.append(
                HandSplit(
                    rule,
                    layout.v,
                    layout.placement,
                    sizes,
                    None,
                    result.makespan,
                    result.bubble,
                    dict(result.peak_memory_bytes or {}),
                    False,
                    closest=named.name,
                )
            )

    def _need(self, layout: Layout, cut: Cut, named: Named) -> float:
        """The busiest rank's memory for ``named`` on ``cut`` without recompute (fast model)."""
        sv = self.values(cut)
        out = 0.0
        for r, stages in enumerate(layout.rank_stages):
            held = [sv.act[s] + (sv.inp[s] if layout.cross_in(s) else 0.0) for s in stages]
            peak = max(sum(c * h for c, h in zip(vec, held, strict=True)) for vec in named.vectors[r])
            out = max(out, sum(sv.static[s] for s in stages) + peak + self.margin(layout, sv, r))
        return out

    # ------------------------------------------------------------ seeds
    def dp_seed(self, layout: Layout, vectors: Sequence[Vectors]) -> Cut | None:
        """One stage per rank: the cut minimising the slowest stage (then the sum of squares),
        each stage at its cheapest recompute choice that fits its rank under ``vectors``."""
        assert layout.v == 1
        prof = self.profile
        n, n_st = prof.n, layout.num_stages
        inf = (_INF, _INF)
        best = [[inf] * (n + 1) for _ in range(n_st + 1)]
        back = [[0] * (n + 1) for _ in range(n_st + 1)]
        best[0][0] = (0.0, 0.0)
        for s in range(n_st):
            counts = max(vec[0] for vec in vectors[s])
            for i in range(s + 1, n - (n_st - s - 1) + 1):
                top, arg = inf, -1
                for j in range(s, i):
                    p = best[s][j]
                    if p[0] == _INF:
                        continue
                    t = self._stage_time(j, i, s, n_st, counts)
                    if t == _INF:
                        continue
                    cand = (max(p[0], t), p[1] + t * t)
                    if cand < top:
                        top, arg = cand, j
                best[s + 1][i] = top
                back[s + 1][i] = arg
        if best[n_st][n][0] == _INF:
            return None
        cut = [n]
        i = n
        for s in range(n_st, 0, -1):
            i = back[s][i]
            cut.append(i)
        return tuple(reversed(cut))

    def _stage_time(self, a: int, b: int, s: int, n_st: int, count: int) -> float:
        """Time of layers a..b as stage s of n_st (one per rank) at its cheapest recompute choice
        that fits with ``count`` activations held; inf if neither fits."""
        p = self.profile
        f = p.pf[b] - p.pf[a]
        t = f + p.pi[b] - p.pi[a] + p.pw[b] - p.pw[a]
        if self.limit is None:
            return t
        static = p.ps[b] - p.ps[a]
        act = p.pa[b] - p.pa[a]
        inp = p.out[a - 1] if a > 0 else 0.0
        msg = p.out[b - 1]
        margin = (2 * msg if s + 1 < n_st else 0.0) + inp
        recv = inp if a > 0 else 0.0
        if static + count * (act + recv) + margin <= self.limit + _EPS:
            return t
        if static + count * (inp + recv) + act + margin <= self.limit + _EPS:
            return t + f
        return _INF

    # ------------------------------------------------------------ climbing
    def climb(
        self,
        cut: Cut,
        score: Callable[[Cut], tuple[float, ...]],
        until: float,
        steps: Sequence[int] = (1, -1, 2, -2),
    ) -> tuple[Cut, tuple[float, ...]]:
        """First-improvement hill climbing over boundary moves (random order) until no move helps
        or ``until`` passes."""
        current = score(cut)
        n = cut[-1]
        improved = True
        while improved and time.perf_counter() < until:
            improved = False
            moves = [(k, d) for k in range(1, len(cut) - 1) for d in steps]
            self.rng.shuffle(moves)
            for k, d in moves:
                b = cut[k] + d
                if not (cut[k - 1] < b < cut[k + 1]) or b <= 0 or b >= n:
                    continue
                trial = (*cut[:k], b, *cut[k + 1 :])
                value = score(trial)
                if value < current:
                    cut, current = trial, value
                    improved = True
                    break
                if time.perf_counter() >= until:
                    break
        return cut, current

    # ------------------------------------------------------------ the whole search
    def run(self, searched: Sequence[Layout], extra: Sequence[Layout]) -> None:
        started = time.perf_counter()
        total = self.deadline - started
        seeds = self._hand_splits(searched, extra)
        self.note("hand splits")
        self._seeds(searched, seeds)
        # Small enough to try every cut (named orders, fast model) in a fifth of the time: do.
        exhausted = [layout for layout in searched if self._exhaustive(layout, started + 0.2 * total)]
        if exhausted:
            self.note("every cut")
        fitted = {id(c.layout) for c in self.found}
        climbing = [layout for layout in searched if layout not in exhausted or id(layout) not in fitted]
        climbed = self._balance(climbing, seeds, started + 0.15 * total)
        self.note("balanced cuts")
        self._schedule_climbs(climbing, seeds, climbed, started + 0.5 * total)
        self.note("cuts by simulated makespan")
        picks = self._construct_picks(searched, climbed)
        if picks:
            self._construct(picks)
            self.note("constructed orders")

    def _hand_splits(self, searched: Sequence[Layout], extra: Sequence[Layout]) -> dict[int, list[Cut]]:
        """Step 2: every hand split at every layout (always, whatever the time limit: they are
        the bar); returns the searched layouts' cuts as seeds."""
        prof = self.profile
        seeds: dict[int, list[Cut]] = {id(layout): [] for layout in searched}
        for layout in [*searched, *extra]:
            for rule, cut in hand_splits(_symbols(prof), prof.times, prof.static, layout.num_stages):
                self.hand_split(layout, rule, cut)
                if id(layout) in seeds:
                    seeds[id(layout)].append(cut)
        return seeds

    def _seeds(self, searched: Sequence[Layout], seeds: dict[int, list[Cut]]) -> None:
        """Step 3: the memory-aware DP per named order (one stage per rank), the min-max time cut."""
        prof = self.profile
        for layout in searched:
            if layout.v == 1:
                for vectors in [n.vectors for n in layout.named] + _caps(layout):
                    found = self.dp_seed(layout, vectors)
                    if found is not None:
                        seeds[id(layout)].append(found)
            cut = minmax_cut(prof.times, layout.num_stages, prof.static)
            if cut is not None:
                seeds[id(layout)].append(cut)

    def _balance(
        self, layouts: Sequence[Layout], seeds: dict[int, list[Cut]], until: float
    ) -> dict[int, list[tuple[tuple[float, ...], Cut]]]:
        """Step 4: surrogate climbs from every seed (best first per layout). A value starting
        with 0 fits under a named order, with 1 only under a capped one."""
        climbed: dict[int, list[tuple[tuple[float, ...], Cut]]] = {}
        for index, layout in enumerate(layouts):
            layout_until = time.perf_counter() + (until - time.perf_counter()) / (len(layouts) - index)
            score = self._surrogate_score(layout)
            results: list[tuple[tuple[float, ...], Cut]] = []
            unique = list(dict.fromkeys(seeds[id(layout)]))
            for k, cut in enumerate(unique):
                end, value = self.climb(
                    cut, score, time.perf_counter() + (layout_until - time.perf_counter()) / (len(unique) - k)
                )
                results.append((value, end))
            results.sort(key=lambda x: x[0])
            climbed[id(layout)] = results
            for value, cut in results[:2]:
                if value[0] == 0.0:
                    got = self.true_score(layout, cut)
                    if got is not None:
                        self.found.append(got)
        return climbed

    def _surrogate_score(self, layout: Layout) -> Callable[[Cut], tuple[float, ...]]:
        options: list[list[Vectors]] = [n.vectors for n in layout.named]
        fallback = _caps(layout)

        def score(cut: Cut) -> tuple[float, ...]:
            value = self.surrogate(layout, cut, options)
            if value[0] == _INF:
                return (1.0, *self.surrogate(layout, cut, fallback))
            return (0.0, *value)

        return score

    def _schedule_climbs(
        self,
        layouts: Sequence[Layout],
        seeds: dict[int, list[Cut]],
        climbed: dict[int, list[tuple[tuple[float, ...], Cut]]],
        until: float,
    ) -> None:
        """Step 5: climbs on the simulated makespan of the best named order, from the best
        balanced cuts and the seeds, best start first."""
        starts: list[tuple[Layout, Cut]] = []
        for layout in layouts:
            good = [cut for value, cut in climbed[id(layout)] if value[0] == 0.0]
            starts += [(layout, cut) for cut in list(dict.fromkeys(good))[:2]]
            starts += [(layout, cut) for cut in dict.fromkeys(seeds[id(layout)]) if self.true_score(layout, cut)]
        ordered = self._by_true(starts)
        for k, (layout, cut) in enumerate(ordered):
            share = (until - time.perf_counter()) / max(1, min(len(ordered) - k, 4))
            end, _ = self.climb(cut, self._true_key(layout), time.perf_counter() + share, steps=(1, -1))
            got = self.true_score(layout, end)
            if got is not None:
                self.found.append(got)
            if time.perf_counter() >= until:
                break

    def _true_key(self, layout: Layout) -> Callable[[Cut], tuple[float, ...]]:
        def key(cut: Cut) -> tuple[float, ...]:
            got = self.true_score(layout, cut)
            if got is None or got.vectors is None:
                return (_INF,)
            return (got.makespan, self.surrogate(layout, cut, [got.vectors])[1])

        return key

    def _exhaustive(self, layout: Layout, until: float) -> bool:
        """Score every cut of this layout if the estimate says it ends by ``until``."""
        n, stages = self.profile.n, layout.num_stages
        count = math.comb(n - 1, stages - 1)
        if count > 50_000:
            return False
        probe = time.perf_counter()
        sample = [_even(n, stages)]
        for cut in sample:
            self.true_score(layout, cut)
        each = (time.perf_counter() - probe) / len(sample)
        if time.perf_counter() + 1.5 * each * count > until:
            return False
        for inner in combinations(range(1, n), stages - 1):
            got = self.true_score(layout, (0, *inner, n))
            if got is not None:
                self.found.append(got)
        return True

    def _by_true(self, starts: list[tuple[Layout, Cut]]) -> list[tuple[Layout, Cut]]:
        scored = []
        for layout, cut in dict.fromkeys(starts):
            got = self.true_score(layout, cut)
            if got is not None:
                scored.append((got.makespan, layout.num_stages, layout, cut))
        scored.sort(key=lambda x: (x[0], x[1]))
        return [(layout, cut) for _, _, layout, cut in scored]

    def _construct_picks(
        self, searched: Sequence[Layout], climbed: dict[int, list[tuple[tuple[float, ...], Cut]]]
    ) -> list[tuple[Layout, Cut, frozenset[int]]]:
        picks: list[tuple[Layout, Cut, frozenset[int]]] = []
        ranked = sorted([*self.found, *self.baseline], key=lambda c: c.makespan)
        seen: set[tuple[int, Cut, frozenset[int]]] = set()
        searched_ids = {id(layout) for layout in searched}
        for cand in ranked:
            key = (id(cand.layout), cand.cut, cand.recompute)
            if key in seen or id(cand.layout) not in searched_ids:
                continue
            seen.add(key)
            picks.append((cand.layout, cand.cut, cand.recompute))
            if len(picks) >= 2:
                break
        if not picks:  # nothing named fits: capped orders (list scheduling with few in flight)
            options: list[tuple[tuple[float, ...], Layout, Cut, frozenset[int]]] = []
            for layout in searched:
                for value, cut in climbed.get(id(layout), [])[:2]:
                    if value[0] != 1.0 or value[1] == _INF:
                        continue
                    for vectors in reversed(_caps(layout)):
                        got = self.choose(layout, cut, vectors)
                        if got is not None:
                            options.append((value[1:], layout, cut, got[1]))
                            break
            options.sort(key=lambda x: (x[0], x[1].num_stages))
            picks = [(layout, cut, rec) for _, layout, cut, rec in options[:2]]
        return picks

    def _construct(self, picks: list[tuple[Layout, Cut, frozenset[int]]]) -> None:
        reserve = min(0.1 * self.time_limit, 1.0)
        end = self.deadline - reserve
        problems = []
        for layout, cut, recompute in picks:
            problem = self.problem(layout, cut, recompute, budgeted=True)
            if problem is not None:
                problems.append((layout, cut, recompute, problem))
        if not problems:
            return
        if self.time_limit >= _PRELOAD_WORTH and not exact.ready() and any(windows_fit(p[3]) for p in problems):
            exact.preload()
        for index, (layout, cut, recompute, problem) in enumerate(problems):
            left = end - time.perf_counter()
            if left <= 0.02:
                break
            share = left / (len(problems) - index)
            seeds = [n.orders for n in layout.named if problem.fits(n.orders)]
            got = construct(problem, seeds, time.perf_counter() + share, self.rng)
            if got is None:
                continue
            orders, _ = got
            timed = self.problem(layout, cut, recompute)
            assert timed is not None
            self.found.append(
                Candidate(timed.makespan(orders), layout, cut, recompute, orders=orders, how="constructed order")
            )

    # ------------------------------------------------------------ the answer
    def best_verified(self) -> Candidate | None:
        """Candidates best first, simulated; the first whose simulated peak fits."""
        pool = sorted(
            [*self.found, *self.hopeful, *self.baseline],
            key=lambda c: (c.makespan, c.layout.num_stages, len(c.recompute)),
        )
        bar = min((c.makespan for c in self.baseline), default=_INF)
        tried: set[tuple[int, Cut, frozenset[int], str | None, int]] = set()
        checked = 0
        for cand in pool:
            key = (id(cand.layout), cand.cut, cand.recompute, cand.named, id(cand.orders))
            if key in tried:
                continue
            tried.add(key)
            if cand.result is None:
                if cand.makespan > bar + _EPS:
                    continue  # a verified baseline is at least as fast
                if checked >= 12 and time.perf_counter() > self.deadline and self.baseline:
                    continue  # out of time: the verified baselines stand
                checked += 1
                schedule = (
                    cand.layout.schedule_of(cand.named)
                    if cand.named is not None
                    else cand.layout.base.to_schedule(cand.orders or [])
                )
                costs = self.values(cand.cut).costs(cand.recompute, self.comm)
                result = simulate(schedule, costs)
                cand.result, cand.schedule = result, schedule
            result = cand.result
            peak = max((result.peak_memory_bytes or {0: 0.0}).values())
            if self.limit is None or peak <= self.limit + _EPS:
                return cand
        return None

    # ------------------------------------------------------------ errors
    def nothing_fits(self, searched: Sequence[Layout]) -> ScheduleError:
        """Why no plan fits: static memory alone (naming the rank and its bytes), or static with
        one microbatch's activations (recompute everywhere)."""
        assert self.limit is not None
        best_static: tuple[float, int, Layout, Cut] | None = None
        best_least: tuple[float, int, Layout, Cut] | None = None
        for layout in searched:
            cut = self._least_static_cut(layout)
            sv = self.values(cut)
            statics = [sum(sv.static[s] for s in stages) for stages in layout.rank_stages]
            r = max(range(self.P), key=lambda k: statics[k])
            if best_static is None or statics[r] < best_static[0]:
                best_static = (statics[r], r, layout, cut)
            needs = [self.least_need(layout, sv, k) for k in range(self.P)]
            r2 = max(range(self.P), key=lambda k: needs[k])
            if best_least is None or needs[r2] < best_least[0]:
                best_least = (needs[r2], r2, layout, cut)
        assert best_static is not None and best_least is not None
        limit = f"memory_limit {format_bytes(self.limit)} ({self.limit:.0f} bytes)"
        value, r, layout, cut = best_static
        if value > self.limit + _EPS:
            first, last = self._rank_layers(layout, cut, r)
            return ScheduleError(
                f"static memory alone does not fit {limit}: even the cut that balances static bytes best "
                f"({layout.label}) leaves rank {r} with {format_bytes(value)} ({value:.0f} bytes) of parameters, "
                f"gradients and optimizer state (layers {first} to {last})"
            )
        value, r, layout, cut = best_least
        return ScheduleError(
            f"no plan fits {limit}: static memory fits, but with one microbatch's activations (its "
            f"cheapest recompute choice) and message buffers rank {r} needs {format_bytes(value)} "
            f"({value:.0f} bytes) on the best cut found ({layout.label}); give more memory or a smaller microbatch"
        )

    def _least_static_cut(self, layout: Layout) -> Cut:
        prof = self.profile
        cut = minmax_cut(prof.static, layout.num_stages, prof.times)
        assert cut is not None
        if layout.v == 1:
            return cut

        def score(c: Cut) -> tuple[float, ...]:
            sv = self.values(c)
            statics = sorted((sum(sv.static[s] for s in stages) for stages in layout.rank_stages), reverse=True)
            return tuple(statics)

        return self.climb(cut, score, time.perf_counter() + 0.2)[0]

    def _rank_layers(self, layout: Layout, cut: Cut, r: int) -> tuple[str, str]:
        names = self.profile.names
        held = [k for s in layout.rank_stages[r] for k in range(cut[s], cut[s + 1])]
        return names[min(held)], names[max(held)]


def _caps(layout: Layout) -> list[list[Vectors]]:
    """Pseudo-orders holding at most c activations of each stage at once (c = 1 .. ranks): what
    list scheduling with a cap on microbatches in flight reaches, for the surrogate only."""
    out = []
    for c in range(1, layout.num_ranks + 1):
        out.append([[tuple([c] * len(stages))] for stages in layout.rank_stages])
    return out


def _even(n: int, stages: int) -> Cut:
    return tuple(round(k * n / stages) for k in range(stages + 1))


def _symbols(profile: Profile) -> list[str]:
    from pipetrain.plan.pipeline.cuts import layer_symbol

    return [layer_symbol(name) for name in profile.names]
