"""What a cut of the layers costs per stage, and the memory a rank needs for a given order.

The memory model is docs/semantics.md's "Planning the whole pipeline" and
:mod:`pipetrain.plan.memory`'s (which :func:`~pipetrain.plan.simulate` applies): per rank, static
bytes + the peak over time of (held activations and message buffers + the transient of the action
running then). The planner scores thousands of cuts, so it uses a fast form here: an order's
states are the counts of (stage, microbatch) held before their I or B ends and after their I
(until W), seen while each action runs, before and after it (a property of the order alone,
computed once per order: :func:`count_vectors`); a rank's peak is the largest
``sum(counts * held) + transient[acting stage]`` over them (:func:`vector_peak`), a stage's held
bytes being its activation (a recomputed stage: its input) before its I ends and what W reads
(``weight_grad_bytes``) from there to W, a received input with both. The other message buffers
add a margin of one of each. A stage's transient is what one of its backward passes rebuilds when
it recomputes plus its workspace (:meth:`Profile.workspace`: its layers' largest), counted while
one of its actions runs, exactly as :meth:`StageValues.costs` gives ``simulate``.
Every plan it returns is then simulated, and only one whose simulated peak fits is returned.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from dataclasses import dataclass
from itertools import combinations, pairwise

from pipetrain.plan.autoplan.problem import KIND_B, KIND_F, KIND_I, KIND_W, Orders, Problem
from pipetrain.plan.costs import Costs
from pipetrain.plan.pipeline.cuts import Cut
from pipetrain.plan.pipeline.layers import LayerCost

__all__ = ["Profile", "StageValues", "count_vectors", "masks_of", "vector_peak"]

Vectors = list[tuple[int, tuple[int, ...]]]
"""One rank's states under an order: (the acting stage's position among the rank's stages, the
counts held then). The counts are two per stage of the rank, in the rank's stage order: first the
(stage, microbatch) held before their I (or B) ends, then those held after their I until W
(Pareto-maximal per acting stage)."""


class Profile:
    """Prefix sums over a layer list: a stage's costs in O(1)."""

    def __init__(self, layers: Sequence[LayerCost]) -> None:
        self.layers = list(layers)
        self.n = len(self.layers)
        self.names = [layer.name for layer in self.layers]

        def prefix(values: Sequence[float]) -> list[float]:
            out = [0.0]
            for x in values:
                out.append(out[-1] + x)
            return out

        self.pf = prefix([layer.f for layer in self.layers])
        self.pi = prefix([layer.i or 0.0 for layer in self.layers])
        self.pw = prefix([layer.w or 0.0 for layer in self.layers])
        self.pb = prefix([layer.b or 0.0 for layer in self.layers])
        self.pa = prefix([layer.activation_bytes for layer in self.layers])
        self.pg = prefix([layer.weight_grad_bytes or 0.0 for layer in self.layers])
        self.ps = prefix([layer.static_bytes for layer in self.layers])
        self.out = [layer.output_bytes for layer in self.layers]
        # A stage's workspace (see workspace()), by a sparse table: row j holds the max over
        # x in k .. k + 2**j - 1 of workspace_bytes[x].
        self._work = _sparse([layer.workspace_bytes for layer in self.layers])
        self.times = [layer.time for layer in self.layers]
        self.static = [layer.static_bytes for layer in self.layers]

    def workspace(self, a: int, b: int) -> float:
        """The workspace of a stage of layers ``a .. b-1`` (0 for none): what one of its actions
        allocates beyond what the stage holds before and after it. A stage runs one layer's action
        at a time and its backward frees each layer's saved tensors as that layer's part ends (as
        plain autograd does), so the largest of its layers' ``workspace_bytes``. (``i_saved_bytes``
        is still measured; the model no longer needs it since I stopped holding them to its end.)"""
        if b <= a:
            return 0.0
        return _range_max(self._work, a, b)


def _sparse(values: list[float]) -> list[list[float]]:
    """Row j: the max of ``values`` over each window of 2**j (for :func:`_range_max`)."""
    table = [values]
    while 1 << len(table) <= len(values):
        row, half = table[-1], 1 << (len(table) - 1)
        table.append([max(row[k], row[k + half]) for k in range(len(row) - half)])
    return table


def _range_max(table: list[list[float]], a: int, b: int) -> float:
    """The max of the values at ``a .. b-1`` (``a < b``), from :func:`_sparse`'s table."""
    j = (b - a).bit_length() - 1
    return max(table[j][a], table[j][b - (1 << j)])


