"""Arguments that several sub-commands declare alike: a schedule to read or build, a file to write.

Its own module (beside :mod:`pipetrain.cli.common`, which checks what was given) so that
``show``, ``export`` and ``simulate`` take a schedule, and every output flag states its naming
rule, in one way.
"""

from __future__ import annotations

import argparse
from typing import Any

from pipetrain.cli.common import OUTPUT_NAMING, add_size_arguments
from pipetrain.plan.generators import schedule_names

__all__ = ["add_output_argument", "add_schedule_command"]


def add_schedule_command(subparsers: Any, name: str, help: str, description: str) -> argparse.ArgumentParser:
    """A sub-command whose first argument is a schedule: a name (built for the optional
    ``--ranks``/``--microbatches``/``--stages-per-rank``) or a .csv/.json file."""
    parser: argparse.ArgumentParser = subparsers.add_parser(name, help=help, description=description)
    parser.add_argument("schedule", help=f"schedule name ({', '.join(schedule_names())}) or a .csv/.json file")
    add_size_arguments(parser, required=False)
    return parser


def add_output_argument(parser: Any, fmt: str, what: str, flag: str | None = None) -> None:
    """``--{flag or fmt} FILE``, whose help says ``what`` it writes and how the file is named.

    ``parser`` is a parser or one of its groups (a mutually exclusive ``--csv``/``--json``, say).
    """
    parser.add_argument(f"--{flag or fmt}", metavar="FILE", help=f"{what} ({OUTPUT_NAMING.format(fmt=fmt)})")
