"""What a cut of the layers costs per stage, and the memory a rank needs for a given order.

The memory model is docs/semantics.md's "Planning the whole pipeline" and
:mod:`pipetrain.plan.memory`'s (which :func:`~pipetrain.plan.simulate` applies): per rank, static
bytes + the peak of held activations and message buffers + the largest transient. The planner
scores thousands of cuts, so it uses a fast form here: a rank's peak of held activations under
an order is the largest ``sum(count[s] * held[s])`` over the counts of (stage, microbatch)
activations the order holds at once (a property of the order alone, computed once per order), a
received input is held with its stage's activation, and the other message buffers add a margin
of one of each. A stage's transient is what one of its backward passes rebuilds when it
recomputes plus its workspace (:meth:`Profile.workspace`: its layers' largest, with what a split
backward keeps of the others until the stage's I ends), a rank's the largest of its stages',
exactly as :meth:`StageValues.costs` gives ``simulate``.
Every plan it returns is then simulated, and only one whose simulated peak fits is returned.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from dataclasses import dataclass
from itertools import combinations, pairwise

from pipetrain.plan.autoplan.problem import KIND_B, KIND_F, KIND_W, Orders, Problem
from pipetrain.plan.costs import Costs
from pipetrain.plan.pipeline.cuts import Cut
from pipetrain.plan.pipeline.layers import LayerCost

__all__ = ["Profile", "StageValues", "count_vectors", "masks_of"]

Vectors = list[tuple[int, ...]]
"""Per rank: the counts of activations held at once, one entry per stage of the rank (Pareto-maximal)."""


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
        """What a microbatch of stage ``s`` holds at most between its F and its last backward (the
        fast checks' unit): a recomputed stage its input, then W's operands after I."""
        return max(self.inp[s], self.wgrad[s]) if s in recompute else self.act[s]

    def least_time(self, s: int) -> float:
        """Stage ``s``'s least compute per microbatch without recompute: F and the cheaper backward."""
        return self.f[s] + min(self.b[s], self.i[s] + self.w[s])

    def transient(self, s: int, recompute: frozenset[int] | set[int]) -> float:
        """What stage ``s`` allocates only while one of its actions runs: the activations a
        backward rebuilds when it recomputes, plus its workspace (:meth:`Profile.workspace`)."""
        return (self.act[s] if s in recompute else 0.0) + self.work[s]

    def rank_transient(self, stages: Sequence[int], recompute: frozenset[int] | set[int]) -> float:
        """A rank's transient: the largest of its stages' (one action at a time)."""
        return max((self.transient(s, recompute) for s in stages), default=0.0)


@functools.lru_cache(maxsize=1024)
def masks_of(stages: tuple[int, ...]) -> tuple[frozenset[int], ...]:
    """Every subset of ``stages`` (which of a rank's stages recompute), smallest first."""
    return tuple(frozenset(c) for k in range(len(stages) + 1) for c in combinations(stages, k))


def count_vectors(problem: Problem, orders: Orders, rank_stages: Sequence[Sequence[int]]) -> list[Vectors]:
    """Per rank, the Pareto-maximal counts of activations held at once by ``orders``, one entry
    per stage of ``rank_stages[rank]`` (a peak in bytes is the largest dot product with them)."""
    n_mb = problem.num_microbatches
    sm = problem.num_stages * n_mb
    out: list[Vectors] = []
    for rank, program in enumerate(orders):
        stages = list(rank_stages[rank])
        pos = {s: k for k, s in enumerate(stages)}
        counts = [0] * len(stages)
        seen: set[tuple[int, ...]] = set()
        for code in program:
            kind, rest = divmod(code, sm)
            k = pos[rest // n_mb]
            if kind == KIND_F:
                counts[k] += 1
                seen.add(tuple(counts))
            elif kind == KIND_W or kind == KIND_B:
                counts[k] -= 1
        maximal = [v for v in seen if not any(u != v and all(a >= b for a, b in zip(u, v, strict=True)) for u in seen)]
        out.append(sorted(maximal) or [tuple([0] * len(stages))])
    return out
