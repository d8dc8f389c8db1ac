"""Memory-aware list scheduling: build per-rank orders by simulating the pipeline and, whenever a
rank is free, choosing one of its ready actions by a :class:`Policy`.

Forwards are admitted only while the state stays *safe* (the banker's rule): ordering the
microbatches in flight oldest first, each one's remaining forwards must fit in what the rank would
have once every older microbatch had finished. A forward reserves the most its (stage, microbatch)
holds until its backward ends (split: the larger of its activation and what W reads), so backward
and weight-gradient actions need no memory, a safe state can always be finished, and the list
scheduler never deadlocks on memory, however tight the limit (down to one microbatch's own).
"""

from __future__ import annotations

import heapq
import random
from dataclasses import dataclass

from pipetrain.plan.autoplan.problem import KIND_B, KIND_F, KIND_I, KIND_W, Orders, Problem

__all__ = ["Policy", "list_schedule"]

_EPS = 1e-9


@dataclass(frozen=True)
class Policy:
    """How a free rank picks among its ready actions.

    ``forward_first``: a ready forward before a ready backward (fills the pipeline, GPipe-like).
    ``max_inflight``: at most this many microbatches between their first forward and last backward.
    ``deep_first``: among ready forwards, the later stage first (finishes microbatches sooner).
    ``split``: backward as I then W (W fills gaps and releases memory); False runs B.
    ``eager_w``: W right after it becomes ready, before other work.
    ``w_fit``: W as a gap filler only if it ends before the rank's next input arrives.
    ``noise``: random jitter on tie-breaks (for restarts).
    """

    forward_first: bool = False
    max_inflight: int | None = None
    deep_first: bool = True
    split: bool = True
    eager_w: bool = False
    w_fit: bool = False
    noise: float = 0.0


def list_schedule(problem: Problem, policy: Policy, rng: random.Random | None = None) -> Orders | None:
    """Per-rank orders built by ``policy``, or None when its admission rule starves the pipeline."""
    return _ListScheduler(problem, policy, rng).run()


