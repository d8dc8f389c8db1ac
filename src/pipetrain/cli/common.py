"""Argument helpers shared by the sub-commands."""

from __future__ import annotations

import argparse
import os

from pipetrain.plan.errors import ScheduleError
from pipetrain.plan.generators import build_schedule
from pipetrain.plan.schedule import Schedule, is_schedule_file


def add_size_arguments(parser: argparse.ArgumentParser, *, required: bool = True) -> None:
    parser.add_argument("--ranks", "-p", type=int, required=required, help="number of pipeline ranks P")
    parser.add_argument("--microbatches", "-m", type=int, required=required, help="number of microbatches M")
    parser.add_argument(
        "--stages-per-rank", "-v", type=int, default=None, help="stages per rank (default: what the schedule needs)"
    )


def schedule_from_args(source: str, args: argparse.Namespace) -> Schedule:
    """A schedule named on the command line, or read from a .csv / .json file."""
    if is_schedule_file(source):
        return Schedule.load(source)
    if args.ranks is None or args.microbatches is None:
        raise ScheduleError(f"building {source!r} needs --ranks and --microbatches")
    return build_schedule(source, args.ranks, args.microbatches, args.stages_per_rank)


PICTURE_NAMING = "a name without an extension gets .{fmt}; one with another extension is refused"
"""How --png/--svg treat the file name (for their --help)."""


def picture_path(path: str, fmt: str) -> str:
    """The file a ``--png`` / ``--svg`` flag writes: the flag fixes the format.

    ``out`` becomes ``out.png`` under ``--png``; ``out.svg`` under ``--png`` is refused rather
    than written as PNG bytes behind an SVG name (or as SVG against the flag). Checked before
    anything is simulated, so a typo costs nothing.
    """
    if path.endswith(("/", os.sep)) or os.path.isdir(path):
        raise ScheduleError(
            f"--{fmt} {path}: is a directory; give a file name such as {os.path.join(path, 'timeline.' + fmt)}"
        )
    root, ext = os.path.splitext(path)
    if not ext:
        return f"{path}.{fmt}"
    if ext.lower() == f".{fmt}":
        return path
    raise ScheduleError(
        f"--{fmt} {path}: the name ends in {ext} but --{fmt} writes {fmt.upper()}; name it {root}.{fmt}"
    )
