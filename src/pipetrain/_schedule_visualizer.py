"""torch's ``pipelining._schedule_visualizer.get_schedule_ops``: a named schedule's actions per
rank, compute-only or lowered by torch's rules (:mod:`pipetrain._torch_lowering`), without any
process group. Pictures come from pipetrain's own renderer (``pipetrain simulate NAME --png x.png``,
:func:`pipetrain.plan.render.render_timeline`)."""

from __future__ import annotations

from typing import Any

from pipetrain._torch_lowering import _add_reduce_grad, _add_send_recv, _add_unshard_reshard, _defer_recv_ops
from pipetrain.errors import PipelineError
from pipetrain.plan import Action, build_schedule
from pipetrain.runtime.custom import CustomAction

__all__ = ["get_schedule_ops", "visualize_schedule"]


def get_schedule_ops(
    schedule: str | type[Any],
    pp_degree: int,
    num_microbatches: int,
    num_stages_per_rank: int | None = None,
    add_spacing: bool = False,
    with_comms: bool = False,
    defer_pp_recv: bool = False,
) -> list[list[CustomAction | None]]:
    """Each rank's actions of ``schedule`` (a name, or a schedule class) for ``pp_degree`` ranks.

    ``with_comms``: lowered as torch lowers (FSDP gathers, gradient reduction, sends and
    receives; receives as early as their send allows, or just before their use with
    ``defer_pp_recv``). ``add_spacing`` is torch's picture layout: not offered here.
    """
    if add_spacing:
        raise PipelineError(
            "get_schedule_ops(add_spacing=True) lays actions out for torch's picture; pipetrain draws "
            "timelines itself: pipetrain.plan.simulate(schedule, costs) then render_timeline"
        )
    name = schedule if isinstance(schedule, str) else getattr(schedule, "schedule_name", "")
    if not name:
        raise PipelineError(f"get_schedule_ops: {schedule!r} names no schedule (give a name or a named class)")
    plan = build_schedule(name, pp_degree, num_microbatches, num_stages_per_rank)
    order: dict[int, list[Action | None]] = {r: list(row) for r, row in plan.actions.items()}
    if not with_comms:
        return [[None if a is None else CustomAction.of(a) for a in order[r]] for r in range(pp_degree)]
    lowered: dict[int, list[Action | None]] = {
        r: list(_add_reduce_grad(_add_unshard_reshard(row), num_microbatches)) for r, row in order.items()
    }
    placement = plan.stage_to_rank
    comms = _add_send_recv(lowered, lambda s: placement[s], plan.num_stages)
    if defer_pp_recv:
        deferred = _defer_recv_ops({r: list[Action](row) for r, row in comms.items()}, lambda s: placement[s])
        return [[CustomAction.of(a) for a in deferred[r]] for r in range(pp_degree)]
    return [list(comms[r]) for r in range(pp_degree)]


def visualize_schedule(*args: Any, **kwargs: Any) -> None:
    """torch's matplotlib picture of a schedule: pipetrain draws its own (see the module)."""
    del args, kwargs
    raise PipelineError(
        "visualize_schedule is torch's picture; pipetrain's: `pipetrain simulate NAME --png x.png`, "
        "or pipetrain.plan.render.render_timeline(simulate(schedule, costs).timeline, 'x.png')"
    )
