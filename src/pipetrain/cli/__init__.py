"""The ``pipetrain`` command line: planning commands work without torch.

Each command module exposes ``register(subparsers)``, which adds its sub-commands and sets
``func`` (``args -> exit code``) on them. Errors the user can fix are one line on stderr, exit 1.
"""

from __future__ import annotations

import argparse
import importlib
import sys
from collections.abc import Sequence

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
    )
    subparsers = parser.add_subparsers(dest="command", metavar="COMMAND")
    subparsers.required = True
    for module_name in _COMMAND_MODULES:
        importlib.import_module(module_name).register(subparsers)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        code = args.func(args)
    except (ScheduleError, PipelineError, OSError) as err:
        print(f"pipetrain {args.command}: error: {err}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print(f"pipetrain {args.command}: interrupted", file=sys.stderr)
        return 130
    return int(code or 0)