@dataclass(frozen=True)
class StageValues:
    """Per-stage values of one cut (before recompute): durations and bytes."""

    f: tuple[float, ...]
    i: tuple[float, ...]
    w: tuple[float, ...]
    b: tuple[float, ...]  # the backward in one pass (a B); i + w is it split
    act: tuple[float, ...]  # sum of activation_bytes
    wgrad: tuple[float, ...]  # sum of weight_grad_bytes (what a split backward keeps from I until W)
    inp: tuple[float, ...]  # the input's size (previous layer's output; 0 for stage 0)
    msg: tuple[float, ...]  # the output's size (last layer's output)
    static: tuple[float, ...]
    work: tuple[float, ...]  # its workspace (Profile.workspace)

    @classmethod
    def of(cls, profile: Profile, cut: Cut) -> StageValues:
        pf, pi, pw, pa, ps, out = profile.pf, profile.pi, profile.pw, profile.pa, profile.ps, profile.out
        pairs = list(pairwise(cut))
        return cls(
            tuple(pf[b] - pf[a] for a, b in pairs),
            tuple(pi[b] - pi[a] for a, b in pairs),
            tuple(pw[b] - pw[a] for a, b in pairs),
            tuple(profile.pb[b] - profile.pb[a] for a, b in pairs),
            tuple(pa[b] - pa[a] for a, b in pairs),
            tuple(profile.pg[b] - profile.pg[a] for a, b in pairs),
            tuple(out[a - 1] if a > 0 else 0.0 for a, _ in pairs),
            tuple(out[b - 1] for _, b in pairs),
            tuple(ps[b] - ps[a] for a, b in pairs),
            tuple(profile.workspace(a, b) for a, b in pairs),
        )

    def costs(self, recompute: frozenset[int], comm: float) -> Costs:
        """The per-stage :class:`Costs` that :func:`~pipetrain.plan.simulate` takes for this cut:
        a recomputed stage rebuilds its activations once per microbatch, in its first backward
        pass, as :func:`pipetrain.split.recompute` does: B (the layers' ``b``, the backward in one
        pass) and I each cost its F more, W nothing more (it runs the weight GEMMs from what I
        kept); it holds its input until I and W's operands (``weight_grad_bytes``) from I to W;
        its transient is :meth:`transient`; message sizes are the stages' outputs."""
        n = len(self.f)
        extra = [self.f[s] if s in recompute else 0.0 for s in range(n)]
        return Costs(
            f=list(self.f),
            b=[self.b[s] + extra[s] for s in range(n)],
            i=[self.i[s] + extra[s] for s in range(n)],
            w=list(self.w),
            comm=comm,
            activation_bytes=[self.inp[s] if s in recompute else self.act[s] for s in range(n)],
            weight_grad_bytes=list(self.wgrad),
            message_bytes=list(self.msg),
            static_bytes=list(self.static),
            transient_bytes=[self.transient(s, recompute) for s in range(n)],
        )

    def held(self, s: int, recompute: frozenset[int] | set[int]) -> float:
        """What a microbatch of stage ``s`` holds from its F's start until its I (or B) ends: its
        activation, a recomputed stage its input (``activation_bytes`` of :meth:`costs`)."""
        return self.inp[s] if s in recompute else self.act[s]

    def held_after_i(self, s: int) -> float:
        """What a microbatch of stage ``s`` holds from its I's end until its W ends: what W reads
        (``weight_grad_bytes``), with or without recompute."""
        return self.wgrad[s]

    def least_time(self, s: int) -> float:
        """Stage ``s``'s least compute per microbatch without recompute: F and the cheaper backward."""
        return self.f[s] + min(self.b[s], self.i[s] + self.w[s])

    def transient(self, s: int, recompute: frozenset[int] | set[int]) -> float:
        """What stage ``s`` allocates only while one of its actions runs: the activations a
        backward rebuilds when it recomputes, plus its workspace (:meth:`Profile.workspace`)."""
        return (self.act[s] if s in recompute else 0.0) + self.work[s]

    def rank_transient(self, stages: Sequence[int], recompute: frozenset[int] | set[int]) -> float:
        """The largest of a rank's stages' transients: what the construction's budget and the
        least-need estimate hold throughout, a bound on each counted at its own action's time."""
        return max((self.transient(s, recompute) for s in stages), default=0.0)


@functools.lru_cache(maxsize=1024)
def masks_of(stages: tuple[int, ...]) -> tuple[frozenset[int], ...]:
    """Every subset of ``stages`` (which of a rank's stages recompute), smallest first."""
    return tuple(frozenset(c) for k in range(len(stages) + 1) for c in combinations(stages, k))


def count_vectors(problem: Problem, orders: Orders, rank_stages: Sequence[Sequence[int]]) -> list[Vectors]:
    """Per rank, the states of ``orders`` (see :data:`Vectors`): before and after each action,
    what it holds while it runs, as :mod:`pipetrain.plan.memory` counts it (an F holds its
    activation from its start; an I trades it for what W reads at its end; W and B free at theirs)."""
    n_mb = problem.num_microbatches
    sm = problem.num_stages * n_mb
    out: list[Vectors] = []
    for rank, program in enumerate(orders):
        stages = list(rank_stages[rank])
        width = len(stages)
        pos = {s: k for k, s in enumerate(stages)}
        counts = [0] * (2 * width)
        seen: list[set[tuple[int, ...]]] = [set() for _ in stages]
        for code in program:
            kind, rest = divmod(code, sm)
            k = pos[rest // n_mb]
            if kind == KIND_F:
                counts[k] += 1
            else:
                seen[k].add(tuple(counts))
                if kind == KIND_I:
                    counts[k] -= 1
                    counts[width + k] += 1
                elif kind == KIND_W:
                    counts[width + k] -= 1
                elif kind == KIND_B:
                    counts[k] -= 1
                if kind != KIND_I:
                    continue
            seen[k].add(tuple(counts))
        states: Vectors = []
        for k, found in enumerate(seen):
            states += [(k, v) for v in sorted(_maximal(found))]
        out.append(states or [(0, tuple([0] * (2 * width)))])
    return out


def _maximal(vectors: set[tuple[int, ...]]) -> list[tuple[int, ...]]:
    """The Pareto-maximal ones of ``vectors``."""
    return [v for v in vectors if not any(u != v and all(a >= b for a, b in zip(u, v, strict=True)) for u in vectors)]


def vector_peak(states: Vectors, held: Sequence[float], transient: Sequence[float]) -> float:
    """A rank's peak of held bytes with the acting stage's transient over ``states``: ``held`` per
    count (the rank's stages before I, then after I), ``transient`` per stage of the rank."""
    return max(transient[k] + sum(c * h for c, h in zip(vec, held, strict=True)) for k, vec in states)