class _ListScheduler:
    """The state of one list-scheduling run (one object per run; the search runs many)."""

    def __init__(self, problem: Problem, policy: Policy, rng: random.Random | None) -> None:
        self.p = problem
        self.policy = policy
        self.t = problem.tables
        n_st, n_mb, n_rk = problem.num_stages, problem.num_microbatches, problem.num_ranks
        self.sm = sm = n_st * n_mb
        self.n_mb = n_mb
        self.x_kind = KIND_I if policy.split else KIND_B
        self.jitter = rng.random if (rng is not None and policy.noise > 0) else None
        rank_of = problem.stage_to_rank
        # What a forward reserves until its backward ends (see the module docs).
        self.weight = weight = problem.hold if policy.split else problem.weight
        per_mb = [0.0] * n_rk  # one microbatch's activations on each rank
        for st in range(n_st):
            per_mb[rank_of[st]] += weight[st]
        self.per_mb = per_mb
        self.need = [list(per_mb) for _ in range(n_mb)]  # forwards of m still to run, per rank
        self.held_mb = [[0.0] * n_rk for _ in range(n_mb)]
        self.left = [n_st * (3 if policy.split else 2)] * n_mb  # actions of m not yet started
        self.held = [0.0] * n_rk
        self.inflight: list[int] = []
        self.unmet = [0] * (4 * sm)
        self.arrival = [0.0] * (4 * sm)
        x_base = self.x_kind * sm
        for st in range(n_st):
            for m in range(n_mb):
                pair = st * n_mb + m
                self.unmet[pair] = 1 if st > 0 else 0
                self.unmet[x_base + pair] = 2 if st < n_st - 1 else 1
                self.unmet[2 * sm + pair] = 1
        # Forwards and backwards wait on other ranks (few per rank); W only on its own I, so it is
        # ready when it joins and waits in a heap keyed by microbatch.
        self.waiting: list[list[int]] = [[] for _ in range(n_rk)]
        self.ws: list[list[tuple[float, int]]] = [[] for _ in range(n_rk)]
        self.first = rank_of[0]
        self.waiting[self.first].append(0)  # F(0, 0); F(0, m+1) joins when F(0, m) starts
        self.free = [0.0] * n_rk
        self.wake = [0.0] * n_rk
        self.events: list[tuple[float, int]] = [(0.0, self.first)]
        self.orders: Orders = [[] for _ in range(n_rk)]

    def run(self) -> Orders | None:
        t, sm, n_mb = self.t, self.sm, self.n_mb
        weight = self.weight
        events, free, wake, waiting, ws = self.events, self.free, self.wake, self.waiting, self.ws
        held, held_mb, need, left, inflight = self.held, self.held_mb, self.need, self.left, self.inflight
        done = 0
        total = sum(self.left)
        while events:
            now, r = heapq.heappop(events)
            if now < free[r] - _EPS or now < wake[r] - _EPS or not (waiting[r] or ws[r]):
                continue
            code = self._choose(r, now)
            if code is None:
                later = [self.arrival[c] for c in waiting[r] if self.arrival[c] > now + _EPS]
                if later:
                    wake[r] = min(later)
                    heapq.heappush(events, (wake[r], r))
                else:
                    wake[r] = free[r]
                continue
            kind, rest = divmod(code, sm)
            st, m = divmod(rest, n_mb)
            a = weight[st]
            if kind == KIND_F:
                if st == 0:
                    inflight.append(m)
                    if m + 1 < n_mb:
                        waiting[r].append(m + 1)
                held[r] += a
                held_mb[m][r] += a
                need[m][r] -= a
            elif kind == KIND_W or kind == KIND_B:
                held[r] -= a
                held_mb[m][r] -= a
            left[m] -= 1
            end = now + t.dur[code]
            if left[m] == 0:
                inflight.remove(m)
                first = self.first
                if first != r and (waiting[first] or ws[first]) and wake[first] <= free[first]:
                    wake[first] = max(free[first], now)  # a sleeping first rank may admit again
                    heapq.heappush(events, (wake[first], first))
            free[r] = end
            self.orders[r].append(code)
            done += 1
            self._release(code, kind, st, rest, end)
            wake[r] = end
            heapq.heappush(events, (end, r))
        return self.orders if done == total else None

    def _release(self, code: int, kind: int, st: int, rest: int, end: float) -> None:
        """Hand ``code``'s product to the actions waiting for it (the core's rules, inverted)."""
        t, sm, n_mb = self.t, self.sm, self.n_mb
        m = rest % n_mb
        out = t.out[code]
        for user, stage in t.users[kind][st]:
            if user == KIND_W:  # a W is a gap filler, queued apart once its I ran
                if kind == KIND_I:
                    jitter = self.jitter
                    key = m + (self.policy.noise * jitter() if jitter is not None else 0.0)
                    heapq.heappush(self.ws[t.rank[code]], (key, KIND_W * sm + rest))
                continue
            if user != KIND_F and user != self.x_kind:
                continue  # the backward runs as the other kind
            c = user * sm + stage * n_mb + m
            arrive = end + (t.lat1[c] if t.dep1[c] == out else t.lat2[c])
            if arrive > self.arrival[c]:
                self.arrival[c] = arrive
            self.unmet[c] -= 1
            if self.unmet[c] == 0:
                r = t.rank[c]
                self.waiting[r].append(c)
                when = max(self.free[r], self.arrival[c])
                if when < self.wake[r] or self.wake[r] <= self.free[r]:
                    self.wake[r] = when
                    heapq.heappush(self.events, (when, r))

    def _safe(self, r: int, m: int, a: float) -> bool:
        limit = self.p.room(r)
        if limit is None:
            return True
        bound = limit + _EPS
        held = self.held[r]
        if held + a > bound:
            return False
        if held + a + self.per_mb[r] <= bound:  # no older microbatch can need more than this
            return True
        acc = 0.0
        held_mb, need = self.held_mb, self.need
        for j in reversed(self.inflight):  # youngest first: acc = what j and younger hold on r
            acc += held_mb[j][r]
            if j < m and need[j][r] + acc + a > bound:
                return False
        return True

    def _choose(self, r: int, now: float) -> int | None:
        policy = self.policy
        sm, n_mb = self.sm, self.n_mb
        arrival = self.arrival
        weight = self.weight
        jitter = self.jitter
        noise = policy.noise
        best_back: tuple[float, int] | None = None
        best_fwd: tuple[float, int] | None = None
        blocked = False
        next_arrival = float("inf")
        cap = policy.max_inflight
        for c in self.waiting[r]:
            if arrival[c] > now + _EPS:
                if arrival[c] < next_arrival:
                    next_arrival = arrival[c]
                continue
            kind, rest = divmod(c, sm)
            st, m = divmod(rest, n_mb)
            j = noise * jitter() if jitter is not None else 0.0
            if kind == KIND_F:
                if st == 0 and cap is not None and len(self.inflight) >= cap:
                    continue
                if not self._safe(r, m, weight[st]):
                    blocked = True
                    continue
                key = (-st * n_mb + m + j) if policy.deep_first else (m * 1000 - st + j)
                if best_fwd is None or key < best_fwd[0]:
                    best_fwd = (key, c)
            else:
                key = m - st * 1e-3 + j
                if best_back is None or key < best_back[0]:
                    best_back = (key, c)
        heap = self.ws[r]
        if heap and (policy.eager_w or (blocked and best_back is None)):
            return self._take(r, heapq.heappop(heap)[1])
        first, second = (best_fwd, best_back) if policy.forward_first else (best_back, best_fwd)
        choice = first or second
        if choice is not None:
            return self._take(r, choice[1])
        if heap:
            c = heap[0][1]
            if not policy.w_fit or now + self.t.dur[c] <= next_arrival + _EPS:
                return heapq.heappop(heap)[1]
        return None

    def _take(self, r: int, code: int) -> int:
        if code // self.sm != KIND_W:
            self.waiting[r].remove(code)
        return code
