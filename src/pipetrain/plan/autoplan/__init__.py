"""Schedule construction for measured costs and a memory limit (behind ``auto_schedule``).

Small parts: :mod:`.problem` turns a layout and costs into integer tables with a fast makespan
evaluation; :mod:`.periodic` repeats a block of one or two microbatches' actions at the shortest
period that fits (modulo scheduling), and :mod:`.cyclic` places such blocks exactly with CP-SAT;
:mod:`.greedy` builds orders by memory-safe list scheduling under several priority rules;
:mod:`.improve` polishes the best orders by local search, :mod:`.exact` by CP-SAT over windows.
:func:`construct` runs them against a deadline, starting from any orders it is given (the named
schedules that fit).
"""

from __future__ import annotations

import random
import time
from collections.abc import Iterator, Sequence

from pipetrain.plan.autoplan import cyclic, exact
from pipetrain.plan.autoplan.greedy import Policy, list_schedule
from pipetrain.plan.autoplan.improve import improve
from pipetrain.plan.autoplan.periodic import Block, best_orders, greedy_blocks
from pipetrain.plan.autoplan.problem import KIND_B, KIND_I, KIND_W, Orders, Problem

__all__ = [
    "SECONDS_PER_ACTION",
    "Orders",
    "Policy",
    "Problem",
    "construct",
    "merge_backward",
    "polish",
    "polish_deadline",
    "uses_windows",
    "windows_fit",
]

_PERIODIC_SHARE = 0.15  # of the time: periodic blocks (modulo scheduling) ...
_PERIODIC_EXACT_SHARE = 0.3  # ... and when CP-SAT places them too
_BELOW_NAMED = 5 / 3  # more when no named schedule fits (0.5 of the time with CP-SAT)
_BLOCKS_IN_POLISH = 0.4  # of polish's time, for blocks placed by CP-SAT (see polish)
_EXACT_MAX_BLOCK = 200  # actions in one microbatch's block that CP-SAT takes (exact periodic blocks)
_GREEDY_SHARE = 0.35  # of the time: list scheduling under the rule grid and random restarts
_EXACT_SHARE = 0.5  # of what is left, for CP-SAT when ortools is installed and the problem is small
_EXACT_MAX_ACTIONS = 1000  # beyond, windows gain less than local search
SECONDS_PER_ACTION = 4e-5
_WHOLE_LOOK_SHARE = 0.4  # of a first look's time, for a problem CP-SAT then solves whole


