"""``pipetrain plan``: construct the fastest schedule for measured costs and a memory limit, beside
the named schedules it had to beat."""

from __future__ import annotations

import argparse
import math
from typing import Any

from pipetrain.cli.common import (
    OUTPUT_NAMING,
    RANK_SHARES,
    STAGE_ACT,
    UNITS,
    add_costs_options,
    read_costs_file,
    schedule_output,
    write_schedule,
)
from pipetrain.cli.pipeline_cmd import LAYERS_HELP, memory_limit_bytes, plan_layers
from pipetrain.plan.costs import Costs, held_per_rank
from pipetrain.plan.errors import ScheduleError
from pipetrain.plan.search import MEMORY_TOLERANCE, plan_schedule, rank_schedules
from pipetrain.plan.simulate import simulate


def register(subparsers: Any) -> None:
    plan = subparsers.add_parser(
        "plan",
        help="construct the fastest schedule for given costs within a memory limit (simulated)",
        description="Simulate every named schedule and stages-per-rank choice for the given costs, list them "
        "fastest first with their peak memory, then construct per-rank orders (auto_schedule) that beat the "
        "fastest one that fits --memory-limit, or fit where none does; keep the best (written with "
        "--csv/--json, ready for `pipetrain train --schedule FILE`). With --layers FILE (a per-layer profile) it "
        "plans the whole pipeline instead: the cut into stages, placement, recompute and schedule within "
        "--memory-limit bytes per rank, beside the hand splits peers use, with torchtitan's and Megatron's settings "
        "for the cut.",
    )
    plan.add_argument("--ranks", "-p", type=int, required=True, help="number of pipeline ranks P")
    plan.add_argument("--microbatches", "-m", type=int, required=True, help="number of microbatches M")
    plan.add_argument("--stages-per-rank", "-v", type=int, default=None, help="only this many stages per rank")
    costs = add_costs_options(
        plan,
        default="f=1,b=2",
        costs_help="durations of one rank's share of the model, e.g. f=1,b=2,i=1,w=1,comm=0.1: a schedule with v "
        "stages per rank runs each stage in 1/v of them, so every candidate runs the same model; or one value "
        "per stage with ':' (e.g. f=2:1:1:2), which fixes the number of stages and makes every number per stage, "
        "plain ones included",
    )
    costs.add_argument("--layers", metavar="FILE", help=LAYERS_HELP)
    plan.add_argument("--time-limit", type=float, default=10.0, help="seconds the construction may search (default 10)")
    plan.add_argument(
        "--placement",
        choices=("loop", "v"),
        default=None,
        help="only this layout: 2 stages per rank unless --stages-per-rank or per-stage costs say otherwise "
        "(v needs 2)",
    )
    plan.add_argument(
        "--memory-limit",
        default=None,
        help="peak activations per rank, in microbatches of one rank's share ('rank shares': simulate's stage "
        "activations / stages per rank; bytes if --costs sets bytes=); with --layers, everything a rank holds, in "
        "bytes: a number (80e9) or with a unit (80GiB, 80GB). Without a limit, of the schedules within "
        f"{100 * MEMORY_TOLERANCE:g} %% of the fastest makespan the one holding the least memory is chosen (and the "
        "faster one named, with what it costs); with one, the fastest that fits",
    )
    plan.add_argument(
        "--comm",
        type=float,
        default=None,
        help="with --layers: latency of a message between ranks, in the layers' time unit (default: the file's "
        "meta comm, else 0)",
    )
    plan.add_argument("--top", type=int, default=10, help="how many candidates to list")
    out = plan.add_mutually_exclusive_group()
    out.add_argument(
        "--csv",
        metavar="FILE",
        help=f"write the chosen schedule in torch's CSV format ({OUTPUT_NAMING.format(fmt='csv')})",
    )
    out.add_argument(
        "--json",
        metavar="FILE",
        nargs="?",
        const="",
        help=f"write the chosen schedule as JSON ({OUTPUT_NAMING.format(fmt='json')}); with --layers and no FILE, "
        "print the plan as JSON on stdout",
    )
    plan.set_defaults(func=_plan)


