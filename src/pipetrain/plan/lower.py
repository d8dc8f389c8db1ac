"""Lowering: turn a compute-only schedule into one the runtime executes as is.

``lower`` composes separate passes, each generic (it reads dependencies, never schedule names)
and linear in the number of actions: merging I+W into B, gradient reduction, FSDP
unshard/reshard, and communication, in that order (communication last, so that nothing is ever
inserted inside a SEND/RECV group). With communication (the usual case) the last three run as
one sweep per rank (:mod:`pipetrain.plan.passes.fused`, same result as the passes in a row), on
the unit-time run that also proves the schedule runs to the end.
"""

from __future__ import annotations

from pipetrain.plan._graph import gc_paused
from pipetrain.plan.errors import ScheduleError
from pipetrain.plan.passes._insert import refuse_lowered
from pipetrain.plan.passes.communication import add_communication
from pipetrain.plan.passes.early_recv import post_receives_early
from pipetrain.plan.passes.forward import forwards_only
from pipetrain.plan.passes.fsdp import DEFAULT_MAX_UNSHARDED, add_fsdp, check_fsdp_options, fsdp_pass
from pipetrain.plan.passes.fused import lower_compute
from pipetrain.plan.passes.grad import add_grad_reduction, grad_reduction_pass
from pipetrain.plan.passes.merge import merge_input_weight
from pipetrain.plan.schedule import Schedule
from pipetrain.plan.validate import check_structure, validate

__all__ = ["add_communication", "add_fsdp", "add_grad_reduction", "forwards_only", "lower", "merge_input_weight"]


def lower(
    schedule: Schedule,
    *,
    comms: bool = True,
    grad_reduce: bool = False,
    fsdp: bool = False,
    prefetch: int = 1,
    max_unsharded: int | None = DEFAULT_MAX_UNSHARDED,
    merge_iw: bool = False,
    recv_ahead: int = 0,
) -> Schedule:
    """Validate ``schedule`` (compute-only) and return it lowered.

    ``comms``: SEND/RECV between stages on different ranks. ``grad_reduce``: REDUCE_GRAD after
    each stage's last backward. ``fsdp``: UNSHARD up to ``prefetch`` compute actions ahead of use,
    never more than ``max_unsharded`` stages gathered at once per rank (None: no limit), RESHARD
    after a stage's last use or to make room (see :mod:`pipetrain.plan.passes.fsdp`). ``merge_iw``: I
    directly followed by its W becomes one B. ``recv_ahead``: post the receives from peers that
    send gradients up to that many groups early (gloo: matching per tag; see
    :mod:`pipetrain.plan.passes.early_recv`), so the early receives are in the schedule that
    validate and simulate see. Lowering an already lowered schedule raises :class:`ScheduleError`.
    """
    if fsdp:
        check_fsdp_options(prefetch, max_unsharded)
    with gc_paused():
        out = _lower(schedule, comms, grad_reduce, fsdp, prefetch, max_unsharded, merge_iw)
    if recv_ahead:
        if not comms:
            raise ScheduleError("recv_ahead moves receives: it needs comms=True")
        out = post_receives_early(out, recv_ahead)
    return out


def _lower(
    schedule: Schedule,
    comms: bool,
    grad_reduce: bool,
    fsdp: bool,
    prefetch: int,
    max_unsharded: int | None,
    merge_iw: bool,
) -> Schedule:
    if comms:
        # The passes in one sweep, on the unit-time run that also checks the schedule (and asks
        # validate() for the message when it is broken): no separate validation pass.
        if merge_iw:
            # Merging reads the programs first: they must be sound and compute-only.
            if check_structure(schedule):
                refuse_lowered(schedule)
        out = merge_input_weight(schedule) if merge_iw else schedule
        try:
            return lower_compute(
                out, grad_reduce=grad_reduce, fsdp=fsdp, prefetch=prefetch, max_unsharded=max_unsharded
            )
        except ScheduleError:
            if out is not schedule:
                validate(schedule)  # name the deadlock in the schedule as given
            raise
    if check_structure(schedule):
        refuse_lowered(schedule)
    validate(schedule)
    out = schedule
    if merge_iw:
        out = merge_input_weight(out)
    if grad_reduce:
        out = grad_reduction_pass(out)
    if fsdp:
        out = fsdp_pass(out, prefetch, max_unsharded)
    if out is schedule:
        out = schedule._derived({r: list(schedule.actions[r]) for r in range(schedule.num_ranks)})
    return out