def _policies(problem: Problem) -> Iterator[Policy]:
    """The rule grid, most often best first; then random jitter over it (restarts).

    The in-flight cap is the knob that matters most under tight memory (how deep the warm-up
    goes), so every rule is tried at several caps around one and two times the ranks."""
    p = problem.num_ranks
    caps: list[int | None] = [
        None,
        *sorted({max(1, k) for k in (p, 2 * p, p - 1, p + 1, (3 * p + 1) // 2, 2 * p - 1, 2, 3)}),
    ]
    rules = [
        (ff, deep, eager, fit)
        for eager in (False, True)
        for fit in (False, True)
        for deep in (True, False)
        for ff in (False, True)
    ]
    grid = [
        Policy(forward_first=ff, deep_first=deep, eager_w=eager, w_fit=fit, max_inflight=cap)
        for ff, deep, eager, fit in rules
        for cap in caps
    ]
    yield from grid
    while True:
        for base in grid:
            yield Policy(
                forward_first=base.forward_first,
                deep_first=base.deep_first,
                eager_w=base.eager_w,
                w_fit=base.w_fit,
                max_inflight=base.max_inflight,
                noise=0.5,
            )


def periodic_seeds(problem: Problem, until: float, rng: random.Random, exact_blocks: bool) -> list[Orders]:
    """Orders of the best periodic blocks found by ``until``: placed greedily, then, with
    ``exact_blocks`` when CP-SAT can take the block, its shortest blocks from the best greedy
    ones (one per lane count). None with fewer than two microbatches per rank: there is no steady
    state to repeat, and the warm-up and cool-down are list scheduling's strength."""
    if problem.num_microbatches < 2 * problem.num_ranks:
        return []
    exact_too = exact_blocks and exact_periodic_fit(problem)
    now = time.perf_counter()
    blocks = greedy_blocks(problem, now + (0.2 if exact_too else 0.8) * max(0.0, until - now), rng)
    if exact_too:
        split = [b for b in blocks if any(op.kind == KIND_W for op in b.ops)]
        firsts: dict[int, Block] = {}
        for block in sorted(split, key=lambda b: b.makespan_bound(problem.num_microbatches)):
            firsts.setdefault(block.lanes, block)
        for index, block in enumerate(firsts.values()):
            now = time.perf_counter()
            blocks += cyclic.exact_blocks(problem, block, now + 0.85 * max(0.0, until - now) / (len(firsts) - index))
    return best_orders(problem, blocks, until)


def exact_periodic_fit(problem: Problem) -> bool:
    """Whether CP-SAT (imported) can place ``problem``'s periodic blocks."""
    return exact.ready() and exact.solvable(problem, cyclic.SCALE) and 3 * problem.num_stages <= _EXACT_MAX_BLOCK


def merge_backward(problem: Problem, orders: Orders) -> Orders:
    """``orders`` with every I directly followed by its own W run as one B."""
    sm = problem.num_stages * problem.num_microbatches
    out: Orders = []
    for program in orders:
        merged: list[int] = []
        k = 0
        while k < len(program):
            c = program[k]
            if c // sm == KIND_I and k + 1 < len(program) and program[k + 1] == c + (KIND_W - KIND_I) * sm:
                merged.append(c + (KIND_B - KIND_I) * sm)
                k += 2
                continue
            merged.append(c)
            k += 1
        out.append(merged)
    return out


def construct(
    problem: Problem,
    seeds: Sequence[Orders],
    deadline: float,
    rng: random.Random,
    polish_share: float | None = None,
) -> tuple[Orders, float] | None:
    """The best orders found by ``deadline`` (never worse than a seed that fits), and their makespan:
    list scheduling, local search, then :func:`polish` for ``polish_share`` of what time is left
    (by default most of it when ortools can take it, else none)."""
    if polish_share == 0.0 and uses_windows(problem) and exact.solved_whole_first(problem):
        # A first look before CP-SAT solves the problem whole: a start is all it needs, and the
        # time kept goes to that solve (which finds more than local search from a better start).
        deadline = time.perf_counter() + _WHOLE_LOOK_SHARE * max(0.0, deadline - time.perf_counter())
    pool: list[tuple[tuple[float, float], Orders]] = []
    for seed_orders in seeds:
        if problem.complete(seed_orders) and problem.fits(seed_orders):
            pool.append((problem.score(seed_orders), seed_orders))
    below_named = not pool
    if polish_share is None:
        polish_share = _EXACT_SHARE if uses_windows(problem) else 0.0
    # Blocks placed by CP-SAT here only when this call polishes too (else :func:`polish` does it).
    exact_blocks = polish_share > 0.0 and exact_periodic_fit(problem)
    share = _PERIODIC_EXACT_SHARE if exact_blocks else _PERIODIC_SHARE
    if below_named:
        share *= _BELOW_NAMED
    until = time.perf_counter() + share * max(0.0, deadline - time.perf_counter())
    for seed_orders in periodic_seeds(problem, until, rng, exact_blocks):
        if problem.complete(seed_orders) and problem.fits(seed_orders):
            pool.append((problem.score(seed_orders), seed_orders))
    greedy_until = time.perf_counter() + _GREEDY_SHARE * max(0.0, deadline - time.perf_counter())
    actions = 3 * problem.num_stages * problem.num_microbatches
    for count, policy in enumerate(_policies(problem)):
        now = time.perf_counter()
        # One run costs ~20-40 us an action; skip a run that cannot end in time unless nothing fits yet.
        if (count or pool) and (now >= greedy_until or now + SECONDS_PER_ACTION * actions > deadline):
            break
        built = list_schedule(problem, policy, rng)
        if built is not None and problem.fits(built):
            pool.append((problem.score(built), built))
    if not pool:
        return None
    pool.sort(key=lambda item: item[0])
    improve_until = deadline - polish_share * max(0.0, deadline - time.perf_counter())
    best, makespan = improve(problem, pool[0][1], improve_until, rng)
    if makespan == float("inf"):
        return None
    return polish(problem, best, makespan, deadline, rng)


def windows_fit(problem: Problem) -> bool:
    """Whether CP-SAT over windows can take ``problem`` (ortools installed; a small enough problem
    in integer ticks)."""
    size = 3 * problem.num_stages * problem.num_microbatches
    return size <= _EXACT_MAX_ACTIONS and exact.available() and exact.solvable(problem)


def uses_windows(problem: Problem) -> bool:
    """Whether :func:`polish` searches ``problem`` with CP-SAT over windows: it fits and CP-SAT is
    imported (see :func:`.exact.preload`)."""
    return exact.ready() and windows_fit(problem)


def polish_deadline(problem: Problem, deadline: float, layouts_left: int) -> float:
    """When to stop polishing ``problem``, the first of ``layouts_left`` layouts still to polish
    by ``deadline``: one that CP-SAT solves whole gets an equal share of what is left (the layout
    that looks best before CP-SAT is not always the optimum's), another all of it."""
    if not (uses_windows(problem) and exact.solved_whole_first(problem)):
        return deadline
    now = time.perf_counter()
    return now + max(0.0, deadline - now) / max(1, layouts_left)


def polish(
    problem: Problem,
    orders: Orders,
    makespan: float,
    deadline: float,
    rng: random.Random,
    blocks_first: bool = False,
) -> tuple[Orders, float]:
    """Better orders than ``orders`` (makespan ``makespan``, never worse) found by ``deadline``:
    CP-SAT over windows of time when ortools is installed and the problem fits the model, else
    more local search. A backward whose W directly follows its I is then run as one B.
    ``blocks_first``: periodic blocks placed by CP-SAT come first (for a layout whose first look
    did without them, where no named schedule fits)."""
    best = orders
    if blocks_first and exact_periodic_fit(problem):
        until = time.perf_counter() + _BLOCKS_IN_POLISH * max(0.0, deadline - time.perf_counter())
        for found in periodic_seeds(problem, until, rng, exact_blocks=True):
            score = problem.makespan(found)
            if score < makespan - 1e-9 and problem.fits(found):
                best, makespan = found, score
    left = deadline - time.perf_counter()
    if left > 0.1:
        if uses_windows(problem):
            found, (score, _) = exact.improve_windows(problem, best, deadline, rng)
        else:
            found, score = improve(problem, best, deadline, rng)
        if score < makespan - 1e-9:
            best, makespan = found, score
    merged = merge_backward(problem, best)
    if merged != best and problem.makespan(merged) <= makespan + 1e-9 and problem.fits(merged):
        best = merged
    return best, makespan
