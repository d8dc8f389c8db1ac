"""InterleavedZeroBubble: ZB1P (arXiv 2401.10241) with virtual stages in loop placement.

Rank r holds stages r, r+P, r+2P, ... (v stages per rank). The backward is split into I (input
gradient, on the critical path between ranks) and W (weight gradient, free to wait).

The order is Megatron's depth-first interleaving (arXiv 2104.04473) with ZB-H1's treatment of W:
microbatches go in rounds of about P; within a round a rank runs the forwards of its first
stage, then of its second, ..., and the input-backwards of its stages in the reverse order.
Rank r warms up with ``(v-1)*g + P - r`` forwards (g = size of the first round), then runs
cycles of "next I, due W, next F", deferring each W by r cycles so that the deferred W fill the
cool-down, as in ZB-H1. Every rank holds at most ``(v-1)*g + P`` activations. Rounds need not be
equal (sizes differ by at most one), so every number of microbatches works (torch 2.13 needs m
to be a multiple of its round count).

At F = I = W and free communication the step ends at ``3vm + P - 1`` for every m >= P: rank P-1
cannot start earlier nor do less, so that is the lower bound. With v = 1 this is ZB-H1.
"""

from __future__ import annotations

from collections.abc import Sequence

from pipetrain.plan.generators._common import F, I, Program, W, loop_placement, make_schedule, microbatch_groups
from pipetrain.plan.generators._registry import generator
from pipetrain.plan.schedule import Schedule

NAME = "InterleavedZeroBubble"
DEFAULT_STAGES_PER_RANK = 2


def split_backward_program(
    forwards: Sequence[tuple[int, int]], backwards: Sequence[tuple[int, int]], warmup: int, w_delay: int
) -> Program:
    """One rank's F/I/W order from its forward and input-backward orders of (stage, microbatch).

    Shared with ZB-H1 and ZB-H2 (zb_h.py), which are its one-stage-per-rank cases.

    ``warmup`` forwards first; then cycles of: the next I, the W that are due, the next F. A W runs
    once more than ``w_delay`` I are waiting for theirs, so the rank holds at most
    ``warmup + w_delay`` activations; the W still owed at the end run last.
    """
    program: Program = [F(s, mb) for s, mb in forwards[:warmup]]
    next_f = min(warmup, len(forwards))
    next_w = 0
    for k, (s, mb) in enumerate(backwards):
        program.append(I(s, mb))
        while next_w < k + 1 - w_delay:
            program.append(W(*backwards[next_w]))
            next_w += 1
        if next_f < len(forwards):
            program.append(F(*forwards[next_f]))
            next_f += 1
    program += [W(s, mb) for s, mb in backwards[next_w:]]
    return program


def memory_cap(num_ranks: int, num_microbatches: int, stages_per_rank: int) -> int:
    """Most activations any rank holds: ``(v-1)*g + P``, and never more than all v*m."""
    g = len(microbatch_groups(num_ranks, num_microbatches)[0])
    return min(stages_per_rank * num_microbatches, (stages_per_rank - 1) * g + num_ranks)


def rank_program(rank: int, num_ranks: int, num_microbatches: int, stages_per_rank: int) -> Program:
    p, v = num_ranks, stages_per_rank
    blocks = microbatch_groups(p, num_microbatches)
    local = [rank + k * p for k in range(v)]
    forwards = [(s, mb) for block in blocks for s in local for mb in block]
    backwards = [(s, mb) for block in blocks for s in reversed(local) for mb in block]
    warmup = (v - 1) * len(blocks[0]) + p - rank
    return split_backward_program(forwards, backwards, warmup=warmup, w_delay=rank)


@generator(NAME, placement="loop", split_backward=True)
def build(num_ranks: int, num_microbatches: int, stages_per_rank: int | None) -> Schedule:
    """ZB1P with virtual stages: depth-first interleaving, deferred W fill the bubbles."""
    v = DEFAULT_STAGES_PER_RANK if stages_per_rank is None else stages_per_rank
    programs = {r: rank_program(r, num_ranks, num_microbatches, v) for r in range(num_ranks)}
    return make_schedule(programs, loop_placement(num_ranks, v), num_microbatches)
