"""``pipetrain simulate`` and ``compare``: how long, how idle, how much memory, and pictures."""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any

from pipetrain.cli.arguments import add_output_argument, add_schedule_command
from pipetrain.cli.common import (
    OUTPUT_NAMING,
    PROFILE_HELP,
    RANK_SHARES,
    STAGE_ACT,
    UNITS,
    add_costs_options,
    add_size_arguments,
    output_path,
    read_costs_file,
    require,
    schedule_from_args,
)
from pipetrain.plan.costs import Costs, held_per_rank
from pipetrain.plan.errors import ScheduleError
from pipetrain.plan.generators import build_schedule, schedule_names
from pipetrain.plan.schedule import Schedule, is_schedule_file
from pipetrain.plan.simulate import SimResult, simulate

_SHARE_MEANING = (
    "as in plan and compare, plain f/b/i/w and bytes= are one rank's share of the model: a schedule with V "
    "stages on every rank runs each stage in 1/V of them (stages spread unevenly take them per stage); with "
    "any ':' per-stage value every number is per stage, plain ones included, and the number of stages is fixed"
)


def _add_costs_argument(parser: argparse.ArgumentParser, meaning: str) -> None:
    """``--costs SPEC`` or ``--from-profile FILE``; ``meaning`` says what the numbers describe here."""
    add_costs_options(
        parser,
        default="",
        costs_help="durations and latency, e.g. f=1,b=2,i=1,w=1,comm=0 (per-stage values with ':', e.g. f=2:1:1:2; "
        "also overlap=0..1 for F&B pairs, bytes=... per activation); " + meaning,
        profile_help=PROFILE_HELP + "; its stage count must be the schedule's",
    )


def register(subparsers: Any) -> None:
    sim = add_schedule_command(
        subparsers,
        "simulate",
        help="simulate a schedule: makespan, bubble, memory, timeline picture",
        description="Time a named schedule (or a .csv/.json file) with a cost model: step time (makespan), "
        "idle share (bubble) and peak activations per rank (in stage activations, and in microbatches of a rank's "
        "share as plan counts); optionally draw its timeline (--png/--svg, needs "
        "matplotlib) or write a Chrome trace.",
    )
    _add_costs_argument(sim, _SHARE_MEANING)
    sim.add_argument("--lowered", action="store_true", help="simulate the lowered schedule (with SEND/RECV)")
    add_output_argument(sim, "png", "write the timeline picture as PNG")
    add_output_argument(sim, "svg", "write the timeline picture as SVG")
    sim.add_argument(
        "--trace",
        metavar="FILE",
        help=f"write a Chrome trace, JSON (Perfetto, chrome://tracing; {OUTPUT_NAMING.format(fmt='json')})",
    )
    sim.add_argument("--grid", action="store_true", help="print a text grid aligned to simulated time")
    sim.add_argument("--json", action="store_true", help="print the result summary as JSON on stdout")
    sim.set_defaults(func=_simulate)

    cmp = subparsers.add_parser(
        "compare",
        help="simulate every schedule that accepts the sizes, one row each",
        description="Simulate every known schedule for the same model on P ranks and M microbatches and print "
        "one table row each: makespan, bubble, ratio to 1F1B, peak activations (in stage activations per rank, and "
        "in microbatches of a rank's share as plan counts), messages sent.",
    )
    add_size_arguments(cmp, required=True)
    _add_costs_argument(cmp, _SHARE_MEANING + "; so every row runs the same model")
    add_output_argument(cmp, "png", "write one PNG picture stacking every schedule's timeline")
    cmp.add_argument("--json", action="store_true", help="print the rows as JSON on stdout")
    cmp.set_defaults(func=_compare)


def _costs(args: argparse.Namespace) -> Costs:
    if args.from_profile is not None:
        return read_costs_file(args.from_profile)
    return Costs.parse(args.costs, share="rank") if args.costs else Costs(share="rank")


