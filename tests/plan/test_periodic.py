"""Periodic blocks (pipetrain.plan.autoplan.periodic and .cyclic): every block's orders are
complete, run, fit the memory limit and finish no later than the block's own bound; under tight
memory a block keeps the strict rhythm that list scheduling misses."""

from __future__ import annotations

import random
import time

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pipetrain.plan import Costs, simulate
from pipetrain.plan.autoplan import exact, periodic_seeds
from pipetrain.plan.autoplan.periodic import Block, best_orders, greedy_blocks
from pipetrain.plan.autoplan.problem import Problem
from pipetrain.plan.search import layout_problem


def _check(problem: Problem, block: Block) -> None:
    orders = block.orders(problem)
    assert problem.complete(orders)
    makespan = problem.makespan(orders)
    assert makespan <= block.makespan_bound(problem.num_microbatches) + 1e-6  # as soon as possible: never later
    assert problem.fits(orders)
    assert max(problem.peak(o) for o in orders) <= block.peak(problem) + 1e-9  # the steady state bounds them all


@settings(max_examples=25, deadline=None)
@given(
    p=st.integers(1, 4),
    v=st.sampled_from([1, 2]),
    m=st.integers(1, 12),
    place=st.sampled_from(["loop", "v"]),
    comm=st.sampled_from([0.0, 0.3]),
    durations=st.lists(st.sampled_from([0.5, 1.0, 1.5, 2.0]), min_size=3, max_size=3),
    extra=st.integers(0, 6),
)
def test_every_greedy_block_runs_and_keeps_its_promises(
    p: int, v: int, m: int, place: str, comm: float, durations: list[float], extra: int
) -> None:
    if place == "v" and v != 2:
        place = "loop"
    f, i, w = durations
    n = p * v
    costs = Costs(f=[f] * n, i=[i] * n, w=[w] * n, comm=comm, activation_bytes=[1.0] * n)
    limit = float(v + extra)  # from one activation per stage the rank holds upwards
    problem = layout_problem(p, m, costs, limit, v, place, True)
    blocks = greedy_blocks(problem, time.perf_counter() + 0.3, random.Random(0))
    assert blocks, "some period always fits: at the longest, one microbatch at a time"
    for block in blocks[:20]:
        _check(problem, block)
    for orders in best_orders(problem, blocks, time.perf_counter() + 0.05):
        assert problem.score(orders)[0] < float("inf")
        schedule = problem.to_schedule(orders)
        assert simulate(schedule, costs).makespan == pytest.approx(problem.makespan(orders))


def test_a_block_keeps_the_strict_rhythm_under_tight_memory() -> None:
    """4 ranks in a V, 8 microbatches, 4 activations per rank (half of ZB-V's), uniform costs:
    the proven optimum is 59 (CP-SAT), a period of 6 on every rank; list scheduling alone found 66."""
    ones = [1.0] * 8
    problem = layout_problem(4, 8, Costs(f=ones, i=ones, w=ones, activation_bytes=ones), 4.0, 2, "v", True)
    seeds = periodic_seeds(problem, time.perf_counter() + 1.0, random.Random(0), exact_blocks=False)
    assert seeds
    assert problem.makespan(seeds[0]) == 59
    assert problem.fits(seeds[0])


@pytest.mark.skipif(not exact.available(), reason="needs ortools (the solver extra)")
def test_exact_blocks_are_never_longer_than_the_greedy_block_they_start_from() -> None:
    from pipetrain.plan.autoplan.cyclic import exact_blocks

    heavy = [1.3] + [1.0] * 7
    costs = Costs(f=heavy, i=heavy, w=heavy, comm=0.2, activation_bytes=[1.0] * 8)
    problem = layout_problem(4, 8, costs, 4.0, 2, "v", True)
    greedy = [b for b in greedy_blocks(problem, time.perf_counter() + 0.3, random.Random(0)) if b.lanes == 1]
    split = min((b for b in greedy if len(b.ops) == 24), key=lambda b: b.makespan_bound(8))
    found = exact_blocks(problem, split, time.perf_counter() + 3.0)
    assert found
    for block in found:
        _check(problem, block)
    assert min(b.makespan_bound(8) for b in found) <= split.makespan_bound(8) + 1e-6
