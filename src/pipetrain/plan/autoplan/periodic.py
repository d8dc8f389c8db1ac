"""Periodic schedules: a block of actions of one or two microbatches, repeated every ``period``.

This is modulo scheduling, as compilers pipeline loops: every action of a block gets an offset,
the block's next microbatches run it one period later, and no two actions of a rank overlap
modulo the period (two microbatches per block, *lanes*, let their memory peaks take turns). A rank's memory is then set by the period alone (an activation lives from its
F to its W, and the count alive at once is that lifespan over the period), so a tight limit is met
by a longer period rather than by starving the warm-up. The steady state is exact by construction,
which is where list scheduling loses most under tight memory: on 4 ranks in a V with a limit of 4
activations, uniform costs, it finds the proven optimum (59 for 8 microbatches), which keeps a
strict period of 6 on every rank.

Each rank's order is its actions sorted by their block time; the search evaluates that order as
soon as possible, which can only shorten the warm-up and cool-down (the block times are one
feasible timing of the same order), and memory, a property of the order, is what the block holds.
"""

from __future__ import annotations

import heapq
import math
import random
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

from pipetrain.plan.autoplan.problem import KIND_B, KIND_F, KIND_I, KIND_W, Orders, Problem

__all__ = ["LANES", "Block", "BlockAction", "best_orders", "block_ops", "greedy_blocks"]

_EPS = 1e-9
_GRID = 48  # periods tried per busiest-rank load: shortest * (1 + k / _GRID)
LANES = (1, 2)  # microbatches per block: two let their memory peaks take turns


@dataclass(frozen=True)
class BlockAction:
    """One action of a block: what it is, where it runs, and what it waits for."""

    kind: int
    stage: int
    rank: int
    dur: float
    weight: float  # memory: + at an F's start; at an I's end what W reads - the activation; - at a W's or B's end
    preds: tuple[tuple[int, float], ...]  # (op index, latency)
    lane: int  # which microbatch of the block: microbatch q * lanes + lane runs it in period q


