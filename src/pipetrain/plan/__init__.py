"""pipetrain.plan: the planning layer. Pure Python; never imports torch.

Schedules as data (:class:`Schedule` of :class:`Action`), a generator for every known schedule,
validation that rejects broken or deadlocking schedules before they run, lowering passes, a
cost-model simulator, timeline renderers and an auto-planner.
"""

from __future__ import annotations

from pipetrain.plan.actions import Action, ActionKind
from pipetrain.plan.errors import ScheduleError
from pipetrain.plan.generators import build_schedule, schedule_names
from pipetrain.plan.schedule import Schedule

__all__ = [
    "Action",
    "ActionKind",
    "Schedule",
    "ScheduleError",
    "build_schedule",
    "schedule_names",
]