def _simulate(args: argparse.Namespace) -> int:
    pictures = [(output_path(path, fmt), fmt) for path, fmt in ((args.png, "png"), (args.svg, "svg")) if path]
    trace = output_path(args.trace, "json", "trace") if args.trace else None
    if pictures:
        require("matplotlib", "simulate", "--" + "/--".join(fmt for _, fmt in pictures))
    schedule = schedule_from_args(args.schedule, args)
    given = _costs(args)
    costs = given.cut_into(held_per_rank(schedule))  # (plain numbers: one rank's share)
    if args.from_profile is not None:  # a profile's per-stage costs fix a stage count: say whose
        try:
            costs.per_stage("f", schedule.num_stages)
        except ScheduleError as err:
            raise ScheduleError(
                f"--from-profile {args.from_profile}: {err} (give the stages per rank with -v, or simulate "
                "the schedule the profile ran)"
            ) from None
    try:
        if args.lowered and not schedule.is_lowered:
            schedule = schedule.lower()
        result = simulate(schedule, costs)
    except ScheduleError as err:  # a broken or deadlocking file: say which file
        if is_schedule_file(args.schedule):
            raise ScheduleError(f"{args.schedule}: {err}") from None
        raise
    written = _write_pictures(result, pictures, trace)
    if args.json:
        v = _even_stages(schedule)
        units = {"makespan": "the costs' time unit", "peak_memory": "stage activations"}
        summary = {**result.summary(), "costs_given": str(given)}
        if v is not None:
            summary["peak_memory_rank_shares"] = {str(r): n / v for r, n in result.peak_memory.items()}
            units["peak_memory_rank_shares"] = _SHARE_UNIT
        if result.peak_memory_bytes is not None:
            units["peak_memory_bytes"] = "bytes"
        summary["units"] = units
        print(json.dumps(summary, indent=1))
        return 0
    v = _even_stages(schedule)
    print(_describe(result, given, None if v == 1 else v))
    if args.grid:
        from pipetrain.plan.render import format_time_grid

        print(format_time_grid(result.timeline))
    for label, path in written:
        print(f"wrote {label} {path}")
    return 0


def _write_pictures(result: SimResult, pictures: list[tuple[str, str]], trace: str | None) -> list[tuple[str, str]]:
    """Write the pictures (path, format) and the trace; returns (label, path) of each file written."""
    written: list[tuple[str, str]] = []
    if pictures:
        from pipetrain.plan.render import render_timeline

        for path, fmt in pictures:
            written.append(("timeline", render_timeline(result.timeline, path, format=fmt)))
    if trace:
        from pipetrain.plan.trace import write_chrome_trace

        write_chrome_trace(result.timeline, trace)
        written.append(("trace", trace))
    return written


_SHARE_UNIT = "microbatches of a rank's share (stage activations / stages per rank, as plan counts)"


def _even_stages(schedule: Schedule) -> int | None:
    """Stages per rank when every rank holds as many (a rank's share is then cut into them), else None."""
    v = held_per_rank(schedule)
    return v if v * schedule.num_ranks == schedule.num_stages else None


def _describe(r: SimResult, given: Costs, v: int | None) -> str:
    """The text summary; ``v``: stages per rank (None: one, where a stage is a rank's share, or spread
    unevenly, where there is no rank's share to count in)."""
    costs = (
        f"costs: {r.costs}"
        if given.cut_into(1) == r.costs
        else f"costs: {given} for one rank's share of the model, so each of its {r.num_stages // r.num_ranks} "
        f"stages takes {r.costs}"
    )
    peak = r.max_peak_memory
    share = "" if v is None else f" = {peak / v:g} microbatches of a rank's share"
    lines = [
        f"{r.title.split(' | ')[0]} | makespan {r.makespan:g}, bubble {100 * r.bubble:.1f}%, "
        f"peak {peak} stage activations{share}",
        costs + (" (lowered schedule)" if r.lowered else ""),
        f"makespan {r.makespan:g} (lower bound {r.lower_bound:g}), bubble {100 * r.bubble:.1f}%",
        f"{'':4}  {'':8}  {'':8}  {'peak memory':>24}" if v is not None else f"{'':4}  {'':8}  {'':8}  {'peak':>11}",
        f"{'rank':>4}  {'busy':>8}  {'idle':>8}  {STAGE_ACT:>11}  "
        + (f"{RANK_SHARES:>11}  " if v is not None else "")
        + f"{'at time':>8}",
    ]
    for rank in range(r.num_ranks):
        shares = "" if v is None else f"{r.peak_memory[rank] / v:>11g}  "
        lines.append(
            f"{rank:>4}  {r.busy[rank]:>8g}  {r.idle[rank]:>8g}  {r.peak_memory[rank]:>11}  {shares}"
            f"{r.peak_memory_time[rank]:>8g}"
        )
    if v is None:
        lines.append(UNITS.split("\n")[0].rstrip(";"))
    elif v == 2:
        lines.append(UNITS)
    else:
        lines.append(UNITS.rsplit(":", 1)[0].replace(f"{STAGE_ACT} / stages per rank", f"{STAGE_ACT} / {v}") + ")")
    if r.peak_memory_bytes is not None:
        lines.append("peak bytes per rank: " + ", ".join(f"{r.peak_memory_bytes[k]:g}" for k in range(r.num_ranks)))
    return "\n".join(lines)


