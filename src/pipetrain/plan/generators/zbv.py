"""ZB-V (Qi et al., "Zero Bubble Pipeline Parallelism", arXiv 2401.10241, section 6).

The model is cut into 2p chunks placed in a V: rank r holds stage r (chunk 0, on the way down)
and stage 2p-1-r (chunk 1, on the way back). The backward is split into I (input grad, on the
critical path) and W (weight grad, free to move), and W fills what would be bubbles.

Per rank, in the paper's hand-crafted pattern (its figure for p=4, m=8):

1. warm-up: 2(p-r)-1 forwards of chunk 0, then r pairs (F chunk 1, F chunk 0), then p-r
   triples (F, I, W) of chunk 1 — the first backward reaches rank r just as it is free;
2. steady state: F, I, W of chunk 0, then F, I, W of chunk 1, until every forward is issued;
3. cool-down: r pairs (I chunk 0, I chunk 1), then p-r pairs (I chunk 0, W of the oldest
   chunk 0 grad), then the deferred W, chunk 1 first.

With T_F = T_I = T_W, no rank idles between its first and its last action (each rank's span is
exactly its 6m units of work; ranks start r units apart, as in the paper's parallelogram), and
a rank never holds more than 2p chunk activations: p activations of a 1F1B stage, the same
memory as 1F1B. The pattern needs m >= 2p-1 microbatches to fill the V; for fewer, the pattern
is built for 2p-1 and the missing microbatches' actions are dropped, which keeps every
dependency and the per-rank order (a subset closed under dependencies stays executable).

With m <= p the V never fills and that trimmed pattern leaves much of its warm-up idle. There
every activation fits anyway (2m <= 2p), so the order comes from a greedy list schedule at unit
costs instead: at each step a rank runs the startable action that matters most — an I (on the
critical path) before an F before a W (slack), the stage nearer the loss first. That is up to
~15% shorter than the trimmed pattern (p=16, m=16: 111 vs 126 units at F=I=W=1).
"""

from __future__ import annotations

import math
from collections import deque

from pipetrain.plan.actions import Action, ActionKind, new_action
from pipetrain.plan.dependencies import C_F, C_I, Dependencies
from pipetrain.plan.errors import ScheduleError
from pipetrain.plan.generators._common import I, Program, VRank, W, make_schedule, v_placement
from pipetrain.plan.generators._registry import generator
from pipetrain.plan.schedule import Schedule

NAME = "ZBVZeroBubble"


class _Rank(VRank):
    """A V rank whose input-gradients wait, per chunk, for their weight-gradient."""

    def __init__(self, rank: int, num_ranks: int) -> None:
        super().__init__(rank, num_ranks)
        self.pending_w: tuple[deque[int], deque[int]] = (deque(), deque())

    def f(self, chunk: int) -> None:
        self.program.append(self.take_f(chunk))

    def i(self, chunk: int) -> None:
        stage, mb = self.take_b(chunk)
        self.program.append(I(stage, mb))
        self.pending_w[chunk].append(mb)

    def w(self, chunk: int) -> None:
        self.program.append(W(self.stages[chunk], self.pending_w[chunk].popleft()))

    def iw(self, chunk: int) -> None:
        """The chunk's next I, then the W of its oldest waiting input-gradient."""
        self.i(chunk)
        self.w(chunk)

    def fiw(self, chunk: int) -> None:
        """F, I and W of the chunk in a row (the steady state's unit)."""
        self.f(chunk)
        self.iw(chunk)


# The pattern's moves: a kind on a chunk. Each chunk forwards, inputs-backward and
# weight-backwards its microbatches in order (a W takes the oldest I's microbatch, and the Is come
# in order), so a move's microbatch is how many of the same move came before it.
_F0, _F1, _I0, _I1, _W0, _W1 = range(6)
_MOVE_KINDS = (ActionKind.F, ActionKind.F, ActionKind.I, ActionKind.I, ActionKind.W, ActionKind.W)


