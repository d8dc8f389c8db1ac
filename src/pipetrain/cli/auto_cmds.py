"""``pipetrain plan``: rank every schedule for measured costs and a memory limit, keep the best."""

from __future__ import annotations

import argparse
import math
from typing import Any

from pipetrain.plan.costs import Costs
from pipetrain.plan.errors import ScheduleError
from pipetrain.plan.search import rank_schedules


def register(subparsers: Any) -> None:
    plan = subparsers.add_parser(
        "plan", help="pick the fastest schedule for given costs within a memory limit (simulated)"
    )
    plan.add_argument("--ranks", "-p", type=int, required=True, help="number of pipeline ranks P")
    plan.add_argument("--microbatches", "-m", type=int, required=True, help="number of microbatches M")
    plan.add_argument("--stages-per-rank", "-v", type=int, default=None, help="only this many stages per rank")
    plan.add_argument(
        "--costs",
        default="f=1,b=2",
        help="per-stage durations, e.g. f=1,b=2,i=1,w=1,comm=0.1 (per-stage lists with ':', e.g. f=2:1:1:2)",
    )
    plan.add_argument(
        "--memory-limit",
        type=float,
        default=None,
        help="peak activations per rank, in microbatches of one rank's share (bytes if --costs sets bytes=)",
    )
    plan.add_argument("--top", type=int, default=10, help="how many candidates to list")
    out = plan.add_mutually_exclusive_group()
    out.add_argument("--csv", metavar="FILE", help="write the chosen schedule in torch's CSV format")
    out.add_argument("--json", metavar="FILE", help="write the chosen schedule as JSON")
    plan.set_defaults(func=_plan)


def _plan(args: argparse.Namespace) -> int:
    for flag, value in (
        ("--ranks", args.ranks),
        ("--microbatches", args.microbatches),
        ("--stages-per-rank", args.stages_per_rank),
    ):
        if value is not None and value < 1:
            raise ScheduleError(f"{flag} must be >= 1, got {value}")
    limit = args.memory_limit
    if limit is not None and not (math.isfinite(limit) and limit >= 0):
        raise ScheduleError(f"--memory-limit must be a finite number >= 0, got {limit:g}")
    costs = Costs.parse(args.costs)
    ranked = rank_schedules(
        args.ranks, args.microbatches, costs, args.memory_limit, stages_per_rank=args.stages_per_rank
    )
    if not ranked:
        raise ScheduleError(f"no schedule accepts {args.ranks} ranks and {args.microbatches} microbatches")
    print(f"costs: {costs}   memory limit: {'none' if args.memory_limit is None else f'{args.memory_limit:g}'}")
    header = f"{'':2}{'schedule':24}{'v':>3}{'makespan':>11}{'bubble':>9}{'memory':>9}  fits"
    print(header)
    for cand in ranked[: max(1, args.top)]:
        mark = "->" if cand is ranked[0] and cand.fits else ""
        print(
            f"{mark:2}{cand.name:24}{cand.stages_per_rank:>3}{cand.result.makespan:>11.4g}"
            f"{100 * cand.result.bubble:>8.1f}%{cand.memory:>9.2f}  {'yes' if cand.fits else 'no'}"
        )
    best = ranked[0]
    if not best.fits:
        least = min(ranked, key=lambda c: c.memory)
        raise ScheduleError(
            f"no schedule fits --memory-limit {args.memory_limit:g}; the least memory is {least.memory:g} "
            f"({least.name}, {least.stages_per_rank} stages per rank)"
        )
    best.schedule.validate()
    if args.csv:
        best.schedule.to_csv(args.csv)
        print(f"wrote {args.csv}")
    elif args.json:
        best.schedule.to_json(args.json, indent=1)
        print(f"wrote {args.json}")
    return 0
