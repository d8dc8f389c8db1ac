"""From the schedule a user gives to what the executor runs: lowering, its options, compiling.

A compute-only schedule is validated and lowered here, before any communication; a lowered one
is checked. Lowering options that depend on the backend or the modules (early receives on gloo,
gradient reduction for data-parallel stages) are applied as passes, so the result is an ordinary
lowered schedule: ``pipeline_order_with_comms`` shows exactly what runs.
"""

from __future__ import annotations

import os
import re
from collections.abc import Sequence
from typing import Any

import torch

from pipetrain.errors import PipelineError
from pipetrain.plan import Action, Schedule, ScheduleError
from pipetrain.plan.delivery import confirmed_sends
from pipetrain.plan.lower import forwards_only
from pipetrain.plan.passes.early_recv import post_receives_early
from pipetrain.plan.program import RankProgram, compile_program
from pipetrain.plan.validate import validate
from pipetrain.runtime.data_parallel import with_grad_reduction
from pipetrain.stage import PipelineStage

__all__ = [
    "DEFAULT_RECV_AHEAD",
    "Prepared",
    "prepare_for",
    "prepare_schedule",
    "read_torch_csv",
    "recv_window",
    "require_autograd",
    "torch_csv_has_waits",
]

# How many receives may be posted ahead of their place by default: each holds a buffer the size of
# its message, so a bound keeps that memory independent of the number of microbatches. Measured on
# 2 gloo ranks (benchmarks/runtime_vs_torch.py), 4 ahead was as fast as all of them at once.
DEFAULT_RECV_AHEAD = 4

_EARLY_NEEDS_GLOO = (
    "recv_ahead (early receives) needs a backend that matches messages per peer and tag (gloo); "
    "this one pairs them in posting order"
)


def recv_window(value: int | None) -> int:
    """The receive window: ``value``, else ``PIPETRAIN_RECV_AHEAD``, else :data:`DEFAULT_RECV_AHEAD`."""
    if value is None:
        env = os.environ.get("PIPETRAIN_RECV_AHEAD", "")
        if not env:
            return DEFAULT_RECV_AHEAD
        try:
            value = int(env)
        except ValueError:
            raise PipelineError(f"PIPETRAIN_RECV_AHEAD must be an integer >= 0, got {env!r}") from None
    if value < 0:
        raise PipelineError(f"recv_ahead (the receive window) must be >= 0, got {value}")
    return value


def read_torch_csv(filename: str, format: str, n_microbatches: int, where: str = "") -> Schedule:
    """A schedule file for ``_load_csv``: torch's CSV ``format`` ("compute_only" or
    "compute_comms", which must match whether it holds SEND/RECV), of ``n_microbatches``.
    ``where`` prefixes the errors (the rank). A lowered file may come from torch 2.13 or from torch
    2.15, whose waits (WAIT_SEND_F, WAIT_SEND_B, WAIT_REDUCE_GRAD) are dropped: the runtime
    completes its sends and reductions itself."""
    if format not in ("compute_only", "compute_comms"):
        raise ValueError(f"format must be 'compute_only' or 'compute_comms', got {format!r}")
    try:
        schedule = Schedule.from_csv(filename)
    except ScheduleError as err:
        raise PipelineError(f"{where}{err}") from None
    if (format == "compute_comms") != schedule.is_lowered:
        has = "holds" if schedule.is_lowered else "has no"
        raise PipelineError(
            f"{where}{filename} {has} SEND/RECV actions; load it with "
            f"format={'compute_comms' if schedule.is_lowered else 'compute_only'!r}"
        )
    if schedule.num_microbatches != n_microbatches:
        raise PipelineError(
            f"{where}{filename} is a schedule of {schedule.num_microbatches} microbatches, "
            f"but this schedule was built for n_microbatches={n_microbatches}"
        )
    return schedule


def torch_csv_has_waits(version: str | None = None) -> bool:
    """Whether torch ``version`` (default: the one installed) writes WAIT_SEND_F, WAIT_SEND_B and
    WAIT_REDUCE_GRAD in its lowered ("compute_comms") CSV files and refuses lowered files without
    them: torch 2.15 and later (its pre-releases included); torch 2.13 cannot read them."""
    text = str(torch.__version__ if version is None else version)
    match = re.match(r"([0-9]+)\.([0-9]+)", text)
    if match is None:
        raise PipelineError(f"cannot read the torch version {text!r}")
    return (int(match[1]), int(match[2])) >= (2, 15)