def _rank_program(rank: int, num_ranks: int, n: int) -> Program:
    """The paper's per-rank order for n >= 2p-1 microbatches.

    Written as a list of moves (C-level list repetition for the phases), then made actions in one
    pass: a call or two per action instead of the half dozen of a method per move.
    """
    p = num_ranks
    moves = [_F0] * (2 * (p - rank) - 1) + [_F1, _F0] * rank + [_F1, _I1, _W1] * (p - rank)
    f0, f1 = 2 * (p - rank) - 1 + rank, p  # forwards issued per chunk so far
    while f0 < n or f1 < f0:
        if f0 < n:
            moves.append(_F0)
            f0 += 1
        moves += (_I0, _W0, _F1, _I1, _W1)
        f1 += 1
    moves += [_I0, _I1] * rank + [_I0, _W0] * (p - rank)
    # The deferred Ws, chunk 1 first: each chunk has `rank` Is without their W by now.
    moves += [_W1] * rank + [_W0] * rank
    stage = (rank, 2 * p - 1 - rank) * 3
    kinds = _MOVE_KINDS
    count = [0] * 6
    program: Program = []
    append = program.append
    new = new_action
    for move in moves:
        mb = count[move]
        count[move] = mb + 1
        append(new(Action, (stage[move], kinds[move], mb, None)))
    return program


def _list_schedule(num_ranks: int, num_microbatches: int) -> dict[int, Program]:
    """Greedy unit-time order for m <= p: I before F before W, the stage nearer the loss first."""
    p, m = num_ranks, num_microbatches
    last = 2 * p - 1
    ranks = [_Rank(r, p) for r in range(p)]
    w_order: list[deque[int]] = [deque() for _ in range(p)]  # chunks, in the order their I ran
    cap = [min(2 * m, m + 1 + r) for r in range(p)]  # no more than the trimmed pattern holds
    held = [0] * p
    placement = v_placement(p)
    deps = Dependencies(last + 1, m, [placement[s] for s in range(last + 1)], lowered=False)
    ends = [math.inf] * deps.SM * 3  # the step each product is ready

    def ready(code: int, s: int, mb: int, t: int) -> bool:
        return all(ends[key + mb] <= t for key in deps.need_keys[code][s])

    def pick(r: int, t: int) -> tuple[int, int] | None:
        """(0 for I or 1 for F, chunk) of the best action rank r can start at step t."""
        st = ranks[r]
        options: list[tuple[int, int, int]] = []
        for chunk, s in enumerate(st.stages):
            mb = st.next_b[chunk]
            if mb < m and ready(C_I, s, mb, t):
                options.append((0, -s, chunk))
            mb = st.next_f[chunk]
            if mb < m and held[r] < cap[r] and ready(C_F, s, mb, t):
                options.append((1, -s, chunk))
        if not options:
            return None
        kind, _, chunk = min(options)
        return kind, chunk

    remaining = 3 * (last + 1) * m
    t = 0
    while remaining:
        for r, st in enumerate(ranks):
            choice = pick(r, t)
            if choice is None and not w_order[r]:
                continue
            remaining -= 1
            if choice is None:
                st.w(w_order[r].popleft())
                held[r] -= 1
            elif choice[0] == 0:
                ends[deps.make_key[C_I][st.stages[choice[1]]] + st.next_b[choice[1]]] = t + 1
                st.i(choice[1])
                w_order[r].append(choice[1])
            else:
                ends[deps.make_key[C_F][st.stages[choice[1]]] + st.next_f[choice[1]]] = t + 1
                st.f(choice[1])
                held[r] += 1
        t += 1
        if t > 6 * (last + 1) * m:
            raise ScheduleError(f"{NAME}: internal error, list schedule stuck at p={p}, m={m}")
    return {r: st.program for r, st in enumerate(ranks)}


def _keep(action: Action, num_microbatches: int) -> bool:
    return action.microbatch is not None and action.microbatch < num_microbatches


@generator(NAME, placement="v", split_backward=True)
def build(num_ranks: int, num_microbatches: int, stages_per_rank: int | None) -> Schedule:
    """Zero bubble with 1F1B's memory: 2 chunks per rank in a V, F/I/W."""
    if num_microbatches <= num_ranks:
        return make_schedule(_list_schedule(num_ranks, num_microbatches), v_placement(num_ranks), num_microbatches)
    n = max(num_microbatches, 2 * num_ranks - 1)
    programs: dict[int, Program] = {}
    for rank in range(num_ranks):
        full = _rank_program(rank, num_ranks, n)
        # Trim the microbatches added to fill the V (none when m >= 2p-1).
        programs[rank] = (
            full if n == num_microbatches else [a for a in full if a is not None and _keep(a, num_microbatches)]
        )
    return make_schedule(programs, v_placement(num_ranks), num_microbatches)
