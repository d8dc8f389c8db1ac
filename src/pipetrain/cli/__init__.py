"""The ``pipetrain`` command line: planning commands work without torch.

Each command module exposes ``register(subparsers)``, which adds its sub-commands and sets
``func`` (``args -> exit code``) on them. Errors the user can fix are one line on stderr, exit 1.
"""

from __future__ import annotations

import argparse
import importlib
import os
import sys
from collections.abc import Sequence

from pipetrain import __version__
from pipetrain.cli.common import missing_extra
from pipetrain.errors import PipelineError
from pipetrain.plan.errors import ScheduleError

# Modules holding sub-commands, in the order their commands appear in --help.
_COMMAND_MODULES = (
    "pipetrain.cli.plan_cmds",
    "pipetrain.cli.sim_cmds",
    "pipetrain.cli.auto_cmds",
    "pipetrain.cli.train_cmd",
)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="pipetrain",
        description="Plan, check, simulate and run pipeline-parallel schedules.",
        epilog="Run `pipetrain COMMAND --help` for a command's options. Planning commands need no torch; "
        "pictures need matplotlib (pip install 'pipetrain[plot]'), train needs torch (pip install 'pipetrain[train]').",
    )
    parser.add_argument("--version", action="version", version=f"pipetrain {__version__}")
    subparsers = parser.add_subparsers(dest="command", metavar="COMMAND")
    subparsers.required = True
    for module_name in _COMMAND_MODULES:
        importlib.import_module(module_name).register(subparsers)
    return parser


def _command_parser(parser: argparse.ArgumentParser, command: str) -> argparse.ArgumentParser:
    for action in parser._actions:  # argparse keeps the sub-command parsers only here
        if isinstance(action, argparse._SubParsersAction):
            found: argparse.ArgumentParser = action.choices[command]
            return found
    return parser


def _silence_stdout() -> None:
    """The reader went away (``pipetrain show … | head``): drop further output, print no error."""
    devnull = os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, sys.stdout.fileno())


_SIGNED = ("--memory-limit", "--comm", "--time-limit")
"""Options whose value a user may write negative by mistake: ``--memory-limit -5GiB`` reaches the
option's own check ("must be >= 0") instead of argparse's "expected one argument"."""


def _join_signed(argv: Sequence[str]) -> list[str]:
    out: list[str] = []
    for token in argv:
        if out and out[-1] in _SIGNED and token[:1] == "-" and token[1:2].isdigit():
            out[-1] = f"{out[-1]}={token}"
        else:
            out.append(token)
    return out


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args, extra = parser.parse_known_args(_join_signed(sys.argv[1:] if argv is None else argv))
    if extra:  # the sub-command's usage, not the top level's, says what it takes
        _command_parser(parser, args.command).error(f"unrecognized arguments: {' '.join(extra)}")
    try:
        code = args.func(args)
        sys.stdout.flush()
    except BrokenPipeError:
        _silence_stdout()
        return 141  # as if killed by SIGPIPE, what `cmd | head` expects of a Unix tool
    except (ScheduleError, PipelineError, OSError) as err:
        print(f"pipetrain {args.command}: error: {err}", file=sys.stderr)
        return 1
    except ModuleNotFoundError as err:  # an optional dependency: say which extra installs it
        missing = missing_extra(err, args.command)
        if missing is None:
            raise
        print(f"pipetrain {args.command}: error: {missing}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print(f"pipetrain {args.command}: interrupted", file=sys.stderr)
        return 130
    return int(code or 0)
