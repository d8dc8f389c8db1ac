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
   first whose simulated peak fits is the plan. When none does, the microbatches run one at a
   time (the least any order holds) on the hand splits' and the min-max cuts, without recompute,
   with every stage recomputed and with each rank's cheapest choice, simulated: the fastest that
   fits is the plan; when none fits, the ScheduleError names the least of their peaks, a limit at
   which that plan is returned.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Sequence
from itertools import combinations

from pipetrain.plan.autoplan import construct, exact, windows_fit
from pipetrain.plan.autoplan.layout import one_at_a_time
from pipetrain.plan.errors import ScheduleError
from pipetrain.plan.pipeline.cuts import Cut, hand_splits, minmax_cut, sizes_of
from pipetrain.plan.pipeline.layers import format_bytes
from pipetrain.plan.pipeline.model import Profile, Vectors
from pipetrain.plan.pipeline.scoring import Scoring
from pipetrain.plan.pipeline.space import Candidate, HandSplit, Layout, layouts_for
from pipetrain.plan.simulate import simulate

__all__ = ["Candidate", "HandSplit", "Layout", "Search", "layouts_for"]

_EPS = 1e-9
_INF = math.inf
_PRELOAD_WORTH = 3.0  # seconds of time limit, at least, to spend one importing CP-SAT


# ------------------------------------------------------------------ search


class Search(Scoring):
    """One plan_pipeline call: :class:`~pipetrain.plan.pipeline.scoring.Scoring`'s state and
    evaluations, and the phases (climbs, construction, the check, the error when nothing fits)."""

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
        self.searched = list(searched)
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
        fits = [c for c in self.one_at_a_time() if _peak(c) <= self.limit + _EPS] if self.limit is not None else []
        return min(fits, key=lambda c: (c.makespan, _peak(c))) if fits else None

    def one_at_a_time(self) -> list[Candidate]:
        """The microbatches run one at a time (each rank holds one microbatch's activations at
        most: the least any order holds), on every searched layout's hand-split and min-max cuts
        (static bytes, time), without recompute, with every stage recomputed and with each rank's
        cheapest choice by the fast model; simulated (once per search)."""
        if self._alone is not None:
            return self._alone
        prof = self.profile
        out: list[Candidate] = []
        for layout in self.searched:
            n = layout.num_stages
            cuts = [cut for _, cut in hand_splits(_symbols(prof), prof.times, prof.static, n)]
            cuts += [c for c in (minmax_cut(prof.static, n, prof.times), minmax_cut(prof.times, n)) if c is not None]
            for cut in dict.fromkeys(cuts):
                sv = self.values(cut)
                cheapest = frozenset(s for r in range(self.P) for s in self.least_choice(layout, sv, r)[1])
                for recompute in dict.fromkeys((frozenset[int](), frozenset(range(n)), cheapest)):
                    problem = self.problem(layout, cut, recompute)
                    assert problem is not None
                    orders = one_at_a_time(problem)
                    cand = Candidate(
                        problem.makespan(orders), layout, cut, recompute, orders=orders, how="one at a time"
                    )
                    cand.schedule = layout.base.to_schedule(orders)
                    cand.result = simulate(cand.schedule, sv.costs(recompute, self.comm))
                    cand.makespan = cand.result.makespan
                    out.append(cand)
        self._alone = out
        return out

    # ------------------------------------------------------------ errors
    def nothing_fits(self, searched: Sequence[Layout]) -> ScheduleError:
        """Why no plan fits: static memory alone (naming the rank and its bytes), or static with
        one microbatch's activations (recompute everywhere) and the transient."""
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
        alone = self.one_at_a_time()
        if alone:
            least = min(alone, key=lambda c: (_peak(c), c.makespan))
            peaks = (least.result.peak_memory_bytes if least.result is not None else None) or {0: 0.0}
            r = max(peaks, key=lambda k: peaks[k])
            value = peaks[r]
            recomputed = f"recompute {sorted(least.recompute)}" if least.recompute else "no recompute"
            return ScheduleError(
                f"no plan fits {limit}: static memory fits, but with one microbatch's activations (the "
                f"microbatches one at a time), workspaces and message buffers the least found is "
                f"{format_bytes(value)} ({value:.0f} bytes) on rank {r} ({least.layout.label}, stage sizes "
                f"{sizes_of(least.cut)}, {recomputed}); with that limit a plan is returned. Give more memory "
                "or a smaller microbatch"
            )
        value, r, layout, cut = best_least
        return ScheduleError(
            f"no plan fits {limit}: static memory fits, but with one microbatch's activations (its "
            f"cheapest recompute choice), its largest workspace and message buffers rank {r} needs {format_bytes(value)} "
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


def _peak(cand: Candidate) -> float:
    """A simulated candidate's busiest rank's peak."""
    assert cand.result is not None
    return max((cand.result.peak_memory_bytes or {0: 0.0}).values())


def _caps(layout: Layout) -> list[list[Vectors]]:
    """Pseudo-orders holding at most c microbatches of each stage at once (c = 1 .. ranks), all
    before their I or all after it (whichever holds more), any stage acting: what list scheduling
    with a cap on microbatches in flight reaches, for the surrogate only."""
    out = []
    for c in range(1, layout.num_ranks + 1):
        per_rank: list[Vectors] = []
        for stages in layout.rank_stages:
            k = len(stages)
            splits = [
                tuple(c if not (bits >> j) & 1 else 0 for j in range(k))
                + tuple(c if (bits >> j) & 1 else 0 for j in range(k))
                for bits in range(1 << k)
            ]
            per_rank.append([(acting, vec) for acting in range(k) for vec in splits])
        out.append(per_rank)
    return out


def _even(n: int, stages: int) -> Cut:
    return tuple(round(k * n / stages) for k in range(stages + 1))


def _symbols(profile: Profile) -> list[str]:
    from pipetrain.plan.pipeline.cuts import layer_symbol

    return [layer_symbol(name) for name in profile.names]
