"""pipetrain's errors: ``except PipelineError`` catches every error a user is told about.

:class:`PipelineError` is raised while running a pipeline; the planning layer's
:class:`~pipetrain.plan.errors.ScheduleError` (bad schedules and bad input) is a PipelineError
too, and a ``ValueError``. This module imports nothing, so the planning layer can build on it
without torch.
"""

from __future__ import annotations

from typing import Any

__all__ = ["PipelineError", "PipeliningMetadataError"]  # (ScheduleError: pipetrain.plan.errors; read here too, below)


class PipelineError(RuntimeError):
    """A pipeline step that cannot run or that failed on some rank, or (as its subclass
    ScheduleError) a schedule or planning request that cannot be honoured.

    Messages name the rank, the step and the action involved, so every rank can report what
    went wrong where, instead of hanging.
    """


class PipeliningMetadataError(PipelineError):
    """What a stage received (or was given) does not match what it expects: shapes, dtypes or
    count of inputs, outputs or gradients (torch's name for the same error)."""


def __getattr__(name: str) -> Any:
    # ScheduleError lives with the planning layer, which imports this module: read it lazily.
    if name == "ScheduleError":
        from pipetrain.plan.errors import ScheduleError

        return ScheduleError
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
