"""torch 2.13's schedule orders, built without a process group and read as pipetrain Schedules.

The one place where benchmarks and comparison tests build ``torch.distributed.pipelining``
schedules (the library itself never imports it). torch computes its whole pipeline order in the
schedule constructor from a few attributes of its stage objects, so light stand-ins (rank 0's
view; every rank computes the whole order) are enough.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch.distributed.pipelining.schedules as ts

from pipetrain.plan import Action, ActionKind, Schedule
from pipetrain.plan.actions import parse_torch_wait

# Classes with one stage per rank, and those with exactly two in a V (stage r and 2p-1-r on rank r);
# every other multi-stage class places stage k*p + r on rank r (looped).
V_PLACED = (ts.ScheduleZBVZeroBubble, ts.ScheduleDualPipeV)
# What torch's constructors raise for sizes they do not support.
REJECTED = (ValueError, AssertionError, RuntimeError, KeyError)


@dataclass
class StandInStage:
    """What torch's schedule constructors read from a stage, and nothing more."""

    stage_index: int
    num_stages: int
    group_size: int
    group_rank: int = 0
    submod: Any = None
    stage_index_to_group_rank: dict[int, int] = field(default_factory=dict)

    @property
    def is_first(self) -> bool:
        return self.stage_index == 0

    @property
    def is_last(self) -> bool:
        return self.stage_index == self.num_stages - 1


def _loss(output: Any, target: Any) -> Any:
    """A loss function, so that the schedule is one that trains (its order does not depend on it)."""
    return output


def torch_schedule_object(name: str, num_ranks: int, num_microbatches: int, stages_per_rank: int = 1) -> Any | None:
    """torch's schedule object ``name`` (case-insensitive) for these sizes, or None if torch rejects them.

    Single-stage classes (GPipe, 1F1B) exist only for ``stages_per_rank == 1``. An unknown name
    raises torch's ValueError.
    """
    cls = ts.get_schedule_class(name)
    n = num_ranks * stages_per_rank
    if issubclass(cls, ts.PipelineScheduleSingle):
        if stages_per_rank != 1:
            return None
        stages: Any = StandInStage(0, num_ranks, num_ranks)
    elif issubclass(cls, V_PLACED):
        stages = [StandInStage(0, n, num_ranks), StandInStage(n - 1, n, num_ranks)]
    else:
        stages = [StandInStage(k * num_ranks, n, num_ranks) for k in range(stages_per_rank)]
    try:
        return cls(stages, num_microbatches, loss_fn=_loss)
    except REJECTED:
        return None


def _repair_1f1b_last_rank(rows: dict[int, list[Action]], num_microbatches: int) -> None:
    """torch 2.13's 1F1B order runs F of microbatches 1..m on the last rank, while its runtime runs
    0..m-1: shift them back so that the order is the one torch actually executes."""
    last = max(rows)
    fwd = sorted(a.microbatch for a in rows[last] if a.kind is ActionKind.F and a.microbatch is not None)
    if fwd == list(range(1, num_microbatches + 1)):
        rows[last] = [
            Action(a.stage, a.kind, a.microbatch - 1) if a.kind is ActionKind.F and a.microbatch is not None else a
            for a in rows[last]
        ]


def to_pipetrain(torch_schedule: Any, *, with_comms: bool = False, repair_1f1b: bool = False) -> Schedule:
    """torch's order as a pipetrain Schedule named ``torch <name>``.

    Compute-only by default: torch's ``pipeline_order`` less its non-compute actions (the
    REDUCE_GRAD of single-stage schedules). ``with_comms`` reads ``pipeline_order_with_comms``
    whole (SEND/RECV, UNSHARD/RESHARD, REDUCE_GRAD) less torch 2.15's waits. Idle steps are
    dropped; the number of microbatches is inferred from the actions, so an order naming a
    microbatch beyond torch's count loads and fails ``validate()``. ``repair_1f1b`` fixes 1F1B's off-by-one last rank (see
    ``_repair_1f1b_last_rank``) to compare with the order torch runs rather than the one it prints.
    """
    order = torch_schedule.pipeline_order_with_comms if with_comms else torch_schedule.pipeline_order
    rows: dict[int, list[Action]] = {}
    for rank, program in order.items():
        # compute-only: torch's own test first, so the REDUCE_GRAD (and torch 2.15's
        # WAIT_REDUCE_GRAD) of single-stage orders are left out, not parsed; with comms, torch
        # 2.15's waits are dropped as Schedule.from_csv drops them
        cells = (str(a) for a in program if a is not None and (with_comms or a.is_compute_op))
        rows[rank] = [a for a in (Action.parse(c) for c in cells if parse_torch_wait(c) is None) if a is not None]
    if repair_1f1b and isinstance(torch_schedule, ts.Schedule1F1B):
        _repair_1f1b_last_rank(rows, torch_schedule._n_microbatches)
    return Schedule(rows, name=f"torch {type(torch_schedule).__name__.removeprefix('Schedule')}")
