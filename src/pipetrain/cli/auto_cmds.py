"""``pipetrain plan``: rank every schedule for measured costs and a memory limit, keep the best."""

from __future__ import annotations

import argparse
import math
from typing import Any

from pipetrain.cli.common import OUTPUT_NAMING, schedule_output, write_schedule
from pipetrain.plan.costs import Costs
from pipetrain.plan.errors import ScheduleError
from pipetrain.plan.search import rank_schedules


def register(subparsers: Any) -> None:
    plan = subparsers.add_parser(
        "plan",
        help="pick the fastest schedule for given costs within a memory limit (simulated)",
        description="Simulate every schedule family and stages-per-rank choice for the given costs, list them "
        "fastest first with their peak memory, and keep the fastest that fits --memory-limit (written with "
        "--csv/--json, ready for `pipetrain train --schedule FILE`).",
    )
    plan.add_argument("--ranks", "-p", type=int, required=True, help="number of pipeline ranks P")
    plan.add_argument("--microbatches", "-m", type=int, required=True, help="number of microbatches M")
    plan.add_argument("--stages-per-rank", "-v", type=int, default=None, help="only this many stages per rank")
    plan.add_argument(
        "--costs",
        default="f=1,b=2",
        help="durations of one rank's share of the model, e.g. f=1,b=2,i=1,w=1,comm=0.1: a schedule with v "
        "stages per rank runs each stage in 1/v of them, so every candidate runs the same model; or one value "
        "per stage with ':' (e.g. f=2:1:1:2), which fixes the number of stages",
    )
    plan.add_argument(
        "--memory-limit",
        type=float,
        default=None,
        help="peak activations per rank, in microbatches of one rank's share (bytes if --costs sets bytes=)",
    )
    plan.add_argument("--top", type=int, default=10, help="how many candidates to list")
    out = plan.add_mutually_exclusive_group()
    out.add_argument(
        "--csv",
        metavar="FILE",
        help=f"write the chosen schedule in torch's CSV format ({OUTPUT_NAMING.format(fmt='csv')})",
    )
    out.add_argument(
        "--json", metavar="FILE", help=f"write the chosen schedule as JSON ({OUTPUT_NAMING.format(fmt='json')})"
    )
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
    target = schedule_output(args)
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
    stage_costs = costs.cut_into(best.stages_per_rank)
    if stage_costs != costs:
        # simulate takes costs per stage: say which ones reproduce these numbers for the file.
        v = best.stages_per_rank
        activations = (
            f"; its memory {best.memory:g} is {best.memory * v:g} stage activations, as simulate counts"
            if costs.activation_bytes is None
            else ""
        )
        print(f"{best.name} with {v} stages per rank: each stage costs {stage_costs}{activations}")
    if target is not None:
        path = write_schedule(best.schedule, target)
        print(f"wrote {path}")
        print(f"check it: pipetrain simulate {path} --costs '{stage_costs}'")
    return 0
