"""Local search on per-rank orders: pull later work into the gaps where a rank waits.

A move takes an action from a little later in a rank's program and runs it where the rank would
otherwise wait; it is kept if the simulated makespan (then the sum of the ranks' finishing times)
goes down and the rank's peak memory stays within the limit. Simulated annealing over moves of
one action on its rank then explores beyond the first local optimum, until the deadline.
"""

from __future__ import annotations

import math
import random
import time

from pipetrain.plan.autoplan.problem import Orders, Problem

__all__ = ["improve"]

_EPS = 1e-9
_WINDOW = 12  # how far ahead a move looks for work to pull into a gap


def _better(a: tuple[float, float], b: tuple[float, float]) -> bool:
    return a[0] < b[0] - _EPS or (a[0] <= b[0] + _EPS and a[1] < b[1] - _EPS)


def _descend(
    problem: Problem, orders: Orders, deadline: float, rng: random.Random
) -> tuple[Orders, tuple[float, float]]:
    best = [list(o) for o in orders]
    score = problem.score(best)
    limit = problem.limit
    while time.perf_counter() < deadline:
        starts = problem.starts(best)
        ends = problem.tables.dur
        gaps: list[tuple[int, int]] = []
        for r, program in enumerate(best):
            prev_end = 0.0
            for k, c in enumerate(program):
                if starts[r][k] > prev_end + _EPS:
                    gaps.append((r, k))
                prev_end = starts[r][k] + ends[c]
        rng.shuffle(gaps)
        moved = False
        for r, k in gaps:
            program = best[r]
            for j in range(k + 1, min(k + _WINDOW, len(program))):
                trial = [*program[:k], program[j], *program[k:j], *program[j + 1 :]]
                if limit is not None and problem.peak(trial, r) > limit + _EPS:
                    continue
                best[r] = trial
                new = problem.score(best)
                if _better(new, score):
                    score = new
                    moved = True
                    break
                best[r] = program
            if moved or time.perf_counter() >= deadline:
                break
        if not moved:
            break
    return best, score


def _anneal(
    problem: Problem, orders: Orders, score: tuple[float, float], deadline: float, rng: random.Random
) -> tuple[Orders, tuple[float, float]]:
    """Simulated annealing over single-action moves (an action moved up to ``_WINDOW`` places
    earlier or later on its rank), accepting worse makespans with a falling probability."""
    current = [list(o) for o in orders]
    current_score = score
    best, best_score = [list(o) for o in orders], score
    limit = problem.limit
    durations = [d for d in problem.tables.dur if d > 0]
    scale = sum(durations) / len(durations) if durations else 1.0
    hot, cold = 0.6 * scale, 0.01 * scale
    begin = time.perf_counter()
    span = max(1e-6, deadline - begin)
    ranks = [r for r, o in enumerate(current) if len(o) > 1]
    if not ranks:
        return best, best_score
    while (now := time.perf_counter()) < deadline:  # checked before any move, feasible or not
        r = rng.choice(ranks)
        program = current[r]
        k = rng.randrange(len(program))
        j = min(len(program) - 1, max(0, k + rng.randint(-_WINDOW, _WINDOW)))
        if j == k:
            continue
        trial = list(program)
        trial.insert(j, trial.pop(k))
        if limit is not None and problem.peak(trial, r) > limit + _EPS:
            continue
        current[r] = trial
        new = problem.score(current)
        temperature = hot * (cold / hot) ** ((now - begin) / span)
        delta = (new[0] - current_score[0]) + 1e-3 * (new[1] - current_score[1])
        if delta <= 0 or (new[0] != float("inf") and rng.random() < math.exp(-delta / temperature)):
            current_score = new
            if _better(new, best_score):
                best, best_score = [list(o) for o in current], new
        else:
            current[r] = program
    return best, best_score


def improve(problem: Problem, orders: Orders, deadline: float, rng: random.Random) -> tuple[Orders, float]:
    """Better orders than ``orders`` (never worse) and their makespan, found by ``deadline``."""
    best, score = _descend(problem, orders, deadline, rng)
    if time.perf_counter() < deadline:
        best, score = _anneal(problem, best, score, deadline, rng)
        best, score = _descend(problem, best, deadline + 0.0, rng)
    return best, score[0]
