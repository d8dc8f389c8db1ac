"""A layout's planning problem, in the units ``simulate`` counts memory in, and the orders that
need the least memory on it.

:func:`layout_problem` weighs memory as :mod:`pipetrain.plan.memory` does where that depends on the
order alone: a stage's activation, with the input it received from another rank, from its F's
start until its backward ends (split: what W reads, from I's end), and per rank static bytes and
the largest transient throughout. Message buffers in flight depend on timing: the planner
simulates what it finds and makes room for them (:func:`raised`).
"""

from __future__ import annotations

from collections.abc import Sequence

from pipetrain.plan.autoplan.problem import KIND_B, KIND_F, KIND_I, KIND_W, Orders, Problem
from pipetrain.plan.costs import Costs
from pipetrain.plan.generators._common import v_placement

__all__ = ["layout_problem", "one_at_a_time", "raised"]


def layout_problem(
    num_ranks: int,
    num_microbatches: int,
    costs: Costs,
    memory_limit: float | None,
    v: int,
    place: str,
    per_stage: bool,
) -> Problem:
    """The planning problem for one layout: ``v`` stages per rank placed in a loop or a V, costs cut
    into stages unless ``per_stage`` (measured per stage), memory in the units of ``memory_limit``
    (bytes with any byte cost, as ``simulate`` counts them, else a rank's share of activations)."""
    rank_of = (
        [v_placement(num_ranks)[s] for s in range(2 * num_ranks)]
        if place == "v"
        else [s % num_ranks for s in range(num_ranks * v)]
    )
    stage_costs = costs if per_stage else costs.for_layout(v)
    n = num_ranks * v
    if not stage_costs.in_bytes:
        weight = [1.0 if costs.prices_one_stage else 1.0 / v] * n
        return Problem.build(num_ranks, num_microbatches, rank_of, stage_costs, weight, memory_limit, place)

    def values(name: str) -> list[float]:
        return stage_costs.per_stage(name, n) if getattr(stage_costs, name) is not None else [0.0] * n

    act, msg = values("activation_bytes"), values("message_bytes")
    wgrad = act if stage_costs.weight_grad_bytes is None else values("weight_grad_bytes")
    static = values("static_bytes")
    both = stage_costs.transients(n)  # (F/I/W's, B's): the search holds the larger throughout
    transient = [max(a, b) for a, b in zip(*both, strict=True)] if both is not None else [0.0] * n
    received = [msg[s - 1] if s > 0 and rank_of[s - 1] != rank_of[s] else 0.0 for s in range(n)]
    base = [0.0] * num_ranks
    for r in range(num_ranks):
        mine = [s for s in range(n) if rank_of[s] == r]
        base[r] = sum(static[s] for s in mine) + max((transient[s] for s in mine), default=0.0)
    return Problem.build(
        num_ranks,
        num_microbatches,
        rank_of,
        stage_costs,
        [a + x for a, x in zip(act, received, strict=True)],
        memory_limit,
        place,
        held_after_i=[g + x for g, x in zip(wgrad, received, strict=True)],
        base=base,
    )


def one_at_a_time(problem: Problem) -> Orders:
    """Orders that run the microbatches one at a time, each stage's backward as one B, or as I then
    W at once where what W reads is less than the activation. A rank then holds one microbatch's
    activations and messages at most, as every order does when that microbatch's last stage
    starts its forward: the least memory the planner knows a layout to need, the same with any
    number of microbatches."""
    orders: Orders = [[] for _ in range(problem.num_ranks)]
    split = [g < a for a, g in zip(problem.weight, problem.after_i, strict=True)]
    for m in range(problem.num_microbatches):
        for s in range(problem.num_stages):
            orders[problem.stage_to_rank[s]].append(problem.code(KIND_F, s, m))
        for s in reversed(range(problem.num_stages)):
            kinds = (KIND_I, KIND_W) if split[s] else (KIND_B,)
            orders[problem.stage_to_rank[s]] += [problem.code(kind, s, m) for kind in kinds]
    return orders


def raised(problem: Problem, extra: Sequence[float]) -> Problem:
    """``problem`` with each rank holding ``extra[rank]`` more throughout (less room under its limit)."""
    if not any(extra):
        return problem
    base = problem.base or (0.0,) * problem.num_ranks
    return problem.retimed(
        problem.f,
        problem.i,
        problem.w,
        problem.weight,
        problem.limit,
        problem.b,
        problem.held_after_i,
        [b + x for b, x in zip(base, extra, strict=True)],
    )
