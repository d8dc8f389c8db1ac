"""Forward only (inference): every stage's forward of every microbatch, no backward.

With several stages per rank (loop placement) a rank runs all microbatches on its first stage,
then on its next one (breadth-first): a microbatch needs p steps to come back around the loop,
so with m >= p (plus latency) no rank ever waits after its first forward. Activations are
freed when each forward ends.
"""

from __future__ import annotations

from pipetrain.plan.generators._common import F, Program, loop_placement, loop_stages, make_schedule, require
from pipetrain.plan.generators._registry import generator
from pipetrain.plan.schedule import Schedule

NAME = "ForwardOnly"


@generator(NAME, placement="loop", split_backward=False)
def build(num_ranks: int, num_microbatches: int, stages_per_rank: int | None) -> Schedule:
    """Forward passes only (inference), breadth-first over a rank's stages."""
    v = 1 if stages_per_rank is None else stages_per_rank
    require(v >= 1, NAME, f"stages_per_rank >= 1 (got {v})")
    programs: dict[int, Program] = {
        rank: [F(stage, m) for stage in loop_stages(rank, num_ranks, v) for m in range(num_microbatches)]
        for rank in range(num_ranks)
    }
    return make_schedule(programs, loop_placement(num_ranks, v), num_microbatches)
