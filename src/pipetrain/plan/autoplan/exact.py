"""Exact solving with CP-SAT (ortools, the optional ``solver`` extra): the yardstick for the
benchmarks, and, when ortools is installed, the planner's last step (:func:`improve_windows`).

One interval per action (F, I, W of every stage and microbatch) with its duration, no overlap on a
rank, the dependency rules with the message latency between ranks, and a cumulative resource
per rank for memory, counted as ``simulate`` counts it: an activation from the start of its F to
the end of its I, then what W reads until W's end; where W reads more than the activation, the
backward may run as one B (W right after I), which holds the activation alone. Microbatches are
interchangeable, so they enter the first stage in order (a symmetry cut that keeps an optimum).
Durations are scaled to integers (``scale``); problems whose durations or weights are not
multiples of ``1/scale`` are left to the heuristic. The planner never needs ortools.
"""

from __future__ import annotations

import importlib.util
import random
import sys
import time
from dataclasses import dataclass
from typing import Any

from pipetrain.plan.autoplan.problem import KIND_B, KIND_F, KIND_I, KIND_W, Orders, Problem

__all__ = [
    "Exact",
    "available",
    "improve_windows",
    "preload",
    "ready",
    "solvable",
    "solve",
    "solved_whole_first",
    "split_backward",
]

_EPS = 1e-9
_WINDOW_ACTIONS = 100  # a first window holds about this many actions; then it adapts
_WINDOW_SECONDS = 0.4  # CP-SAT's time for one window, at most
_WHOLE_FIRST_ACTIONS = 400  # up to this many actions, the whole problem is solved first ...
_WHOLE_FIRST_SHARE = 0.8  # ... with this share of the time (then windows refine its answer)
_COARSE_SHARE = 0.4  # of that time, first for the coarse model where W holds other bytes


def available() -> bool:
    """Whether ortools is installed."""
    return importlib.util.find_spec("ortools") is not None


def preload() -> None:
    """Import CP-SAT now: about a second from a cold start, once a process. The planner does it
    only when its time limit can spare that; :func:`ready` says whether it is there."""
    importlib.import_module("ortools.sat.python.cp_model")


def ready() -> bool:
    """Whether CP-SAT is imported (else the planner polishes by local search)."""
    return "ortools.sat.python.cp_model" in sys.modules


def solvable(problem: Problem, scale: int = 10) -> bool:
    """Whether the exact model can state ``problem`` (integer ticks and weights)."""
    values = [*problem.f, *problem.i, *problem.w, problem.comm]
    if any(abs(round(x * scale) - x * scale) > 1e-6 for x in values):
        return False
    if problem.limit is not None and any(abs(round(a) - a) > 1e-9 for a in (*problem.weight, *problem.after_i)):
        return False
    return True


@dataclass(frozen=True)
class Exact:
    """The solver's best makespan, whether it is proven optimal, its lower bound, and the orders."""

    makespan: float
    optimal: bool
    lower_bound: float
    seconds: float
    orders: Orders | None