@dataclass(frozen=True)
class Block:
    """The actions of ``lanes`` microbatches with their offsets in a periodic schedule."""

    period: float
    ops: tuple[BlockAction, ...]
    start: tuple[float, ...]
    lanes: int

    @property
    def length(self) -> float:
        """From the first action's start to the last one's end: one microbatch's span."""
        return max(s + op.dur for s, op in zip(self.start, self.ops, strict=True))

    def makespan_bound(self, microbatches: int) -> float:
        """The block schedule's makespan; running its orders as soon as possible is never later."""
        return (math.ceil(microbatches / self.lanes) - 1) * self.period + self.length

    def orders(self, problem: Problem, microbatches: int | None = None) -> Orders:
        """Each rank's codes sorted by their time in the block schedule (microbatches 0..n-1)."""
        n = problem.num_microbatches if microbatches is None else microbatches
        timed: list[list[tuple[float, int, int]]] = [[] for _ in range(problem.num_ranks)]
        for k, (op, s) in enumerate(zip(self.ops, self.start, strict=True)):
            row = timed[op.rank]
            base = problem.code(op.kind, op.stage, 0)
            for m in range(op.lane, n, self.lanes):
                row.append((s + (m // self.lanes) * self.period, k, base + m))
        return [[c for _, _, c in sorted(row)] for row in timed]

    def peak(self, problem: Problem) -> float:
        """The largest memory any rank holds: with the problem's microbatches, or enough of them to
        reach the steady state, which more microbatches only repeat."""
        span = max(self.length, self.period)
        n = min(problem.num_microbatches, (math.ceil(span / self.period) + 2) * self.lanes)
        worst = 0.0
        for r in range(problem.num_ranks):
            # A change at an F's start, else at the action's end; at one time frees first (an action
            # ending when the next one starts).
            events = sorted(
                (s + (m // self.lanes) * self.period + (0.0 if op.kind == KIND_F else op.dur), op.weight, k)
                for k, (op, s) in enumerate(zip(self.ops, self.start, strict=True))
                if op.rank == r
                for m in range(op.lane, n, self.lanes)
            )
            held = problem.base[r] if problem.base else 0.0
            worst = max(worst, held)
            for _, delta, _ in events:
                held += delta
                worst = max(worst, held)
        return worst


def block_ops(problem: Problem, fused: bool, lanes: int) -> list[BlockAction]:
    """The actions of ``lanes`` microbatches with what each waits for, read from the problem's
    dependency tables (for microbatch 0: every dependency stays within a microbatch)."""
    t = problem.tables
    n_st, n_mb = problem.num_stages, problem.num_microbatches
    kinds = (KIND_F, KIND_B) if fused else (KIND_F, KIND_I, KIND_W)
    index = {(kind, s): k for k, (kind, s) in enumerate((kind, s) for kind in kinds for s in range(n_st))}
    size = len(index)
    ops = []
    for lane in range(lanes):
        for kind in kinds:
            for s in range(n_st):
                c = problem.code(kind, s, 0)
                preds = []
                for slot, lat in t.needs[c]:
                    block, stage = divmod(slot // n_mb, n_st)
                    producer = KIND_F if block == 0 else (KIND_B if fused else KIND_I) if block == 1 else KIND_W
                    preds.append((lane * size + index[(producer, stage)], lat))
                ops.append(BlockAction(kind, s, problem.stage_to_rank[s], t.dur[c], t.delta[c], tuple(preds), lane))
    return ops


def _earliest(busy: list[tuple[float, float]], ready: float, dur: float, period: float, skip: int = 0) -> float | None:
    """The first time from ``ready`` at which ``[t, t + dur)`` modulo ``period`` misses ``busy``
    (intervals within [0, period), none wrapping); with ``skip``, a later one (a delay that may
    let a later action of the chain fit without waiting)."""
    candidates = [ready] + [ready + ((end - ready) % period) for _, end in busy]
    found = None
    for t in sorted(candidates):
        a = t % period
        if a > period - _EPS:
            a = 0.0
        b = a + dur
        pieces = [(a, b)] if b <= period + _EPS else [(a, period), (0.0, b - period)]
        if all(e <= lo + _EPS or s >= hi - _EPS for lo, hi in pieces for s, e in busy):
            if not skip:
                return t
            found, skip = t, skip - 1
    return found


def _occupy(busy: list[tuple[float, float]], t: float, dur: float, period: float) -> None:
    a = t % period
    if a > period - _EPS:
        a = 0.0
    b = a + dur
    if b <= period + _EPS:
        busy.append((a, min(b, period)))
    else:
        busy.extend(((a, period), (0.0, b - period)))


def _place(
    ops: Sequence[BlockAction],
    sequence: Sequence[int],
    period: float,
    num_ranks: int,
    rng: random.Random | None = None,
    delay: float = 0.0,
    stagger: float = 1.0,
) -> tuple[float, ...] | None:
    """Offsets for ``ops`` placed one by one in ``sequence`` (a topological order), each as early
    as its inputs and its rank's free time modulo ``period`` allow (with ``rng``, each is put off
    to the next free time with probability ``delay``); lane j starts ``stagger * j / lanes`` of a
    period after lane 0. None if one finds no room."""
    lanes = 1 + max(op.lane for op in ops)
    start = [0.0] * len(ops)
    busy: list[list[tuple[float, float]]] = [[] for _ in range(num_ranks)]
    for k in sequence:
        op = ops[k]
        ready = max((start[j] + ops[j].dur + lat for j, lat in op.preds), default=stagger * period * op.lane / lanes)
        if op.dur <= _EPS:
            start[k] = ready
            continue
        skip = 1 if rng is not None and rng.random() < delay else 0
        t = _earliest(busy[op.rank], ready, op.dur, period, skip)
        if t is None:
            return None
        start[k] = t
        _occupy(busy[op.rank], t, op.dur, period)
    return tuple(start)


def _sequences(ops: Sequence[BlockAction], shift: float) -> Iterator[list[int]]:
    """Placement orders: the critical chain (F and the input-gradients) first and the weight
    gradients after it, or everything by its earliest start (a lane ``shift`` after the one
    before it)."""
    asap = [0.0] * len(ops)
    order = _topological(ops)
    for k in order:
        asap[k] = max((asap[j] + ops[j].dur + lat for j, lat in ops[k].preds), default=ops[k].lane * shift)
    chain = sorted((k for k in order if ops[k].kind != KIND_W), key=lambda k: (asap[k], k))
    yield chain + sorted((k for k in order if ops[k].kind == KIND_W), key=lambda k: (asap[k], k))
    if any(op.kind == KIND_W for op in ops):
        yield sorted(order, key=lambda k: (asap[k], k))


def _shuffled(ops: Sequence[BlockAction], rng: random.Random, spread: float, shift: float) -> list[int]:
    """A random topological order: by earliest start (a lane ``shift`` after the one before it)
    plus up to ``spread`` of noise."""
    waiting = [len(op.preds) for op in ops]
    users: list[list[int]] = [[] for _ in ops]
    for k, op in enumerate(ops):
        for j, _ in op.preds:
            users[j].append(k)
    asap = [op.lane * shift for op in ops]
    heap = [(asap[k] + rng.random() * spread, k) for k, op in enumerate(ops) if not op.preds]
    heapq.heapify(heap)
    out = []
    while heap:
        _, k = heapq.heappop(heap)
        out.append(k)
        for u in users[k]:
            asap[u] = max(asap[u], asap[k] + ops[k].dur)
            waiting[u] -= 1
            if not waiting[u]:
                heapq.heappush(heap, (asap[u] + rng.random() * spread, u))
    return out


def _topological(ops: Sequence[BlockAction]) -> list[int]:
    """The block's actions, each after what it waits for."""
    done: set[int] = set()
    out: list[int] = []
    pending = list(range(len(ops)))
    while pending:
        rest = []
        for k in pending:
            if all(j in done for j, _ in ops[k].preds):
                done.add(k)
                out.append(k)
            else:
                rest.append(k)
        if len(rest) == len(pending):  # pragma: no cover - the tables are acyclic
            raise AssertionError("cyclic dependency tables")
        pending = rest
    return out


def _blocks(problem: Problem, fused: bool, lanes: int, deadline: float, rng: random.Random) -> list[Block]:
    """Blocks whose memory fits, on a grid of periods from the busiest rank's load upwards: for
    each fixed placement order, the first grid point that fits (probing points 0, 1, 2, 4, ...),
    then every point above the last refused one while a longer period can still win (packing is
    not monotone in the period, so no bisection); then random orders and delays near the best
    periods found, until ``deadline``."""
    ops = block_ops(problem, fused, lanes)
    load = [0.0] * problem.num_ranks
    for op in ops:
        load[op.rank] += op.dur
    shortest = max(load)
    if shortest <= _EPS:
        return []
    shift = shortest / lanes  # one microbatch's share of the period
    n = problem.num_microbatches
    longest = sum(op.dur for op in ops) + problem.comm * len(ops)  # no block needs a longer period
    step = shortest / _GRID
    found: list[Block] = []

    def attempt(sequence: list[int], period: float, delay: float = 0.0, stagger: float = 1.0) -> Block | None:
        start = _place(ops, sequence, period, problem.num_ranks, rng, delay, stagger)
        if start is None:
            return None
        block = Block(period, tuple(ops), start, lanes)
        if problem.limit is not None and block.peak(problem) > problem.limit + _EPS:
            return None
        found.append(block)
        return block

    rounds = math.ceil(n / lanes) - 1
    last = math.ceil((longest - shortest) / step)  # the grid's last point: a period of ``longest``
    for sequence in _sequences(ops, shift):
        # Where blocks begin to fit (grid points 0, 1, 2, 4, ...: a tight limit needs a long
        # period), then every point from the last refused one up while a longer period can win.
        k, refused, block = 0, -1, None
        while block is None and k <= last and time.perf_counter() < deadline:
            block = attempt(sequence, shortest + step * k)
            if block is None:
                refused = k
                k = 1 if k == 0 else last + 1 if k == last else min(2 * k, last)
        best = math.inf if block is None else block.makespan_bound(n)
        k = refused + 1
        while k <= last and rounds * (shortest + step * k) < best and time.perf_counter() < deadline:
            if block is None or shortest + step * k != block.period:
                trial = attempt(sequence, shortest + step * k)
                if trial is not None:
                    best = min(best, trial.makespan_bound(n))
            k += 1
    # Random restarts around the best periods (or anywhere on the grid when none fitted).
    while time.perf_counter() < deadline:
        found.sort(key=lambda b: b.makespan_bound(n))
        if found:
            base = rng.choice(found[:4]).period
            period = max(shortest, base + step * rng.randint(-_GRID // 8, _GRID // 8))
        else:
            period = shortest + step * rng.randint(0, int((longest - shortest) / step))
        spread = rng.choice((0.0, 0.5, 1.0)) * shift / 3
        stagger = rng.choice((0.0, 0.25, 0.5, 0.75, 1.0))
        attempt(_shuffled(ops, rng, spread, shift * stagger), period, rng.choice((0.0, 0.1, 0.25)), stagger)
    return found


def greedy_blocks(problem: Problem, deadline: float, rng: random.Random) -> list[Block]:
    """Blocks placed greedily by ``deadline``: one and two lanes, the backward split and fused,
    each getting an equal share of the time."""
    blocks: list[Block] = []
    kinds = [(lanes, fused) for lanes in LANES for fused in (False, True)]
    for index, (lanes, fused) in enumerate(kinds):
        now = time.perf_counter()
        blocks += _blocks(problem, fused, lanes, now + max(0.0, deadline - now) / (len(kinds) - index), rng)
    return blocks


def best_orders(
    problem: Problem, blocks: list[Block], deadline: float, keep: int = 3, evaluate: int = 12
) -> list[Orders]:
    """The ``keep`` best orders, by simulated makespan, of the ``evaluate`` best ``blocks`` by their
    makespan bound (at least one evaluated whatever the time)."""
    blocks = sorted(blocks, key=lambda b: b.makespan_bound(problem.num_microbatches))
    scored: list[tuple[tuple[float, float], Orders]] = []
    for block in blocks[:evaluate]:
        if scored and time.perf_counter() >= deadline:
            break
        orders = block.orders(problem)
        scored.append((problem.score(orders), orders))
    scored.sort(key=lambda item: item[0])
    return [orders for _, orders in scored[:keep]]
