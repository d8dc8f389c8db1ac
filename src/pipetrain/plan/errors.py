"""The one exception the planning layer raises for bad schedules and bad input."""

from __future__ import annotations

from pipetrain.errors import PipelineError


class ScheduleError(PipelineError, ValueError):
    """A schedule, action string or planning request that cannot be honoured.

    The message names what is wrong (rank, step, action, stage, constraint) so that a
    user can fix the input without reading a traceback. It is a :class:`PipelineError`
    (``except PipelineError`` catches every error pipetrain tells a user about) and a
    ``ValueError`` (bad input).
    """
