"""The state of one :mod:`pipetrain.plan.pipeline.search` and its fast evaluations: the memory
model per rank (recompute choice, message buffers), the scheduling problems of a cut, the
scores of named orders, the hand splits and the dynamic-program seeds."""

from __future__ import annotations

import math
import random
import time
from collections.abc import Iterable, Sequence

from pipetrain.plan.autoplan.problem import KIND_B, KIND_F, KIND_I, KIND_W, Orders, Problem
from pipetrain.plan.pipeline.cuts import Cut, sizes_of, traced_cut
from pipetrain.plan.pipeline.model import Profile, StageValues, Vectors, masks_of, vector_peak
from pipetrain.plan.pipeline.space import Candidate, HandSplit, Layout, Named
from pipetrain.plan.schedule import Schedule
from pipetrain.plan.simulate import SimResult, simulate

__all__ = ["Scoring"]

_EPS = 1e-9
_INF = math.inf
_WEIGHT_UNITS = 100_000  # a rank's budget in the construction's integer memory weights


class Scoring:
    """One plan_pipeline call's state (the profile, limit, caches and deadline) and its fast
    evaluations; :class:`~pipetrain.plan.pipeline.search.Search` adds the phases."""

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
        self.searched: list[Layout] = []  # the layouts the search plans on
        self._alone: list[Candidate] | None = None  # the microbatches one at a time (Search.one_at_a_time)
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
        base_time = sum(sv.least_time(s) for s in stages)
        static = sum(sv.static[s] for s in stages)
        margin = 0.0 if optimistic else self.margin(layout, sv, r)
        best: tuple[float, frozenset[int], float] | None = None
        for mask in masks_of(stages):
            t = base_time + sum(sv.f[s] for s in mask)  # (rebuilt once, in I or B)
            if best is not None and t > best[0] + _EPS:
                continue
            peak = vector_peak(vectors, _held(layout, sv, stages, mask), [sv.transient(s, mask) for s in stages])
            need = static + peak + margin
            if self.limit is not None and need > self.limit + _EPS:
                continue
            if best is None or t < best[0] - _EPS or need < best[2]:
                best = (t, mask, need)
        return best

    def least_need(self, layout: Layout, sv: StageValues, r: int) -> float:
        """The least memory rank ``r`` needs: one microbatch of each of its stages held (each
        backward as one B, so what W reads is never held beside it) with its largest transient,
        at the recompute choice that needs least (fast model)."""
        return self.least_choice(layout, sv, r)[0]

    def least_choice(self, layout: Layout, sv: StageValues, r: int) -> tuple[float, frozenset[int]]:
        """(:meth:`least_need`, the recompute set of rank ``r``'s stages that gives it)."""
        stages = layout.rank_stages[r]
        static = sum(sv.static[s] for s in stages) + self.margin(layout, sv, r)
        least: tuple[float, frozenset[int]] = (_INF, frozenset())
        for mask in masks_of(stages):
            held = sum(sv.held(s, mask) + (sv.inp[s] if layout.cross_in(s) else 0.0) for s in stages)
            need = static + held + sv.rank_transient(stages, mask)
            if need < least[0]:
                least = (need, mask)
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
        # (a recomputed stage rebuilds once, in I or B: StageValues.costs)
        extra = [sv.f[s] if s in recompute else 0.0 for s in range(n)]
        i = [sv.i[s] + extra[s] for s in range(n)]
        w = list(sv.w)
        b = [sv.b[s] + extra[s] for s in range(n)]
        held = _held(layout, sv, range(n), recompute)
        if not budgeted or self.limit is None:
            got = self._problems.get(key)
            if got is None:
                got = self._problems[key] = layout.base.retimed(f, i, w, held[:n], None, b, held_after_i=held[n:])
            return got
        # (The construction's problem holds a rank's largest transient throughout: it cannot place
        # one per action. What it returns is checked by fits() and simulate, which do.)
        weight, after_i = [0.0] * n, [0.0] * n
        for r, stages in enumerate(layout.rank_stages):
            static = sum(sv.static[s] for s in stages)
            budget = self.limit - static - sv.rank_transient(stages, recompute) - self.margin(layout, sv, r)
            if budget <= 0:
                return None
            for s in stages:
                weight[s] = float(math.ceil(held[s] / budget * _WEIGHT_UNITS - 1e-9))
                after_i[s] = float(math.ceil(held[n + s] / budget * _WEIGHT_UNITS - 1e-9))
        return layout.base.retimed(f, i, w, weight, float(_WEIGHT_UNITS), b, held_after_i=after_i)

    def fits(
        self, layout: Layout, cut: Cut, recompute: frozenset[int], orders: Orders, optimistic: bool = False
    ) -> bool:
        """Whether ``orders`` fit every rank's memory (fast model, :meth:`rank_needs`) with this
        recompute set."""
        if self.limit is None:
            return True
        needs = self.rank_needs(layout, cut, recompute, orders, optimistic)
        return all(need <= self.limit + _EPS for need in needs)

    def rank_needs(
        self, layout: Layout, cut: Cut, recompute: frozenset[int], orders: Orders, optimistic: bool = False
    ) -> list[float]:
        """Per rank, the memory ``orders`` need (fast model): static bytes, the most held while
        each action runs (before and after it) with its stage's transient, as
        :mod:`pipetrain.plan.memory` counts them, and the buffer margin (``optimistic``: none).
        Without message bytes this is ``simulate``'s peak."""
        sv = self.values(cut)
        n = layout.num_stages
        sm = n * self.M
        held = _held(layout, sv, range(n), recompute)
        transient = [sv.transient(s, recompute) for s in range(n)]
        needs: list[float] = []
        for r, program in enumerate(orders):
            now = peak = 0.0
            for code in program:
                kind, rest = divmod(code, sm)
                s = rest // self.M
                before = now
                if kind == KIND_F:
                    now += held[s]
                elif kind == KIND_I:
                    now += held[n + s] - held[s]
                elif kind == KIND_W:
                    now -= held[n + s]
                elif kind == KIND_B:
                    now -= held[s]
                peak = max(peak, max(before, now) + transient[s])
            static = sum(sv.static[s] for s in layout.rank_stages[r])
            needs.append(static + peak + (0.0 if optimistic else self.margin(layout, sv, r)))
        return needs

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
        self._record_hand_split(layout, rule, cut, best, closest)

    def _record_hand_split(
        self,
        layout: Layout,
        rule: str,
        cut: Cut,
        best: tuple[Named, SimResult, Schedule] | None,
        closest: tuple[float, Named, SimResult] | None,
    ) -> None:
        """The :class:`HandSplit` row for ``cut`` (its best named schedule that fits, else the one
        closest to fitting), and the baseline candidate when one fits."""
        schedule: Schedule | None = None
        if best is not None:
            named, result, schedule = best
        elif closest is not None:
            _, named, result = closest
        else:
            return
        fits = schedule is not None
        self.hand.append(
            HandSplit(
                rule,
                layout.v,
                layout.placement,
                tuple(sizes_of(cut)),
                named.name if fits else None,
                result.makespan,
                result.bubble,
                dict(result.peak_memory_bytes or {}),
                fits,
                closest="" if fits else named.name,
            )
        )
        if schedule is not None:
            cand = Candidate(
                result.makespan, layout, cut, frozenset(), named=named.name, how=f"hand split: {rule}, {named.name}"
            )
            cand.result, cand.schedule = result, schedule
            self.baseline.append(cand)

    def _need(self, layout: Layout, cut: Cut, named: Named) -> float:
        """The busiest rank's memory for ``named`` on ``cut`` without recompute (fast model)."""
        sv = self.values(cut)
        out = 0.0
        for r, stages in enumerate(layout.rank_stages):
            none = frozenset[int]()
            peak = vector_peak(
                named.vectors[r], _held(layout, sv, stages, none), [sv.transient(s, none) for s in stages]
            )
            need = sum(sv.static[s] for s in stages) + peak
            out = max(out, need + self.margin(layout, sv, r))
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
            counts = [vec for _, vec in vectors[s]]  # (held before I, after I) pairs
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
        return traced_cut(back, n, n_st)

    def _stage_time(self, a: int, b: int, s: int, n_st: int, counts: list[tuple[int, ...]]) -> float:
        """Time of layers a..b as stage s of n_st (one per rank) at its cheapest recompute choice
        that fits with ``counts`` held (pairs: before I ends, after I until W); inf if neither fits."""
        p = self.profile
        f = p.pf[b] - p.pf[a]
        t = f + min(p.pb[b] - p.pb[a], p.pi[b] - p.pi[a] + p.pw[b] - p.pw[a])
        if self.limit is None:
            return t
        static = p.ps[b] - p.ps[a] + p.workspace(a, b)  # with the transient every choice has
        act = p.pa[b] - p.pa[a]
        wgrad = p.pg[b] - p.pg[a]
        inp = p.out[a - 1] if a > 0 else 0.0
        msg = p.out[b - 1]
        margin = (2 * msg if s + 1 < n_st else 0.0) + inp
        recv = inp if a > 0 else 0.0

        def need(before_i: float) -> float:
            return static + margin + max(c[0] * (before_i + recv) + c[1] * (wgrad + recv) for c in counts)

        if need(act) <= self.limit + _EPS:
            return t
        if need(inp) + act <= self.limit + _EPS:  # recompute: holds its input, rebuilds in its backward
            return t + f
        return _INF


def _held(layout: Layout, sv: StageValues, stages: Iterable[int], recompute: frozenset[int]) -> list[float]:
    """What one microbatch of each of ``stages`` holds before its I (or B) ends, then after its I
    until W, each with the input it received from another rank (kept for its backward)."""
    listed = list(stages)
    recv = [sv.inp[s] if layout.cross_in(s) else 0.0 for s in listed]
    before = [sv.held(s, recompute) + x for s, x in zip(listed, recv, strict=True)]
    return before + [sv.held_after_i(s) + x for s, x in zip(listed, recv, strict=True)]
