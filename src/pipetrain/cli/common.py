"""Argument helpers shared by the sub-commands."""

from __future__ import annotations

import argparse
import importlib
import os

from pipetrain.plan.costs import Costs
from pipetrain.plan.errors import ScheduleError
from pipetrain.plan.generators import build_schedule
from pipetrain.plan.schedule import Schedule, is_schedule_file


def add_size_arguments(parser: argparse.ArgumentParser, *, required: bool = True) -> None:
    parser.add_argument("--ranks", "-p", type=int, required=required, help="number of pipeline ranks P")
    parser.add_argument("--microbatches", "-m", type=int, required=required, help="number of microbatches M")
    parser.add_argument(
        "--stages-per-rank", "-v", type=int, default=None, help="stages per rank (default: what the schedule needs)"
    )


STAGE_ACT = "stage act."
RANK_SHARES = "rank shares"
UNITS = (
    f"{STAGE_ACT}: stage activations held, one stage's for one microbatch each (simulate's peak);\n"
    f"{RANK_SHARES}: microbatches of a rank's whole share of the model = {STAGE_ACT} / stages per rank "
    f"(plan's and --memory-limit's unit): ZB-V's 8 {STAGE_ACT} on 2 stages per rank are 4 {RANK_SHARES}"
)
"""What the peak memory columns of simulate, compare and plan count (printed under their tables)."""


def schedule_from_args(source: str, args: argparse.Namespace) -> Schedule:
    """A schedule named on the command line, or read from a .csv / .json file."""
    if is_schedule_file(source):
        schedule = Schedule.load(source)
        # A file fixes its sizes: a size flag that disagrees was meant for something else.
        v = schedule.num_stages // schedule.num_ranks if schedule.num_stages % schedule.num_ranks == 0 else None
        for flag, given, has in (
            ("--ranks", args.ranks, schedule.num_ranks),
            ("--microbatches", args.microbatches, schedule.num_microbatches),
            ("--stages-per-rank", args.stages_per_rank, v),
        ):
            if given is not None and given != has:
                what = f"{has} {flag[2:].replace('-', ' ')}" if has is not None else "stages unevenly spread over ranks"
                raise ScheduleError(f"{flag} {given} contradicts {source}, a schedule of {what} (leave {flag} out)")
        return schedule
    if args.ranks is None or args.microbatches is None:
        raise ScheduleError(f"building {source!r} needs --ranks and --microbatches")
    return build_schedule(source, args.ranks, args.microbatches, args.stages_per_rank)


def schedule_output(args: argparse.Namespace) -> tuple[str, str] | None:
    """``(path, "csv" | "json")`` from a command's ``--csv`` / ``--json`` FILE, checked before any work."""
    for fmt in ("csv", "json"):
        path = getattr(args, fmt, None)
        if path:
            return output_path(path, fmt), fmt
    return None


def write_schedule(schedule: Schedule, target: tuple[str, str]) -> str:
    path, fmt = target
    if fmt == "csv":
        schedule.to_csv(path)
    else:
        schedule.to_json(path, indent=1)
    return path


OUTPUT_NAMING = "a name without an extension gets .{fmt}; one with another extension is refused"
"""How --png/--svg (and --csv/--json/--trace) treat the file name (for their --help)."""


def output_path(path: str, fmt: str, flag: str | None = None) -> str:
    """The file an output flag (``--png``, ``--csv``, ``--trace``...) writes: the flag fixes the format.

    ``out`` becomes ``out.png`` under ``--png``; ``out.svg`` under ``--png`` is refused rather
    than written as PNG bytes behind an SVG name (a CSV behind a .json name, which every reader
    then takes for JSON). Checked before any work, so a typo costs nothing. ``flag`` names the
    option when it is not ``--{fmt}`` (``--trace`` writes json).
    """
    option = f"--{flag or fmt}"
    if path.endswith(("/", os.sep)) or os.path.isdir(path):
        raise ScheduleError(
            f"{option} {path}: is a directory; give a file name such as {os.path.join(path, 'out.' + fmt)}"
        )
    root, ext = os.path.splitext(path)
    if not ext:
        return f"{path}.{fmt}"
    if ext.lower() == f".{fmt}":
        return path
    raise ScheduleError(
        f"{option} {path}: the name ends in {ext} but {option} writes {fmt.upper()}; name it {root}.{fmt}"
    )