class _Model:
    """The CP-SAT model of ``problem``: start and end variables per action code, the makespan."""

    def __init__(self, problem: Problem, scale: int, coarse: bool = False) -> None:
        """``coarse``: each (stage, microbatch) holds the most it ever holds from its F's start to
        its W's end (a smaller model whose solutions all fit; see :func:`_coarse_start`)."""
        self.cp_model: Any = importlib.import_module("ortools.sat.python.cp_model")
        self.problem = problem
        self.scale = scale
        self.coarse = coarse
        n_st, n_mb, n_rk = problem.num_stages, problem.num_microbatches, problem.num_ranks
        t = problem.tables
        model = self.cp_model.CpModel()
        ticks = self.ticks
        horizon = sum(
            ticks(t.dur[problem.code(k, s, m)])
            for k in (KIND_F, KIND_I, KIND_W)
            for s in range(n_st)
            for m in range(n_mb)
        )
        horizon += ticks(problem.comm) * 2 * n_st * n_mb + 1
        self.horizon = horizon
        start: dict[int, Any] = {}
        end: dict[int, Any] = {}
        self.fused: dict[int, Any] = {}  # I code -> "runs as one B with its W" (where W reads more)
        per_rank: list[list[Any]] = [[] for _ in range(n_rk)]
        # (how long, first code, whether from its start (else its end), last code) per held interval
        self.held: list[tuple[Any, int, bool, int]] = []
        for k in (KIND_F, KIND_I, KIND_W):
            for s in range(n_st):
                for m in range(n_mb):
                    c = problem.code(k, s, m)
                    d = ticks(t.dur[c])
                    st = model.new_int_var(0, horizon, f"s{c}")
                    en = model.new_int_var(0, horizon, f"e{c}")
                    per_rank[t.rank[c]].append(model.new_interval_var(st, d, en, f"i{c}"))
                    start[c], end[c] = st, en
        # What each action waits for is the dependency core's rule (the problem's tables); a product
        # slot is numbered as the F or I code that makes it.
        if problem.limit is not None and not coarse:  # where W reads more than the activation, one B may hold less
            for s in range(n_st):
                as_parts = abs(problem.b[s] - problem.i[s] - problem.w[s]) < _EPS  # (B is timed as I then W)
                if problem.after_i[s] > problem.weight[s] + _EPS and as_parts:
                    for m in range(n_mb):
                        i = problem.code(KIND_I, s, m)
                        self.fused[i] = fused = model.new_bool_var(f"b{i}")
                        model.add(start[i + (KIND_W - KIND_I) * n_st * n_mb] == end[i]).only_enforce_if(fused)
        for c in start:
            for slot, latency in t.needs[c]:
                model.add(start[c] >= end[slot] + ticks(latency))
                w = slot + (KIND_W - KIND_I) * n_st * n_mb
                if slot in self.fused and c != w:  # a B hands its gradient on at its end, after its W part
                    model.add(start[c] >= end[w] + ticks(latency)).only_enforce_if(self.fused[slot])
        for m in range(n_mb - 1):
            model.add(start[problem.code(KIND_F, 0, m)] <= start[problem.code(KIND_F, 0, m + 1)])
        for r in range(n_rk):
            model.add_no_overlap(per_rank[r])
        if problem.limit is not None:
            for r in range(n_rk):
                self._memory(model, r, start, end, horizon)
        makespan = model.new_int_var(0, horizon, "makespan")
        model.add_max_equality(makespan, list(end.values()))
        model.minimize(makespan)
        self.model, self.start, self.end, self.makespan = model, start, end, makespan
        self.per_rank_codes = [[c for c in start if t.rank[c] == r] for r in range(n_rk)]

    def _memory(self, model: Any, rank: int, start: dict[int, Any], end: dict[int, Any], horizon: int) -> None:
        """The rank's room as a cumulative resource over what each (stage, microbatch) holds."""
        problem = self.problem
        intervals: list[Any] = []
        demands: list[int] = []

        def held(first: int, from_start: bool, last: int, demand: int, present: Any = None) -> None:
            size = model.new_int_var(0, horizon, "")
            begin = start[first] if from_start else end[first]
            if present is None:
                intervals.append(model.new_interval_var(begin, size, end[last], ""))
            else:
                intervals.append(model.new_optional_interval_var(begin, size, end[last], present, ""))
            self.held.append((size, first, from_start, last))
            demands.append(demand)

        for s in problem.stages_of(rank):
            a, g = round(problem.weight[s]), round(problem.after_i[s])
            assert abs(a - problem.weight[s]) < _EPS and abs(g - problem.after_i[s]) < _EPS, "integer weights only"
            for m in range(problem.num_microbatches):
                f, i, w = (problem.code(k, s, m) for k in (KIND_F, KIND_I, KIND_W))
                if a == g or self.coarse:
                    held(f, True, w, max(a, g))
                    continue
                held(f, True, i, a)
                fused = self.fused.get(i)
                if fused is None:  # one B would hold no less (or is not timed as its parts)
                    held(i, False, w, g)
                    continue
                held(i, False, w, g, ~fused)
                held(i, False, w, a, fused)
        room = problem.room(rank)
        assert room is not None
        model.add_cumulative(intervals, demands, max(0, int(room + 1e-9)))

    def ticks(self, x: float) -> int:
        value = round(x * self.scale)
        assert abs(value - x * self.scale) < 1e-6, f"duration {x} is not a multiple of 1/{self.scale}"
        return value

    def hint(self, model: Any, orders: Orders, rank_end: list[Any] | None = None) -> None:
        """A complete hint: every start and end of ``orders`` as simulated (a B as its I then its
        W), and their makespan."""
        t = self.problem.tables
        last = 0
        starts = self.problem.starts(orders)
        at: dict[int, int] = {}
        whole_b: set[int] = set()
        for r, program in enumerate(orders):
            finish = 0
            for c, st in self.parts(program, starts[r]):
                if c in self.start:
                    s_ticks = round(st * self.scale)
                    e_ticks = s_ticks + self.ticks(t.dur[c])
                    model.add_hint(self.start[c], s_ticks)
                    model.add_hint(self.end[c], e_ticks)
                    at[c] = s_ticks
                    finish = max(finish, e_ticks)
            whole_b.update(self.i_of_b(c) for c in program if self._is_b(c))
            if rank_end is not None:
                model.add_hint(rank_end[r], finish)
            last = max(last, finish)
        model.add_hint(self.makespan, last)
        for size, first, from_start, w in self.held:
            if first in at and w in at:
                begin = at[first] + (0 if from_start else self.ticks(t.dur[first]))
                model.add_hint(size, at[w] + self.ticks(t.dur[w]) - begin)
        for i, fused in self.fused.items():
            model.add_hint(fused, i in whole_b)

    def _is_b(self, code: int) -> bool:
        return code // (self.problem.num_stages * self.problem.num_microbatches) == KIND_B

    def i_of_b(self, code: int) -> int:
        return code - (KIND_B - KIND_I) * self.problem.num_stages * self.problem.num_microbatches

    def parts(self, program: list[int], starts: list[float]) -> list[tuple[int, float]]:
        """(code, start) of ``program``'s actions, a B as its I and then its W."""
        out: list[tuple[int, float]] = []
        sm = self.problem.num_stages * self.problem.num_microbatches
        dur = self.problem.tables.dur
        for c, st in zip(program, starts, strict=True):
            if c // sm == KIND_B:
                i = self.i_of_b(c)
                out += [(i, st), (i + (KIND_W - KIND_I) * sm, st + dur[i])]
            else:
                out.append((c, st))
        return out

    def orders(self, solver: Any) -> Orders:
        """The solution's orders: each rank's actions by start, a fused I and W as one B."""
        t = self.problem.tables
        sm = self.problem.num_stages * self.problem.num_microbatches
        fused_w = {i + (KIND_W - KIND_I) * sm for i, z in self.fused.items() if solver.value(z)}
        orders: Orders = []
        for r in range(self.problem.num_ranks):
            codes = [c for c in self.start if t.rank[c] == r and c not in fused_w]
            codes.sort(key=lambda c: (solver.value(self.start[c]), solver.value(self.end[c]), c))
            orders.append([c + (KIND_B - KIND_I) * sm if c + (KIND_W - KIND_I) * sm in fused_w else c for c in codes])
        return orders


