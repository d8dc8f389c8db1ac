"""Looped breadth-first pipeline (Lamy-Poirier, arXiv 2211.05953).

Loop placement (rank r holds stages r, r + p, ...). A rank runs every microbatch's forward on
its first stage, then on its next stage, and so on; the backward pass mirrors the forward pass
exactly (last stage first, latest microbatch first). Each stage's work is contiguous, which is
what lets data-parallel gradient reduction and FSDP resharding of a stage start early; the price
is that every rank holds all ``v·m`` activations at its peak.
"""

from __future__ import annotations

from pipetrain.plan.generators._common import B, F, Program, loop_placement, loop_stages, make_schedule, require
from pipetrain.plan.generators._registry import generator
from pipetrain.plan.schedule import Schedule

NAME = "LoopedBFS"
DEFAULT_STAGES_PER_RANK = 2


@generator(NAME, placement="loop", split_backward=False)
def build(num_ranks: int, num_microbatches: int, stages_per_rank: int | None) -> Schedule:
    """Breadth-first over loop-placed stages: each stage's microbatches together."""
    v = DEFAULT_STAGES_PER_RANK if stages_per_rank is None else stages_per_rank
    require(v >= 1, NAME, f"stages_per_rank >= 1 (got {v})")
    mbs = range(num_microbatches)
    programs: dict[int, Program] = {}
    for rank in range(num_ranks):
        stages = loop_stages(rank, num_ranks, v)
        program: Program = [F(stage, m) for stage in stages for m in mbs]
        program += [B(stage, m) for stage in reversed(stages) for m in reversed(mbs)]
        programs[rank] = program
    return make_schedule(programs, loop_placement(num_ranks, v), num_microbatches)
