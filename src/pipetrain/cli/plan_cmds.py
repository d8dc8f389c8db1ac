"""``pipetrain show``, ``export`` and ``validate``: look at schedules and check files."""

from __future__ import annotations

import argparse
from typing import Any

from pipetrain.cli.arguments import add_output_argument, add_schedule_command
from pipetrain.cli.common import schedule_from_args, schedule_output, write_schedule
from pipetrain.plan.errors import ScheduleError
from pipetrain.plan.schedule import Schedule
from pipetrain.plan.validate import MATCHING, validate


def register(subparsers: Any) -> None:
    show = add_schedule_command(
        subparsers,
        "show",
        help="print a schedule as a steps × ranks grid",
        description="Print a named schedule (or a .csv/.json file) as a text grid, one column per rank and one "
        "row per step, in torch's action grammar (2F0 = stage 2's forward of microbatch 0).",
    )
    _add_lowering_arguments(show)
    show.set_defaults(func=_show)

    export = add_schedule_command(
        subparsers,
        "export",
        help="write a schedule as torch-format CSV or JSON",
        description="Write a named schedule, optionally lowered (SEND/RECV, FSDP, gradient reduction), as a file: "
        "torch's CSV format (readable by torch's _load_csv and by pipetrain) or pipetrain's JSON.",
    )
    _add_lowering_arguments(export)
    target = export.add_mutually_exclusive_group(required=True)
    add_output_argument(target, "csv", "write torch's CSV format, one row per rank")
    add_output_argument(target, "json", "write pipetrain's JSON format")
    export.set_defaults(func=_export)

    validate = subparsers.add_parser(
        "validate",
        help="check a CSV/JSON schedule; exit 1 with the reason if broken",
        description="Check a schedule file (torch's CSV format or JSON): every action present once, every "
        "dependency met in order, no deadlock. Exit 0 if it can run; else exit 1 naming the rank, step, action "
        "and rule.",
    )
    validate.add_argument("file", help="schedule file (.csv in torch's format, or .json)")
    validate.add_argument(
        "--matching",
        choices=MATCHING,
        default="nccl",
        help="how a lowered schedule's SEND/RECV match (default nccl: in posting order, a rank's groups one after "
        "another; gloo: each operation progresses on its own, as early receives need)",
    )
    validate.set_defaults(func=_validate)


def _add_lowering_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--lowered", action="store_true", help="add SEND/RECV actions (the lowering passes)")
    parser.add_argument(
        "--grad-reduce", action="store_true", help="lowered, with REDUCE_GRAD after each stage's last backward"
    )
    parser.add_argument("--fsdp", action="store_true", help="lowered, with FSDP UNSHARD/RESHARD actions")
    parser.add_argument(
        "--prefetch",
        type=int,
        default=None,
        help="with --fsdp: unshard up to this many compute actions ahead (default 1; later where "
        "--max-unsharded leaves no room)",
    )
    parser.add_argument(
        "--max-unsharded",
        type=int,
        default=None,
        help="with --fsdp: at most this many stages gathered at once per rank (default 3, as torch)",
    )
    parser.add_argument(
        "--merge-iw", action="store_true", help="lowered, with each I directly followed by its W merged into B"
    )


def _load(args: argparse.Namespace) -> Schedule:
    schedule = schedule_from_args(args.schedule, args)
    schedule.validate()
    passes = [f"--{flag.replace('_', '-')}" for flag in ("grad_reduce", "fsdp", "merge_iw") if getattr(args, flag)]
    args.lowered = args.lowered or bool(passes)
    if args.prefetch is not None and not args.fsdp:
        raise ScheduleError("--prefetch sets how far FSDP unshards ahead; it needs --fsdp")
    if args.max_unsharded is not None and not args.fsdp:
        raise ScheduleError("--max-unsharded sets how many stages FSDP keeps gathered; it needs --fsdp")
    if schedule.is_lowered and passes:
        # Its SEND/RECV (and any FSDP actions) are fixed already; silently ignoring the flags misleads.
        raise ScheduleError(
            f"{args.schedule} is already lowered, so {' and '.join(passes)} cannot be applied; "
            "give a compute-only schedule (a name, or a file without SEND/RECV)"
        )
    if not args.lowered or schedule.is_lowered:
        return schedule
    fsdp: dict[str, int] = {}
    if args.prefetch is not None:
        fsdp["prefetch"] = args.prefetch
    if args.max_unsharded is not None:
        fsdp["max_unsharded"] = args.max_unsharded
    return schedule.lower(grad_reduce=args.grad_reduce, fsdp=args.fsdp, merge_iw=args.merge_iw, **fsdp)


def _show(args: argparse.Namespace) -> int:
    schedule = _load(args)
    print(
        f"{schedule.name or 'schedule'}: {schedule.num_ranks} ranks, {schedule.num_stages} stages, "
        f"{schedule.num_microbatches} microbatches, {schedule.num_steps} steps{' (lowered)' if schedule.is_lowered else ''}"
    )
    print(schedule.format())
    return 0


def _export(args: argparse.Namespace) -> int:
    target = schedule_output(args)
    assert target is not None  # argparse requires --csv or --json
    schedule = _load(args)
    print(f"wrote {write_schedule(schedule, target)}")
    return 0


def _validate(args: argparse.Namespace) -> int:
    schedule = Schedule.load(args.file)  # its errors name the file already
    try:
        validate(schedule, matching=args.matching)
    except ScheduleError as err:
        raise ScheduleError(f"{args.file}: {err}") from None
    kind = "lowered" if schedule.is_lowered else "compute-only"
    if schedule.is_lowered and args.matching != "nccl":
        kind += f" ({args.matching} matching)"
    print(
        f"{args.file}: valid {kind} schedule, {schedule.num_ranks} ranks, {schedule.num_stages} stages, "
        f"{schedule.num_microbatches} microbatches"
    )
    return 0
