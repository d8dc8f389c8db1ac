"""Errors raised while running a pipeline (the planning layer raises ScheduleError)."""

from __future__ import annotations

from pipetrain.plan.errors import ScheduleError

__all__ = ["PipelineError", "ScheduleError"]


class PipelineError(RuntimeError):
    """A pipeline step that cannot run or that failed on some rank.

    Messages name the rank, the step and the action involved, so every rank can report what
    went wrong where, instead of hanging.
    """