def compare_rows(
    num_ranks: int, num_microbatches: int, stages_per_rank: int | None, costs: Costs
) -> tuple[list[dict[str, Any]], list[SimResult]]:
    """One row per schedule that accepts the sizes (the data behind ``pipetrain compare``)."""
    rows: list[dict[str, Any]] = []
    results: list[SimResult] = []
    for name in schedule_names():
        try:
            schedule = build_schedule(name, num_ranks, num_microbatches, stages_per_rank)
        except ScheduleError:
            continue
        v = held_per_rank(schedule)
        try:
            # per-stage costs describe the stages as they are; plain numbers a rank's share
            result = simulate(schedule, costs.cut_into(v))
        except ScheduleError as err:
            rows.append({"schedule": name, "error": str(err)})
            continue
        results.append(result)
        rows.append(
            {
                "schedule": name,
                "stages": schedule.num_stages,
                "makespan": result.makespan,
                "bubble": result.bubble,
                "peak_activations": [result.peak_memory[r] for r in range(num_ranks)],
                "peak_activations_model_share": max(result.peak_memory.values()) / v,
                "units": {"peak_activations": "stage activations", "peak_activations_model_share": _SHARE_UNIT},
                "sends": _count_sends(schedule),
            }
        )
    base = next((r for r in rows if r["schedule"] == "1F1B" and "makespan" in r), None)
    for row in rows:
        if base is not None and "makespan" in row and base["makespan"] > 0:
            row["vs_1f1b"] = row["makespan"] / base["makespan"]
    return rows, results


def _count_sends(schedule: Schedule) -> int | None:
    try:
        low = schedule.lower()
    except (ScheduleError, ImportError):
        return None
    return sum(1 for a in low.iter_actions() if a is not None and a.kind.value in ("SEND_F", "SEND_B"))


def _compare(args: argparse.Namespace) -> int:
    png = output_path(args.png, "png") if args.png else None
    if png:
        require("matplotlib", "compare", "--png")
    if args.stages_per_rank is not None and args.stages_per_rank < 1:
        raise ScheduleError(f"--stages-per-rank must be >= 1, got {args.stages_per_rank}")
    costs = _costs(args)
    rows, results = compare_rows(args.ranks, args.microbatches, args.stages_per_rank, costs)
    if not rows:
        raise ScheduleError(
            f"no schedule accepts {args.ranks} ranks, {args.microbatches} microbatches"
            + (f", {args.stages_per_rank} stages per rank" if args.stages_per_rank else "")
        )
    if png and not results:  # every row is an error: nothing to draw
        print(f"pipetrain compare: no schedule could be simulated, so {png} is not written", file=sys.stderr)
        png = None
    if png:
        from pipetrain.plan.render import render_timelines

        png = render_timelines([r.timeline for r in results], png, format="png")
    if args.json:
        print(json.dumps(rows, indent=1))
        return 0
    print(
        f"{args.ranks} ranks, {args.microbatches} microbatches, costs {costs} "
        + ("per stage" if costs.fixes_stages else "per rank's share of the model")
        + (f", {args.stages_per_rank} stages per rank" if args.stages_per_rank else "")
    )
    print(format_compare_table(rows))
    print(
        "stage activations: one stage's activations of one microbatch each, as simulate counts; microbatches of a "
        "rank's share: the same / stages per rank, as plan and --memory-limit count (ZB-V: 8 = 4)"
    )
    if png:
        print(f"wrote {png}")
    return 0


def format_compare_table(rows: list[dict[str, Any]]) -> str:
    """A Markdown table of ``compare_rows`` output."""
    header = (
        "| schedule | stages | makespan | bubble | vs 1F1B | peak stage activations per rank "
        "| peak (microbatches of a rank's share) | sends |"
    )
    lines = [header, "|---|---:|---:|---:|---:|---|---:|---:|"]
    for row in rows:
        if "error" in row:
            lines.append(f"| {row['schedule']} | | | | | {row['error']} | | |")
            continue
        ratio = f"{row['vs_1f1b']:.2f}" if "vs_1f1b" in row else ""
        sends = "" if row["sends"] is None else str(row["sends"])
        peaks = " ".join(str(x) for x in row["peak_activations"])
        lines.append(
            f"| {row['schedule']} | {row['stages']} | {row['makespan']:g} | {100 * row['bubble']:.1f}% | {ratio} "
            f"| {peaks} | {row['peak_activations_model_share']:g} | {sends} |"
        )
    return "\n".join(lines)
