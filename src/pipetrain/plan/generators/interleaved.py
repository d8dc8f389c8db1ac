"""Interleaved 1F1B (Narayanan et al., arXiv 2104.04473 §2.2): 1F1B over v loop-placed stages per rank.

Each rank holds stages r, r + p, ..., r + (v-1)p. Microbatches go in groups of about p: a rank
runs a group's forwards on its first stage, then the same group on its next stage, and so on;
backwards mirror this, last stage first. After a warm-up of ``(v-1)·g + 2(p-1-r)`` forwards
(g: the first group's size) the rank alternates one forward with one backward. This cuts the
1F1B bubble by about v at ``(v-1)·g + 2(p-1-r) + 1`` activations on rank r.

Any number of microbatches works (torch 2.13 needs m to be a multiple of m // p). With
m < p there is one group of m. Otherwise there are ``m // p`` groups and the remainder is
spread over them, one extra microbatch each, larger groups first. Groups of at least p keep
every rank busy while a microbatch comes back around the loop (a short trailing group of
``m mod p``, as in Megatron, leaves ranks idle waiting for it), and a warm-up sized for the
largest group never waits on a backward whose forward is still queued behind it (a larger group
after a smaller first one can deadlock). When m is a multiple of m // p the programs are
torch's, and Megatron's when p divides m.
"""

from __future__ import annotations

from pipetrain.plan.actions import Action
from pipetrain.plan.generators._common import (
    B,
    F,
    Program,
    loop_placement,
    loop_stages,
    make_schedule,
    microbatch_groups,
    require,
)
from pipetrain.plan.generators._registry import generator
from pipetrain.plan.generators.one_f_one_b import one_forward_one_backward
from pipetrain.plan.schedule import Schedule

NAME = "Interleaved1F1B"
DEFAULT_STAGES_PER_RANK = 2


def warmup_forwards(rank: int, num_ranks: int, stages_per_rank: int, first_group: int) -> int:
    """Forwards rank ``rank`` runs before its first backward (before capping at the total).

    With one stage per rank this is plain 1F1B's warm-up; with several, the first backward of a
    rank's first chunk returns through every later chunk, so the rank-dependent part doubles.
    """
    if stages_per_rank == 1:
        return num_ranks - 1 - rank
    return (stages_per_rank - 1) * first_group + 2 * (num_ranks - 1 - rank)


def rank_orders(
    rank: int, num_ranks: int, stages_per_rank: int, groups: list[range]
) -> tuple[list[Action], list[Action]]:
    """The forward order and the backward order of one rank's (stage, microbatch) pairs."""
    stages = loop_stages(rank, num_ranks, stages_per_rank)
    forwards = [F(stage, m) for group in groups for stage in stages for m in group]
    backwards = [B(stage, m) for group in groups for stage in reversed(stages) for m in group]
    return forwards, backwards


@generator(NAME, placement="loop", split_backward=False, aliases=("FlexibleInterleaved1F1B",))
def build(num_ranks: int, num_microbatches: int, stages_per_rank: int | None) -> Schedule:
    """1F1B over several loop-placed stages per rank (Megatron), any number of microbatches."""
    v = DEFAULT_STAGES_PER_RANK if stages_per_rank is None else stages_per_rank
    require(v >= 1, NAME, f"stages_per_rank >= 1 (got {v})")
    groups = microbatch_groups(num_ranks, num_microbatches)
    programs: dict[int, Program] = {}
    for rank in range(num_ranks):
        forwards, backwards = rank_orders(rank, num_ranks, v, groups)
        warmup = warmup_forwards(rank, num_ranks, v, len(groups[0]))
        programs[rank] = one_forward_one_backward(forwards, backwards, warmup)
    return make_schedule(programs, loop_placement(num_ranks, v), num_microbatches)