def prepare_schedule(schedule: Schedule, matching: str | None = None, **lower_options: Any) -> Schedule:
    """Validate (before any communication) and lower a compute-only schedule; check a lowered one
    under ``matching``, the model of the backend that runs it (docs/semantics.md, "Matching";
    default: gloo's where ``recv_ahead`` asks for early receives, else the strict one)."""
    if not isinstance(schedule, Schedule):
        raise PipelineError(f"expected a pipetrain.plan.Schedule, got {type(schedule).__name__}")
    matching = matching or ("gloo" if lower_options.get("recv_ahead") else "nccl")
    if lower_options.get("recv_ahead") and matching != "gloo":
        raise PipelineError(_EARLY_NEEDS_GLOO)
    try:
        if schedule.is_lowered:
            _check_runs(schedule, matching)
            return schedule
        return schedule.lower(**lower_options)
    except ScheduleError as err:
        raise PipelineError(f"the schedule {schedule.name or ''} cannot run: {err}".replace("  ", " ")) from err


def _check_runs(schedule: Schedule, matching: str) -> None:
    """validate() under ``matching``; where the strict model refuses what gloo's accepts (early
    receives), the error says so."""
    try:
        validate(schedule, matching=matching)
    except ScheduleError as err:
        if matching == "nccl":
            try:
                validate(schedule, matching="gloo")
            except ScheduleError:
                raise err from None
            raise ScheduleError(
                f"{err} (it runs under gloo's matching, per peer and tag, as early receives need; "
                "this backend pairs messages in posting order)"
            ) from None
        raise


def require_autograd(who: str) -> None:
    """A training step under ``torch.no_grad()`` is refused, as torch does (``eval`` runs forward only)."""
    if not torch.is_grad_enabled():
        raise PipelineError(
            f"{who} trains and needs autograd, but it was called under torch.no_grad(); call eval() to run forward only"
        )


class Prepared:
    """A schedule ready to run: ``base`` (lowered, what ranks agree on), ``schedule`` (what runs:
    ``base`` with receives moved early where asked, validated under the matching model of the
    backend that runs it) and each rank's compiled program."""

    def __init__(self, base: Schedule, recv_ahead: int = 0, matching: str | None = None) -> None:
        self.base = base
        # The backend's matching model: gloo's where receives are posted early, else as given.
        self.matching = matching or ("gloo" if recv_ahead else "nccl")
        try:
            self.schedule = post_receives_early(base, recv_ahead) if recv_ahead else base
            _check_runs(self.schedule, self.matching)
        except ScheduleError as err:
            raise PipelineError(f"the schedule {base.name or ''} cannot run: {err}".replace("  ", " ")) from None
        self.recv_ahead = recv_ahead
        self.agreed = False  # whether the ranks have checked they run the same schedule
        self._programs: dict[int, RankProgram] = {}
        self._confirmed: dict[int, dict[Action, list[Action]]] | None = None

    def program(self, rank: int) -> RankProgram:
        """``rank``'s compiled program (compiled once)."""
        program = self._programs.get(rank)
        if program is None:
            if self._confirmed is None:
                self._confirmed = confirmed_sends(self.schedule)
            program = self._programs[rank] = compile_program(self.schedule, rank, self._confirmed)
        return program

    def forwards(self, lower_options: dict[str, Any]) -> Prepared:
        """The forward-only schedule of the same order, for ``eval`` (FSDP gathers kept, no reduction)."""
        options = {k: v for k, v in lower_options.items() if k in ("fsdp", "prefetch", "max_unsharded")}
        return Prepared(prepare_schedule(forwards_only(self.base), **options), self.recv_ahead, self.matching)


def prepare_for(
    schedule: Schedule,
    lower_options: dict[str, Any],
    stages: Sequence[PipelineStage],
    rank: int,
    recv_ahead: int,
    matching: str | None = None,
) -> Prepared:
    """``schedule`` lowered with ``lower_options``, with REDUCE_GRAD for data-parallel ``stages``,
    to run under ``matching`` (default: gloo's where ``recv_ahead`` posts receives early, else the
    strict model). A ``recv_ahead`` among the lowering options is the receive window itself
    (applied once, not on top of ``recv_ahead``)."""
    options = dict(lower_options)
    window = options.pop("recv_ahead", None)
    if window is not None:
        if isinstance(window, bool) or not isinstance(window, int) or window < 0:
            raise PipelineError(f"recv_ahead must be an integer >= 0, got {window!r}")
        if window and options.get("comms") is False:
            raise PipelineError("recv_ahead moves receives: it needs comms=True")
        recv_ahead = window
        matching = matching or ("gloo" if window else None)
    matching = matching or ("gloo" if recv_ahead else "nccl")
    if recv_ahead and matching != "gloo":
        raise PipelineError(f"rank {rank}: {_EARLY_NEEDS_GLOO}")
    base = prepare_schedule(schedule, matching, **options)
    try:
        base = with_grad_reduction(base, stages, rank)
    except ScheduleError as err:
        raise PipelineError(f"rank {rank}: {err}") from None
    return Prepared(base, recv_ahead, matching)