def solve(
    problem: Problem,
    hint: Orders | None = None,
    time_limit: float = 60.0,
    scale: int = 10,
    workers: int = 2,
    at_most: float | None = None,
) -> Exact:
    """Minimise the makespan of ``problem`` within ``time_limit`` seconds. ``at_most``: only
    makespans up to it are sought (another layout's optimum: a smaller search); where none is, the
    result has no orders and a lower bound just above it."""
    built = _Model(problem, scale)
    cp_model = built.cp_model
    if hint is not None:
        built.hint(built.model, hint)
    if at_most is not None:
        built.model.add(built.makespan <= built.ticks(at_most))
    solver = cp_model.CpSolver()
    solver.parameters.max_time_in_seconds = time_limit
    solver.parameters.num_workers = workers
    status = solver.solve(built.model)
    if status == cp_model.INFEASIBLE and at_most is not None:
        return Exact(float("inf"), False, at_most + 1 / scale, solver.wall_time, None)
    if status not in (cp_model.OPTIMAL, cp_model.FEASIBLE):
        return Exact(float("inf"), False, solver.best_objective_bound / scale, solver.wall_time, None)
    return Exact(
        solver.objective_value / scale,
        status == cp_model.OPTIMAL,
        solver.best_objective_bound / scale,
        solver.wall_time,
        built.orders(solver),
    )


