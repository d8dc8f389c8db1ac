"""GPipe (Huang et al., 2019): every forward of every microbatch, then every backward.

Simple and bubble-heavy: (p-1)/(m+p-1) idle at F=1, B=2, and each rank holds all m
microbatches' activations at its peak.
"""

from __future__ import annotations

from pipetrain.plan.generators._common import B, F, Program, loop_placement, make_schedule
from pipetrain.plan.generators._registry import generator
from pipetrain.plan.schedule import Schedule

NAME = "GPipe"


@generator(NAME, placement="loop", stages_per_rank=1, split_backward=False, several="LoopedBFS")
def build(num_ranks: int, num_microbatches: int, stages_per_rank: int | None) -> Schedule:
    """All forwards, then all backwards."""
    programs: dict[int, Program] = {}
    for rank in range(num_ranks):
        program: Program = [F(rank, m) for m in range(num_microbatches)]
        program += [B(rank, m) for m in range(num_microbatches)]
        programs[rank] = program
    return make_schedule(programs, loop_placement(num_ranks, 1), num_microbatches)
