"""Schedule generators, one module per family; each registers itself on import.

A generator emits compute actions only (F, B, I, W, OVERLAP_F_B). Communication, FSDP and
gradient-reduction actions are added by the lowering passes, the same for every schedule.
"""

from __future__ import annotations

from pipetrain.plan.generators._registry import (
    ScheduleFamily,
    build_schedule,
    did_you_mean,
    family,
    register,
    schedule_names,
)

# Importing a family module registers it; the order here is the order of schedule_names().
from pipetrain.plan.generators import (  # noqa: F401  isort: skip
    gpipe,
    one_f_one_b,
    interleaved,
    looped_bfs,
    interleaved_zb,
    zbv,
    dualpipe_v,
    zb_h,
    forward_only,
)

__all__ = ["ScheduleFamily", "build_schedule", "did_you_mean", "family", "register", "schedule_names"]
