"""ZB-H1 and ZB-H2 (Qi et al., "Zero Bubble Pipeline Parallelism", arXiv 2401.10241, section 2).

One stage per rank; the backward is split into I (gradient for the input, the paper's "B") and
W (gradient for the weights). Only I lies on the critical path between ranks, so W can wait and
fill the pipeline's idle time. Both schedules are a warm-up of forwards followed by cycles of
"I, the W that is due, the next F", and a tail that runs the remaining I and W.

- ZB-H1 keeps 1F1B's activation peak: rank r warms up with ``p - r`` forwards and defers its W by
  ``r`` microbatches, so every rank holds at most ``p`` activations (1F1B's peak, on its rank 0;
  the deferred W keep them longer than 1F1B's ``p - r`` on later ranks), and the deferred W fill
  the cool-down. With T_W <= T_F, T_I the step takes ``m(F+I+W) + (p-1)(F+I-W)``: at equal costs
  a third of 1F1B's bubble.
- ZB-H2 spends memory to remove the bubble: rank r warms up with ``2(p-r)-1`` forwards and defers
  its W by ``2r``, so every rank holds at most ``2p-1``; the deferred W turn the cool-down from a
  trapezoid into a parallelogram. Rank r idles ``(p-1-r)(F+I-2W)`` inside its own span (the
  paper's ``(p-1)(F+I-2W)`` on rank 0): at equal costs no rank waits once it has started.

Both degrade gracefully: with fewer microbatches than the warm-up wants, a rank forwards all
of them first, and ZB-H2 shortens its W deferral to what the remaining microbatches can fill
(never below ZB-H1's), so with few microbatches it is never slower than ZB-H1.
"""

from __future__ import annotations

from pipetrain.plan.generators._common import Program, loop_placement, make_schedule
from pipetrain.plan.generators._registry import generator
from pipetrain.plan.generators.interleaved_zb import split_backward_program
from pipetrain.plan.schedule import Schedule

H1 = "ZBH1"
H2 = "ZBH2"


def rank_program(rank: int, num_microbatches: int, warmup: int, w_delay: int) -> Program:
    """The one-stage-per-rank case: microbatches in order on stage ``rank``."""
    order = [(rank, mb) for mb in range(num_microbatches)]
    return split_backward_program(order, order, warmup, w_delay)


@generator(H1, placement="loop", stages_per_rank=1, split_backward=True, several="InterleavedZeroBubble")
def build_h1(num_ranks: int, num_microbatches: int, stages_per_rank: int | None) -> Schedule:
    """Zero bubble H1: 1F1B's memory, a third of its bubble (W deferred into the cool-down)."""
    p = num_ranks
    programs = {r: rank_program(r, num_microbatches, warmup=p - r, w_delay=r) for r in range(p)}
    return make_schedule(programs, loop_placement(p, 1), num_microbatches)


@generator(H2, placement="loop", stages_per_rank=1, split_backward=True, several="InterleavedZeroBubble")
def build_h2(num_ranks: int, num_microbatches: int, stages_per_rank: int | None) -> Schedule:
    """Zero bubble H2: no idle time inside a rank's span, at up to 2p-1 activations."""
    p, m = num_ranks, num_microbatches
    programs: dict[int, Program] = {}
    for r in range(p):
        warmup = 2 * (p - r) - 1
        # W wait 2r cycles when the pipeline fills (m >= 2p-1); with fewer microbatches that
        # long a wait leaves the middle ranks idle, so wait only as long as there is work to do.
        w_delay = min(2 * r, max(r, m - warmup))
        programs[r] = rank_program(r, m, warmup=warmup, w_delay=w_delay)
    return make_schedule(programs, loop_placement(p, 1), m)
