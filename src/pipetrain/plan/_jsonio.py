"""Reading (and writing) the files the planning layer writes (JSON schedules and timelines, CSV text).

A path is always a path: :func:`read_json_file` only reads files and :func:`parse_json_text` only
parses text. :func:`read_json` keeps the older "a path or the JSON text itself" calls working
without guessing from the first character: a ``PathLike`` or a string that names an existing file
is read, and only a string that names no file and starts with '{' is taken as JSON text.
Errors are ScheduleError naming ``what`` ("schedule", "timeline") and the file once, so CLI users
get one line.
"""

from __future__ import annotations

import json
import os
from typing import Any

from pipetrain.plan.errors import ScheduleError


def write_json(data: Any, path: str | os.PathLike[str] | None, indent: int | None) -> str:
    """``data`` as JSON text; also written to ``path`` (with a final newline) when one is given."""
    text = json.dumps(data, indent=indent)
    if path is not None:
        with open(path, "w", encoding="utf-8") as fh:
            fh.write(text + "\n")
    return text


def read_text(path: str | os.PathLike[str], *, newline: str | None = None) -> str:
    """The UTF-8 text of the file at ``path``; a one-line ScheduleError naming it otherwise."""
    name = os.fspath(path)
    try:
        with open(path, newline=newline, encoding="utf-8") as fh:
            return fh.read()
    except UnicodeDecodeError as err:
        raise ScheduleError(f"{name}: not a UTF-8 text file ({err.reason})") from None
    except OSError as err:
        raise ScheduleError(f"cannot read {name}: {err.strerror or err}") from None


def read_json_file(path: str | os.PathLike[str], what: str) -> Any:
    """Parse the JSON file at ``path``."""
    name = os.fspath(path)
    text = read_text(path)
    try:
        return json.loads(text)
    except json.JSONDecodeError as err:
        start = text.lstrip()[:1]
        hint = (
            f" (it starts with {start!r}, not '{{': is it a CSV file named .json?)"
            if start not in ("{", "[", "")
            else ""
        )
        raise ScheduleError(f"{name}: malformed {what} JSON: {err}{hint}") from None


def parse_json_text(text: str, what: str) -> Any:
    """Parse JSON text (never a file name)."""
    try:
        return json.loads(text)
    except json.JSONDecodeError as err:
        raise ScheduleError(f"malformed {what} JSON: {err}") from None


def is_json_text(source: str | os.PathLike[str]) -> bool:
    """The compatibility rule: a string that names no existing file and starts with '{'."""
    return isinstance(source, str) and source.lstrip().startswith("{") and not os.path.exists(source)


def read_json(source: str | os.PathLike[str], what: str) -> Any:
    """A file (``PathLike``, or a string naming an existing file), else JSON text starting with '{'.

    So a file called ``{a}.json`` is read as a file, and a missing one is reported as missing
    (not as malformed JSON) when the string does not parse as JSON either.
    """
    if not is_json_text(source):
        return read_json_file(source, what)
    assert isinstance(source, str)
    try:
        return json.loads(source)
    except json.JSONDecodeError as err:
        if "\n" in source.strip() or len(source) > 4096:  # clearly meant as text
            raise ScheduleError(f"malformed {what} JSON: {err}") from None
        raise ScheduleError(f"cannot read {source}: no such file, nor valid {what} JSON text ({err})") from None