def _plan(args: argparse.Namespace) -> int:
    args.print_json = args.json == ""
    if args.layers is not None:
        return plan_layers(args)
    if args.print_json:
        raise ScheduleError("--json without a FILE prints the plan only with --layers; give --json FILE")
    if args.comm is not None:
        raise ScheduleError("--comm sets the latency of a --layers profile; with --costs give comm= in the costs")
    return _plan_costs(args)


def _plan_costs(args: argparse.Namespace) -> int:
    args.memory_limit = memory_limit_bytes(args.memory_limit)
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
    if not (math.isfinite(args.time_limit) and args.time_limit > 0):
        raise ScheduleError(f"--time-limit must be a finite number of seconds > 0, got {args.time_limit:g}")
    costs = _read_costs(args)
    target = schedule_output(args)
    ranked = rank_schedules(
        args.ranks, args.microbatches, costs, args.memory_limit, stages_per_rank=args.stages_per_rank
    )
    in_bytes = costs.activation_bytes is not None
    unit = "bytes" if in_bytes else RANK_SHARES
    print(
        f"costs: {costs}   memory limit: "
        + (
            f"none (of the schedules within {100 * MEMORY_TOLERANCE:g} % of the fastest, the least memory)"
            if args.memory_limit is None
            else f"{args.memory_limit:g} {unit}"
        )
    )
    print(f"{'':2}{'':24}{'':3}{'':11}{'':9}{'peak memory per rank':>26}")
    print(f"{'':2}{'schedule':24}{'v':>3}{'makespan':>11}{'bubble':>9}{STAGE_ACT:>13}{unit:>13}  fits")
    for cand in ranked[: max(1, args.top)]:
        print(
            f"{'':2}{cand.name:24}{cand.stages_per_rank:>3}{cand.result.makespan:>11.4g}"
            f"{100 * cand.result.bubble:>8.1f}%{cand.result.max_peak_memory:>13}{cand.memory:>13.4g}"
            f"  {'yes' if cand.fits else 'no'}"
        )
    found = plan_schedule(
        args.ranks,
        args.microbatches,
        costs,
        args.memory_limit,
        stages_per_rank=args.stages_per_rank,
        placement=args.placement,
        time_limit=args.time_limit,
    )
    chosen = found.schedule
    chosen.validate()
    v = held_per_rank(chosen)
    stage_costs = costs.cut_into(v)
    result = simulate(chosen, stage_costs)
    # (With one rank the two layouts are the same.)
    layout = "V" if v == 2 and args.ranks > 1 and chosen.stage_to_rank.get(2 * args.ranks - 1) == 0 else "loop"
    print(
        f"{'->':2}{chosen.name:24}{v:>3}{result.makespan:>11.4g}{100 * result.bubble:>8.1f}%"
        f"{result.max_peak_memory:>13}{found.memory:>13.4g}  yes  ({layout} placement)"
    )
    print(UNITS if not in_bytes else UNITS.split("\n")[0].rstrip(";") + "; bytes: as bytes= gives them")
    named = found.best_named
    faster = found.faster
    if named is None:
        print("no named schedule fits this memory limit; the constructed one does")
    elif chosen.name == "Auto":
        print(
            f"constructed: {named.result.makespan / result.makespan:.4f}x faster than {named.name}, the best named "
            f"schedule that fits (makespan {named.result.makespan:.4g})"
        )
    elif faster is None or faster.name != "Auto":
        print(f"{named.name} stays the best: nothing constructed in {args.time_limit:g} s beat it")
    if faster is not None:
        print(
            f"{faster.name} (v={faster.stages_per_rank}) would be {100 * (1 - faster.makespan / result.makespan):.2g} % "
            f"faster (makespan {faster.makespan:.4g}) at {faster.memory / found.memory:.3g}x the memory "
            f"({faster.memory:.4g} {unit});\nwithin {100 * MEMORY_TOLERANCE:g} % of the fastest, plan takes the least "
            f"memory: --memory-limit {faster.memory:g} takes the fastest that fits"
        )
    if not costs.fixes_stages and v != 1:
        print(f"with {v} stages per rank each stage costs {stage_costs}")
    if target is not None:
        path = write_schedule(chosen, target)
        print(f"wrote {path}")
        print(f"check it: pipetrain simulate {path} --costs '{costs}'")
    return 0


def _read_costs(args: argparse.Namespace) -> Costs:
    return Costs.parse(args.costs, share="rank") if args.from_profile is None else read_costs_file(args.from_profile)
