"""Validation: reject a schedule that cannot run, before anything runs.

The rules are those of ``docs/semantics.md``. Each failure raises :class:`ScheduleError` naming the
rank, the step, the action and the broken rule (``rank 1, step 5, action 1B3: ...``).

Whether the per-rank programs deadlock is decided by abstract execution: every rank runs its list
in order, an action runs once what it needs has run (on a lowered schedule: once its RECV has
completed under the NCCL group model), and ranks left waiting are reported with what they wait
for. All checks are linear in the number of actions.

A sound schedule, the common case, is accepted by a fast path (:mod:`.fast`: one scan that also
matches and groups the SEND/RECV, then one run, keeping nothing for messages; under the strict
model a lowered schedule whose messages sit where a unit-time run of its compute says they can is
proven by that run alone); whatever it cannot prove sound goes through the full checks
(:func:`_check`), which find the broken rule and word it. The fast path only ever accepts, so
verdicts and messages are the full checks'. The full checks are, in order: :mod:`.structure`
(placement, ranges, duplicates, completeness), :mod:`.communication` (SEND/RECV matched and
grouped), :mod:`.gradients` (FSDP and REDUCE_GRAD) and :mod:`.execute` (the abstract execution).
"""

from __future__ import annotations

from pipetrain.plan._graph import gc_paused
from pipetrain.plan.errors import ScheduleError
from pipetrain.plan.schedule import Schedule
from pipetrain.plan.validate.communication import CommPlan
from pipetrain.plan.validate.execute import execute
from pipetrain.plan.validate.fast import accepts
from pipetrain.plan.validate.gradients import check_reduce_grad
from pipetrain.plan.validate.structure import structure

__all__ = ["validate"]

MATCHING = ("nccl", "gloo")


def validate(schedule: Schedule, *, matching: str = "nccl") -> None:
    """Raise :class:`ScheduleError` if ``schedule`` breaks a rule of docs/semantics.md.

    ``matching`` is the backend's model for a lowered schedule's SEND/RECV (docs/semantics.md,
    "Matching"): ``"nccl"`` (the default and the strict one) pairs a rank pair's operations in
    posting order and runs a rank's groups one after another; ``"gloo"`` pairs them per peer in
    order too, but each operation progresses on its own, which is what early receives need.
    """
    if matching not in MATCHING:
        raise ScheduleError(f"matching must be one of {', '.join(map(repr, MATCHING))}, not {matching!r}")
    strict = matching == "nccl"
    with gc_paused():
        if not accepts(schedule, strict):
            _check(schedule, strict)


def check_structure(schedule: Schedule) -> int:
    """The checks of :func:`validate` short of executing the programs (for ``lower``, whose
    unit-time run of a compute schedule decides whether it runs to the end).

    Returns how many actions are not compute (SEND/RECV, UNSHARD/RESHARD, REDUCE_GRAD): ``lower``
    refuses a schedule that has any, and learns it from this scan instead of its own.
    """
    with gc_paused():
        return structure(schedule).lowered_actions


def _check(schedule: Schedule, strict: bool) -> None:
    """The full checks, which find what is wrong and word it (every rule, in a fixed order)."""
    index = structure(schedule)
    comm = CommPlan(index) if index.comm_rank else None
    if index.reduce:
        check_reduce_grad(index)
    execute(index, comm, strict)
