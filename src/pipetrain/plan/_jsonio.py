"""Reading the JSON files the planning layer writes (schedules, timelines)."""

from __future__ import annotations

import json
import os
from typing import Any

from pipetrain.plan.errors import ScheduleError


def read_json(source: str | os.PathLike[str], what: str) -> Any:
    """Parse JSON from a file path, or from the text itself when it starts with '{'.

    Errors are ScheduleError naming ``what`` ("schedule", "timeline") so CLI users get one line.
    """
    text = str(source)
    if not text.lstrip().startswith("{"):
        try:
            with open(source, encoding="utf-8") as fh:
                text = fh.read()
        except (OSError, UnicodeDecodeError) as err:
            raise ScheduleError(f"cannot read {os.fspath(source)}: {err}") from None
    try:
        return json.loads(text)
    except json.JSONDecodeError as err:
        raise ScheduleError(f"malformed {what} JSON: {err}") from None