def split_backward(problem: Problem, orders: Orders) -> Orders:
    """``orders`` with every B run as its I then its W (same times; the same memory, or less,
    except where W reads more than the activation: such a B is kept)."""
    sm = problem.num_stages * problem.num_microbatches
    n_mb = problem.num_microbatches
    after_i, weight = problem.after_i, problem.weight
    out: Orders = []
    for program in orders:
        split: list[int] = []
        for c in program:
            if c // sm == KIND_B and after_i[(c % sm) // n_mb] <= weight[(c % sm) // n_mb] + _EPS:
                split += [c - (KIND_B - KIND_I) * sm, c - (KIND_B - KIND_W) * sm]
            else:
                split.append(c)
        out.append(split)
    return out


def solved_whole_first(problem: Problem) -> bool:
    """Whether :func:`improve_windows` starts by solving all of ``problem`` at once (a small one)."""
    return 3 * problem.num_stages * problem.num_microbatches <= _WHOLE_FIRST_ACTIONS


def _coarse_start(problem: Problem, best: Orders, deadline: float, scale: int) -> Orders | None:
    """Where W reads less than the activation, the exact model has twice the memory intervals:
    CP-SAT first solves the coarse model, each (stage, microbatch) holding its activation until
    its W ends, whose answers fit and make a better start (4 x 2 x 6 with W reading half: 49.8
    where the exact model alone found 51.8 in the same time). None where that does not apply or
    nothing better is found."""
    pairs = list(zip(problem.weight, problem.after_i, strict=True))
    if all(abs(a - g) < _EPS for a, g in pairs) or any(g > a + _EPS for a, g in pairs):
        return None  # the same model, or one that holds what W reads from F on (too coarse: 4 x 2 x 6 at 1.5x, 46.6 for 45.8)
    coarse = _Model(problem, scale, coarse=True)
    coarse.hint(coarse.model, best)
    solver = coarse.cp_model.CpSolver()
    solver.parameters.max_time_in_seconds = max(0.01, deadline - time.perf_counter())
    solver.parameters.num_workers = 2
    if solver.solve(coarse.model) not in (coarse.cp_model.OPTIMAL, coarse.cp_model.FEASIBLE):
        return None
    found = coarse.orders(solver)
    if problem.fits(found) and problem.makespan(found) < problem.makespan(best) - _EPS:
        return found
    return None


