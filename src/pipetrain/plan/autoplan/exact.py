"""Exact solving with CP-SAT (ortools, the optional ``solver`` extra): the yardstick for the
benchmarks, and the planner's last step on small problems when ortools is installed.

One interval per action (F, I, W of every stage and microbatch) with its duration, no overlap on a
rank, the dependency rules with the message latency between ranks, and a reservoir per rank for
memory (an activation is held from the start of its F to the end of its W). Microbatches are
interchangeable, so they enter the first stage in order (a symmetry cut that keeps an optimum).
Durations are scaled to integers (``scale``); problems whose durations or weights are not
multiples of ``1/scale`` are left to the heuristic. The planner never needs ortools.
"""

from __future__ import annotations

import importlib.util
from dataclasses import dataclass
from typing import Any

from pipetrain.plan.autoplan.problem import KIND_F, KIND_I, KIND_W, Orders, Problem

__all__ = ["Exact", "available", "solvable", "solve"]


def available() -> bool:
    """Whether ortools is installed."""
    return importlib.util.find_spec("ortools") is not None


def solvable(problem: Problem, scale: int = 10) -> bool:
    """Whether the exact model can state ``problem`` (integer ticks and weights)."""
    values = [*problem.f, *problem.i, *problem.w, problem.comm]
    if any(abs(round(x * scale) - x * scale) > 1e-6 for x in values):
        return False
    if problem.limit is not None and any(abs(round(a) - a) > 1e-9 for a in problem.weight):
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


def solve(
    problem: Problem, hint: Orders | None = None, time_limit: float = 60.0, scale: int = 10, workers: int = 2
) -> Exact:
    """Minimise the makespan of ``problem`` (split backward: I then W) within ``time_limit`` seconds."""
    cp_model: Any = importlib.import_module("ortools.sat.python.cp_model")

    n_st, n_mb, n_rk = problem.num_stages, problem.num_microbatches, problem.num_ranks
    t = problem.tables
    model = cp_model.CpModel()

    def ticks(x: float) -> int:
        value = round(x * scale)
        assert abs(value - x * scale) < 1e-6, f"duration {x} is not a multiple of 1/{scale}"
        return value

    horizon = sum(
        ticks(t.dur[problem.code(k, s, m)]) for k in (KIND_F, KIND_I, KIND_W) for s in range(n_st) for m in range(n_mb)
    )
    horizon += ticks(problem.comm) * 2 * n_st * n_mb + 1
    start: dict[int, Any] = {}
    end: dict[int, Any] = {}
    per_rank: list[list[Any]] = [[] for _ in range(n_rk)]
    for k in (KIND_F, KIND_I, KIND_W):
        for s in range(n_st):
            for m in range(n_mb):
                c = problem.code(k, s, m)
                d = ticks(t.dur[c])
                st = model.new_int_var(0, horizon, f"s{c}")
                en = model.new_int_var(0, horizon, f"e{c}")
                per_rank[t.rank[c]].append(model.new_interval_var(st, d, en, f"i{c}"))
                start[c], end[c] = st, en
    lat = ticks(problem.comm)
    rank_of = problem.stage_to_rank
    for s in range(n_st):
        for m in range(n_mb):
            f, i, w = (problem.code(k, s, m) for k in (KIND_F, KIND_I, KIND_W))
            if s > 0:
                model.add(
                    start[f] >= end[problem.code(KIND_F, s - 1, m)] + (lat if rank_of[s - 1] != rank_of[s] else 0)
                )
            model.add(start[i] >= end[f])
            if s < n_st - 1:
                model.add(
                    start[i] >= end[problem.code(KIND_I, s + 1, m)] + (lat if rank_of[s + 1] != rank_of[s] else 0)
                )
            model.add(start[w] >= end[i])
    for m in range(n_mb - 1):
        model.add(start[problem.code(KIND_F, 0, m)] <= start[problem.code(KIND_F, 0, m + 1)])
    for r in range(n_rk):
        model.add_no_overlap(per_rank[r])
    if problem.limit is not None:
        for r in range(n_rk):
            times: list[Any] = []
            changes: list[int] = []
            for s in problem.stages_of(r):
                a = round(problem.weight[s])
                assert abs(a - problem.weight[s]) < 1e-9, "the exact model takes integer activation weights"
                for m in range(n_mb):
                    times += [start[problem.code(KIND_F, s, m)], end[problem.code(KIND_W, s, m)]]
                    changes += [a, -a]
            model.add_reservoir_constraint(times, changes, 0, int(problem.limit + 1e-9))
    makespan = model.new_int_var(0, horizon, "makespan")
    model.add_max_equality(makespan, list(end.values()))
    model.minimize(makespan)
    if hint is not None:
        hint_starts = problem.starts(hint)
        for r, program in enumerate(hint):
            for c, st in zip(program, hint_starts[r], strict=True):
                if c in start:
                    model.add_hint(start[c], round(st * scale))
    solver = cp_model.CpSolver()
    solver.parameters.max_time_in_seconds = time_limit
    solver.parameters.num_workers = workers
    status = solver.solve(model)
    if status not in (cp_model.OPTIMAL, cp_model.FEASIBLE):
        return Exact(float("inf"), False, solver.best_objective_bound / scale, solver.wall_time, None)
    orders: Orders = []
    for r in range(n_rk):
        codes = [c for c in start if t.rank[c] == r]
        codes.sort(key=lambda c: (solver.value(start[c]), solver.value(end[c]), c))
        orders.append(codes)
    return Exact(
        solver.objective_value / scale,
        status == cp_model.OPTIMAL,
        solver.best_objective_bound / scale,
        solver.wall_time,
        orders,
    )
