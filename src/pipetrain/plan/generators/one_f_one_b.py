"""1F1B (PipeDream-Flush; Narayanan et al., arXiv 2104.04473 §2.2): one forward, one backward.

Rank r runs ``min(p - 1 - r, m)`` warm-up forwards, then alternates one forward with one
backward, then drains the remaining backwards. It is as long as GPipe but rank r never holds
more than ``min(p - r, m)`` microbatches' activations (GPipe holds m). Any m >= 1 works: with
fewer microbatches than ranks the warm-up simply covers them all.
"""

from __future__ import annotations

from collections.abc import Sequence

from pipetrain.plan.actions import Action
from pipetrain.plan.generators._common import B, F, Program, loop_placement, make_schedule
from pipetrain.plan.generators._registry import generator
from pipetrain.plan.schedule import Schedule

NAME = "1F1B"


def one_forward_one_backward(forwards: Sequence[Action], backwards: Sequence[Action], warmup: int) -> Program:
    """Warm-up forwards, then (forward, backward) pairs, then the remaining backwards.

    Shared by 1F1B and interleaved 1F1B: they differ only in the two orders and the warm-up.
    A rank then holds at most ``warmup + 1`` activations (fewer when everything fits the warm-up).
    """
    if len(forwards) != len(backwards):
        raise ValueError("as many backwards as forwards are needed")
    warmup = max(0, min(warmup, len(forwards)))
    program: Program = list(forwards[:warmup])
    for i, forward in enumerate(forwards[warmup:]):
        program += [forward, backwards[i]]
    program += backwards[len(forwards) - warmup :]
    return program


@generator(NAME, placement="loop", stages_per_rank=1, split_backward=False, several="Interleaved1F1B")
def build(num_ranks: int, num_microbatches: int, stages_per_rank: int | None) -> Schedule:
    """One forward, one backward; rank r holds at most p - r microbatches."""
    mbs = range(num_microbatches)
    programs: dict[int, Program] = {
        rank: one_forward_one_backward(
            [F(rank, m) for m in mbs], [B(rank, m) for m in mbs], warmup=num_ranks - 1 - rank
        )
        for rank in range(num_ranks)
    }
    return make_schedule(programs, loop_placement(num_ranks, 1), num_microbatches)