def improve_windows(
    problem: Problem, orders: Orders, deadline: float, rng: random.Random, scale: int = 10
) -> tuple[Orders, tuple[float, float]]:
    """Large-neighbourhood search: repeatedly re-solve one window of time exactly.

    Actions that start before the window keep their start times, those after it keep their order
    on their rank (but may move in time), and CP-SAT reorders the window's actions freely, lowest
    makespan first, then the sum of the ranks' finishing times (a small problem is first solved
    whole, for the makespan alone, with most of the time). Returns orders never worse than
    ``orders`` (backwards split into I and W, or one B where W reads more than the activation)
    and their score; ``orders`` must fit."""
    best = split_backward(problem, orders)
    best_score = problem.score(best)
    built = _Model(problem, scale)
    cp_model, base = built.cp_model, built.model
    n_rk = problem.num_ranks
    # Lexicographic objective: the makespan, then the sum of the ranks' finishing times.
    rank_end = [base.new_int_var(0, built.horizon, f"r{r}") for r in range(n_rk)]
    for r in range(n_rk):
        base.add_max_equality(rank_end[r], [built.end[c] for c in built.per_rank_codes[r]])
    base.minimize(built.makespan * (n_rk * built.horizon + 1) + sum(rank_end))
    total = sum(len(o) for o in best)
    share = min(1.0, _WINDOW_ACTIONS / max(1, total))  # of the makespan a window spans
    # A small problem is first solved whole, from the hint: windows cannot move what tight memory
    # ties across the whole run (a 4 x 2 x 8 case: 73 whole against 75 by windows).
    whole_first = share < 1.0 and solved_whole_first(problem)
    overrun = 0.15  # how far past its time limit a solve may run (CP-SAT's presolve, under load)
    if whole_first and problem.limit is not None:
        now = time.perf_counter()
        start = _coarse_start(problem, best, now + _COARSE_SHARE * max(0.0, deadline - now - overrun), scale)
        if start is not None:
            best, best_score = start, problem.score(start)
    while True:
        left = deadline - time.perf_counter()
        if left < 0.1 + overrun:
            break
        starts = problem.starts(best)
        span = best_score[0]
        whole = share >= 1.0 or whole_first  # the whole problem: more time, two workers
        if whole:
            t0, t1 = -1.0, float("inf")
        else:
            width = share * span
            t0 = rng.uniform(-0.2 * width, span - 0.6 * width)
            if left < 2 * _WINDOW_SECONDS:
                t0 = max(t0, span - width)  # near the deadline, the end: a small model, a quick presolve
            t1 = t0 + width
        model = base.clone()
        built.hint(model, best, rank_end)
        if whole_first:
            model.minimize(built.makespan)  # alone: shorter ones sooner (windows then even out the ends)
        for r, program in enumerate(best):
            previous = None
            for c, st in built.parts(program, starts[r]):
                if st < t0 - _EPS:
                    model.add(built.start[c] == round(st * scale))
                elif st > t1 + _EPS:
                    if previous is not None:
                        model.add(built.end[previous] <= built.start[c])
                    previous = c
        solver = cp_model.CpSolver()
        limit = deadline - time.perf_counter() - overrun  # a whole problem solved last: all of it
        if whole_first:
            limit *= _WHOLE_FIRST_SHARE
        elif not whole:
            limit = min(_WINDOW_SECONDS, limit)
        solver.parameters.max_time_in_seconds = max(0.01, limit)
        solver.parameters.num_workers = 2 if whole else 1
        solver.parameters.random_seed = rng.randrange(1 << 30)
        if not whole:
            solver.parameters.cp_model_probing_level = 0  # probing and symmetry take longer
            solver.parameters.symmetry_level = 0  # than a window's search
        posed = time.perf_counter()
        status = solver.solve(model)
        past = time.perf_counter() - posed - limit
        overrun = max(overrun, past)
        # Widen the window while CP-SAT closes it in time, narrow it when it does not (and halve
        # it when CP-SAT ran past its limit: a large model's presolve does).
        if whole_first:
            whole_first = False  # once; windows next (or, if it was solved, the loop ends below)
        elif status == cp_model.OPTIMAL:
            share = min(1.0, share * 1.25)
        else:
            share = max(0.02, share * (0.5 if past > 0.05 else 0.8))
        if status not in (cp_model.OPTIMAL, cp_model.FEASIBLE):
            continue
        found = built.orders(solver)
        score = problem.score(found)
        if (
            score[0] < best_score[0] - _EPS or (score[0] <= best_score[0] + _EPS and score[1] <= best_score[1] + _EPS)
        ) and problem.fits(found):
            best, best_score = found, score
        if whole and status == cp_model.OPTIMAL:
            break  # the whole problem is solved: nothing left to find
    return best, best_score
