"""``pipetrain train --schedule auto``: train a few steps with a named schedule while measuring them,
plan for the measured costs within that schedule's memory, and train on with the plan.

The profiled schedule fixes the layout (stages per rank and their placement), so the stages stay
where they are; the plan may only reorder their actions. Planning runs on rank 0 (the search is
time-limited, so two ranks could find different orders) and every rank takes rank 0's schedule.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch.distributed as dist

from pipetrain.plan import Schedule, build_schedule, costs_from_timelines, plan_schedule, simulate
from pipetrain.plan.timeline import Timeline

__all__ = [
    "PROFILE_STEPS",
    "AutoPlan",
    "is_auto",
    "plan_from_profile",
    "profiled_schedule",
    "share_plan",
    "write_profile",
]

PROFILE_STEPS = 3
"""Steps measured before planning (they train like every other step)."""


def is_auto(name: str) -> bool:
    return name.strip().lower() == "auto"


def profiled_schedule(num_ranks: int, num_microbatches: int, stages_per_rank: int | None) -> Schedule:
    """The named schedule measured before planning: ZB-V for 2 stages per rank (the default), ZB-H1
    for 1, InterleavedZeroBubble for more; all split the backward, so I and W are measured."""
    v = stages_per_rank or 2
    name = {1: "ZBH1", 2: "ZBVZeroBubble"}.get(v, "InterleavedZeroBubble")
    return build_schedule(name, num_ranks, num_microbatches, v)


@dataclass(frozen=True)
class AutoPlan:
    """What rank 0 planned, as every rank receives it."""

    schedule: Schedule
    summary: str


def plan_from_profile(profiled: Schedule, timelines: list[Timeline], time_limit: float) -> AutoPlan:
    """The fastest schedule (simulated) for the costs measured in ``timelines``, holding no more
    stage activations per rank than ``profiled`` does, in ``profiled``'s layout."""
    n = profiled.num_stages
    p = profiled.num_ranks
    v = n // p
    costs = costs_from_timelines(timelines, n, activation_bytes=[1.0] * n)
    base = simulate(profiled, costs)
    limit = float(max(base.peak_memory.values()))
    placement = ("v" if profiled.stage_to_rank.get(2 * p - 1) == 0 else "loop") if v == 2 else None
    found = plan_schedule(
        p,
        profiled.num_microbatches,
        costs,
        limit,
        stages_per_rank=v,
        placement=placement,
        time_limit=time_limit,
    )
    speedup = base.makespan / found.makespan if found.makespan > 0 else 1.0
    summary = (
        f"auto: measured {len(timelines)} steps of {profiled.name}; planned {found.schedule.name}, "
        f"simulated step {found.makespan * 1e3:.3g} ms vs {profiled.name}'s {base.makespan * 1e3:.3g} ms "
        f"({speedup:.3f}x), at most {found.memory:g} of {limit:g} stage activations per rank"
    )
    return AutoPlan(found.schedule, summary)


def write_profile(path: str, schedule: Schedule, timelines: list[Timeline]) -> None:
    """Rank 0 writes the measured costs (``--costs`` form, one value per stage) to ``path``."""
    if dist.get_rank() != 0:
        return
    costs = costs_from_timelines(timelines, schedule.num_stages)
    with open(path, "w", encoding="utf-8") as handle:
        handle.write(f"{costs}\n")
    print(
        f"measured {len(timelines)} steps of {schedule.name or 'the schedule'}: wrote {path} "
        f"(pipetrain plan -p {schedule.num_ranks} -m {schedule.num_microbatches} --from-profile {path})"
    )


def share_plan(plan: AutoPlan | None, group: Any = None) -> AutoPlan:
    """Rank 0's plan on every rank (a collective)."""
    box: list[Any] = [None]
    if dist.get_rank(group) == 0:
        assert plan is not None
        box[0] = (plan.schedule.to_json(), plan.summary)
    dist.broadcast_object_list(box, src=0, group=group)
    text, summary = box[0]
    return AutoPlan(Schedule.from_json_text(text), summary)
