"""pipetrain.plan: the planning layer. Pure Python; never imports torch.

Schedules as data (:class:`Schedule` of :class:`Action`), a generator for every known schedule,
validation that rejects broken or deadlocking schedules before they run, lowering passes, a
cost-model simulator, timelines and an auto-planner.
"""

from __future__ import annotations

from pipetrain.plan.actions import Action, ActionKind
from pipetrain.plan.costs import Costs
from pipetrain.plan.errors import ScheduleError
from pipetrain.plan.generators import build_schedule, schedule_names
from pipetrain.plan.measure import costs_from_timelines
from pipetrain.plan.pipeline import (
    LayerCost,
    PipelinePlan,
    plan_pipeline,
    read_layers,
    static_bytes_for,
    write_layers,
)
from pipetrain.plan.schedule import Schedule
from pipetrain.plan.search import Plan, auto_schedule, plan_schedule, rank_schedules
from pipetrain.plan.simulate import SimResult, simulate
from pipetrain.plan.timeline import Timeline, TimelineEvent

__all__ = [
    "Action",
    "ActionKind",
    "Costs",
    "LayerCost",
    "PipelinePlan",
    "Plan",
    "Schedule",
    "ScheduleError",
    "SimResult",
    "Timeline",
    "TimelineEvent",
    "auto_schedule",
    "build_schedule",
    "costs_from_timelines",
    "plan_pipeline",
    "plan_schedule",
    "rank_schedules",
    "read_layers",
    "schedule_names",
    "simulate",
    "static_bytes_for",
    "write_layers",
]