# The optional dependencies and the pyproject extra that installs each (planning needs none).
_EXTRA_OF = {"matplotlib": "plot", "torch": "torch", "rich": "train"}


class MissingExtraError(ModuleNotFoundError):
    """An optional dependency a command needs is not installed; the message says what to install."""


def missing_extra(err: ModuleNotFoundError, command: str, needed_by: str | None = None) -> MissingExtraError | None:
    """The one-line error for ``err`` if it is an optional dependency missing, else None.

    ``pipetrain train`` names the ``train`` extra (torch, matplotlib and rich together); other
    commands the extra of the one package they lack.
    """
    if isinstance(err, MissingExtraError):
        return err
    root = (err.name or "").split(".")[0]
    if root not in _EXTRA_OF:
        return None
    extra = "train" if command == "train" else _EXTRA_OF[root]
    message = f"{needed_by or 'this command'} needs {root}, which is not installed: pip install 'pipetrain[{extra}]'"
    if needed_by is None:
        message += " (the planning commands show, export, validate, simulate, compare and plan need no extra)"
    return MissingExtraError(message, name=root)


def require(module: str, command: str, needed_by: str | None = None) -> None:
    """Import ``module`` now, before any work, or raise :class:`MissingExtraError` naming the extra."""
    try:
        importlib.import_module(module)
    except ModuleNotFoundError as err:
        found = missing_extra(err, command, needed_by)
        if found is None:
            raise
        raise found from None


PROFILE_HELP = (
    "read the costs from a file written by `pipetrain profile --costs-out` or `pipetrain train --out` "
    "(costs.txt: one value per stage, as measured; lines starting with # are ignored)"
)


def add_costs_options(
    parser: argparse.ArgumentParser, *, default: str, costs_help: str, profile_help: str = PROFILE_HELP
) -> argparse._MutuallyExclusiveGroup:
    """``--costs SPEC`` or ``--from-profile FILE``, never both (a profile is measured costs); the
    group, for a command that takes a third source of costs."""
    group = parser.add_mutually_exclusive_group()
    group.add_argument("--costs", default=default, metavar="SPEC", help=costs_help)
    group.add_argument("--from-profile", metavar="FILE", help=profile_help)
    return group


def read_costs_file(path: str) -> Costs:
    """The costs in a ``--from-profile`` file (``f=...,b=...`` as ``--costs`` takes them; ``#``
    lines and blank lines skipped, lines joined), or a one-line error naming the file."""
    flag = "--from-profile"
    try:
        with open(path, encoding="utf-8-sig") as handle:  # (a BOM, as some Windows editors write, is skipped)
            lines = handle.read().splitlines()
    except OSError as exc:
        raise ScheduleError(f"{flag} {path}: cannot read it ({exc.strerror})") from None
    except UnicodeDecodeError:
        raise ScheduleError(f"{flag} {path}: not a UTF-8 text file") from None
    first = next((line.strip() for line in lines if line.strip() and not line.lstrip().startswith("#")), "")
    if first[:1] in ("[", "{") or first.lower().startswith("name,"):
        raise ScheduleError(
            f"{flag} {path}: this is a per-layer file (what `pipetrain profile --layers-out` and "
            "pipetrain.plan.write_layers write); give it to `pipetrain plan --layers FILE`, which plans the cut"
        )
    text = ",".join(line.strip().rstrip(",") for line in lines if line.strip() and not line.lstrip().startswith("#"))
    if not any(item.partition("=")[0].strip().lower() == "f" for item in text.split(",")):
        raise ScheduleError(
            f"{flag} {path}: holds no measured forward times (f=...); "
            "write it with `pipetrain profile --costs-out FILE` or `pipetrain train --out DIR`"
        )
    try:
        return Costs.parse(text, share="rank")
    except ScheduleError as exc:
        raise ScheduleError(f"{flag} {path}: {exc}") from None
