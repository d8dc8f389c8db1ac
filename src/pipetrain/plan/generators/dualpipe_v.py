"""DualPipe-V (DeepSeek, after DualPipe in the DeepSeek-V3 report, arXiv 2412.19437).

DualPipe runs two pipelines in opposite directions so that one direction's forward overlaps the
other's backward. DualPipe-V is DualPipe "cut in half": the same pattern on a V placement (rank r
holds stage r and stage 2p-1-r), so each rank keeps one copy of its parameters instead of two.
The steady state issues ``(F;B)OVERLAP_F_B`` pairs — a forward of one chunk beside a full
backward of the other — that a model can run concurrently to hide communication (MoE
all-to-all). Per rank r (chunk 0 = stage r, chunk 1 = stage 2p-1-r):

1. 2(p-r-1) forwards of chunk 0, then r+1 pairs (F chunk 0, F chunk 1);
2. p-r-1 triples (I chunk 1, W, F chunk 1): zero-bubble style, the W fills the wait;
3. the main phase: pairs ``(F0;B1)``, ``(F1;B0)`` (on the last rank the very first F0, B1 are
   issued apart, so chunk 0's output leaves before the backward starts);
4. p-r-1 times B chunk 1, ``(F1;B0)``; then r+1 pairs of backwards (chunk 1, chunk 0), the
   second half of them split into I and W; then p-r-1 times (W, I chunk 0); then the last W.

W actions run in the order their I ran (one queue per rank). DeepSeek's README gives a bubble of
(p-1)(F&B + B - 3W) and at most 2p+1 chunk activations per rank (PP+1 with PP = 2p stages).
DualPipe-V needs m >= 2p-1 microbatches to fill its pattern (DeepSeek and torch ask m >= 2p);
for fewer, the pattern is built for 2p-1 and the missing microbatches' actions are dropped,
an overlapped pair losing a part becoming a plain action. That subset is closed under
dependencies, so the result keeps every dependency and cannot deadlock.
"""

from __future__ import annotations

from collections import deque

from pipetrain.plan.actions import Action
from pipetrain.plan.generators._common import B, I, Program, VRank, W, make_schedule, v_placement
from pipetrain.plan.generators._registry import generator
from pipetrain.plan.schedule import Schedule

NAME = "DualPipeV"


class _Rank(VRank):
    """A V rank that may split a backward, queueing its weight-gradient half."""

    def __init__(self, rank: int, num_ranks: int) -> None:
        super().__init__(rank, num_ranks)
        self.pending_w: deque[Action] = deque()

    def fwd(self, chunk: int) -> Action:
        return self.take_f(chunk)

    def bwd(self, chunk: int, split: bool = False) -> Action:
        """A full backward, or its input-grad half with the weight-grad half queued."""
        stage, mb = self.take_b(chunk)
        if split:
            self.pending_w.append(W(stage, mb))
            return I(stage, mb)
        return B(stage, mb)

    def emit(self, *parts: Action) -> None:
        self.program.append(parts[0] if len(parts) == 1 else Action.overlap(*parts))

    def weight(self) -> None:
        if self.pending_w:
            self.program.append(self.pending_w.popleft())


def _rank_program(rank: int, num_ranks: int, n: int) -> Program:
    """DualPipe-V's order for one rank with n >= 2p-1 microbatches."""
    p = num_ranks
    below = p - rank - 1  # ranks after this one
    st = _Rank(rank, p)
    for _ in range(2 * below):
        st.emit(st.fwd(0))
    for _ in range(rank + 1):
        st.emit(st.fwd(0))
        st.emit(st.fwd(1))
    for _ in range(below):
        st.emit(st.bwd(1, split=True))
        st.weight()
        st.emit(st.fwd(1))
    for k in range(n - 2 * p + rank + 1):
        if k == 0 and rank == p - 1:
            st.emit(st.fwd(0))
            st.emit(st.bwd(1))
        else:
            st.emit(st.fwd(0), st.bwd(1))
        st.emit(st.fwd(1), st.bwd(0))
    for _ in range(below):
        st.emit(st.bwd(1))
        st.emit(st.fwd(1), st.bwd(0))
    # Cool-down: the later half of these backwards is split so their W can fill the drain.
    half = (rank + 1) // 2
    split = False
    for k in range(rank + 1):
        if k == half and rank % 2 == 1:
            split = True
        st.emit(st.bwd(1, split))
        if k == half and rank % 2 == 0:
            split = True
        st.emit(st.bwd(0, split))
    for _ in range(below):
        st.weight()
        st.emit(st.bwd(0, split=True))
    while st.pending_w:
        st.weight()
    return st.program


def _restrict(action: Action | None, num_microbatches: int) -> Action | None:
    """Drop the parts that name microbatches >= num_microbatches (padding)."""
    if action is None:
        return None
    kept = [part for part in action.parts if part.microbatch is not None and part.microbatch < num_microbatches]
    if not kept:
        return None
    return kept[0] if len(kept) == 1 else Action.overlap(*kept)


@generator(NAME, placement="v", split_backward=True)
def build(num_ranks: int, num_microbatches: int, stages_per_rank: int | None) -> Schedule:
    """DeepSeek's DualPipe cut in half: V placement, overlapped F&B pairs."""
    n = max(num_microbatches, 2 * num_ranks - 1)
    programs: dict[int, Program] = {}
    for rank in range(num_ranks):
        kept = (_restrict(a, num_microbatches) for a in _rank_program(rank, num_ranks, n))
        programs[rank] = [a for a in kept if a is not None]
    return make_schedule(programs, v_placement(num_ranks), num_microbatches)
