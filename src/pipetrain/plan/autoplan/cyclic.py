"""Exact periodic blocks with CP-SAT (ortools, the optional ``solver`` extra).

:mod:`.periodic` places a block's actions greedily; under tight memory the best blocks need the
lanes' memory peaks to take turns, which a greedy placement rarely finds. Here, for a fixed
period, CP-SAT finds offsets that minimise the block's length exactly:

* every action waits for its inputs (the problem's dependency tables, with the message latency);
* a rank's actions do not overlap modulo the period (each action's phase, and its copy one period
  later, in one no-overlap: that is exactly no overlap on the circle);
* memory, counted where it can peak (at each forward's start; an activation at the most it holds
  until its backward ends, the base of the rank taken off its room): an activation of lane i is alive
  at time t in ``floor((t - F_i) / T) - floor((t - W_i_end) / T)`` periods, which CP-SAT states
  with two integer quotients per pair of (forward, activation) on a rank.

Periods are tried down from one a greedy block fits, in steps that halve when CP-SAT finds no
block.
"""

from __future__ import annotations

import math
import time
from typing import Any

from pipetrain.plan.autoplan.periodic import Block, BlockAction, block_ops
from pipetrain.plan.autoplan.problem import KIND_B, KIND_F, KIND_W, Problem

__all__ = ["SCALE", "exact_blocks"]

SCALE = 10  # ticks per unit of time (the problem must be solvable at this scale: exact.solvable)
_WEIGHT_SCALE = 1000
_SOLVE_SECONDS = 2.0  # CP-SAT's time for one period, at most
_HORIZON = 1.5  # a block's length, at most, in lengths of the known block


def exact_blocks(problem: Problem, known: Block, deadline: float) -> list[Block]:
    """Blocks CP-SAT finds by ``deadline`` with ``known``'s lanes (split backward): the shortest
    block at ``known``'s period (hinted with it), then at shorter periods, down towards the
    busiest rank's load."""
    from ortools.sat.python import cp_model  # optional: imported only when used

    lanes = known.lanes
    ops = block_ops(problem, False, lanes)
    load = [0] * problem.num_ranks
    for op in ops:
        load[op.rank] += _ticks(op.dur)
    low = max(load)
    if low <= 0:
        return []
    # Blocks at shorter periods are about as long: half as long again bounds them, and a tight
    # horizon is what makes CP-SAT fast here (20x against the sum of all durations).
    horizon = math.ceil(_HORIZON * _ticks(known.length))
    high = _ticks(known.period)
    hint = [_ticks(x) for x in known.start]
    if high > horizon or max(hint) > horizon:
        return []
    found: list[Block] = []

    def attempt(period: int, seconds: float) -> bool:
        nonlocal hint
        start = _solve(cp_model, problem, ops, period, horizon, seconds, hint)
        if start is None:
            return False
        hint = start
        found.append(Block(period / SCALE, tuple(ops), tuple(x / SCALE for x in start), lanes))
        return True

    # Down from the known period, each solve hinted with the block just found (nearly feasible,
    # so CP-SAT finds one fast); a refused period halves the step.
    if not attempt(high, min(_SOLVE_SECONDS, deadline - time.perf_counter())):
        return found
    fits, step = high, max(1, (high - low) // 4)
    while step and time.perf_counter() < deadline - 0.05:
        period = fits - step
        if period >= low and attempt(period, min(_SOLVE_SECONDS, deadline - time.perf_counter())):
            fits = period
        else:
            step //= 2
    return found


def _ticks(x: float) -> int:
    return round(x * SCALE)


def _solve(
    cp_model: Any, problem: Problem, ops: list[BlockAction], period: int, horizon: int, seconds: float, hint: list[int]
) -> list[int] | None:
    model = cp_model.CpModel()
    dur = [_ticks(op.dur) for op in ops]
    start = [model.new_int_var(0, horizon, f"s{k}") for k in range(len(ops))]
    end = model.new_int_var(0, horizon + max(dur), "end")
    for k, op in enumerate(ops):
        model.add(end >= start[k] + dur[k])
        for j, lat in op.preds:
            model.add(start[k] >= start[j] + dur[j] + _ticks(lat))
    # Lane 0 enters at time 0 (a shift changes nothing), so first: lanes are interchangeable, and
    # no start is below 0.
    firsts = [k for k, op in enumerate(ops) if op.kind == KIND_F and not op.preds]
    model.add(start[firsts[0]] == 0)
    # Phases on the circle: start = q * period + phase.
    phase = []
    for k in range(len(ops)):
        q = model.new_int_var(0, horizon // period + 1, f"q{k}")
        r = model.new_int_var(0, period - 1, f"r{k}")
        model.add(start[k] == q * period + r)
        phase.append(r)
    for rank in range(problem.num_ranks):
        intervals = []
        for k, op in enumerate(ops):
            if op.rank != rank or dur[k] == 0:
                continue
            intervals.append(model.new_fixed_size_interval_var(phase[k], dur[k], f"i{k}"))
            intervals.append(model.new_fixed_size_interval_var(phase[k] + period, dur[k], f"j{k}"))
        model.add_no_overlap(intervals)
    if problem.limit is not None:
        _memory(model, problem, ops, start, dur, period, horizon)
    shift = hint[firsts[0]]
    for k, x in enumerate(hint):
        model.add_hint(start[k], x - shift)
    model.minimize(end)
    solver = cp_model.CpSolver()
    solver.parameters.max_time_in_seconds = seconds
    solver.parameters.num_workers = 1
    status = solver.solve(model)
    if status not in (cp_model.OPTIMAL, cp_model.FEASIBLE):
        return None
    return [solver.value(s) for s in start]


def _memory(
    model: Any, problem: Problem, ops: list[BlockAction], start: list[Any], dur: list[int], period: int, horizon: int
) -> None:
    """At each forward's start, the activations alive on its rank fit its room (each counted at the
    most it holds until its backward ends)."""
    release = {(op.stage, op.lane): k for k, op in enumerate(ops) if op.kind in (KIND_W, KIND_B)}
    split = any(op.kind == KIND_W for op in ops)
    held = problem.hold if split else problem.weight
    span = horizon // period + 2
    for rank in range(problem.num_ranks):
        room = problem.room(rank)
        assert room is not None
        forwards = [k for k, op in enumerate(ops) if op.rank == rank and op.kind == KIND_F]
        for e in forwards:
            alive = []
            for i in forwards:
                w = release[(ops[i].stage, ops[i].lane)]
                a = model.new_int_var(-span, span, f"a{e}_{i}")
                b = model.new_int_var(-span, span, f"b{e}_{i}")
                # a = floor((t_e - F_i) / T), b = floor((t_e - W_i end) / T)
                model.add(a * period <= start[e] - start[i])
                model.add(start[e] - start[i] <= a * period + period - 1)
                model.add(b * period <= start[e] - start[w] - dur[w])
                model.add(start[e] - start[w] - dur[w] <= b * period + period - 1)
                alive.append((round(held[ops[i].stage] * _WEIGHT_SCALE), a - b))
            model.add(sum(weight * count for weight, count in alive) <= math.floor(room * _WEIGHT_SCALE + 1e-6))
