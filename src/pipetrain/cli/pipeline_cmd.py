"""``pipetrain plan --layers FILE``: plan the whole pipeline (cut, placement, recompute, schedule)
from a per-layer profile and a memory budget in bytes, beside the hand splits peers use."""

from __future__ import annotations

import argparse
import json
import math
from typing import Any

from pipetrain.cli.common import schedule_output, write_schedule
from pipetrain.plan.errors import ScheduleError
from pipetrain.plan.pipeline import (
    PipelinePlan,
    format_bytes,
    parse_bytes,
    plan_pipeline,
    read_layers,
    read_layers_meta,
)
from pipetrain.plan.pipeline.layers import with_optimizer

__all__ = ["LAYERS_HELP", "memory_limit_bytes", "plan_layers"]

LAYERS_HELP = (
    "plan the whole pipeline from a per-layer profile (a layers file, .json or .csv, as "
    "`pipetrain profile --layers-out` writes it): the cut into stages, placement, recompute and schedule, "
    "within --memory-limit bytes per rank"
)


def memory_limit_bytes(text: str | None) -> float | None:
    """``--memory-limit`` in bytes: a number (80e9) or one with a unit (80GiB, 80GB)."""
    if text is None:
        return None
    try:
        value = float(text)
    except ValueError:
        return parse_bytes(text)
    if not (math.isfinite(value) and value >= 0):
        raise ScheduleError(f"--memory-limit must be a finite number >= 0, got {text}")
    return value


def plan_layers(args: argparse.Namespace) -> int:
    """Run ``plan --layers``: print the plan, the hand splits and the exports (or JSON)."""
    if args.layers is None:
        raise ScheduleError("plan_layers needs --layers")
    for flag, value in (("--ranks", args.ranks), ("--microbatches", args.microbatches)):
        if value < 1:
            raise ScheduleError(f"{flag} must be >= 1, got {value}")
    if args.stages_per_rank is not None and args.stages_per_rank < 1:
        raise ScheduleError(f"--stages-per-rank must be >= 1, got {args.stages_per_rank}")
    if not (math.isfinite(args.time_limit) and args.time_limit > 0):
        raise ScheduleError(f"--time-limit must be a finite number of seconds > 0, got {args.time_limit:g}")
    limit = memory_limit_bytes(args.memory_limit)
    # A layers file's optimizer times (pipetrain profile measures them) are priced in W and B.
    layers = with_optimizer(read_layers(args.layers), args.microbatches)
    meta = read_layers_meta(args.layers)
    comm = args.comm
    if comm is None:
        comm = float(meta.get("comm", 0.0) or 0.0)
    if not (math.isfinite(comm) and comm >= 0):
        raise ScheduleError(f"--comm must be a finite number >= 0, got {comm:g}")
    target = schedule_output(args)
    plan = plan_pipeline(
        layers,
        args.ranks,
        args.microbatches,
        limit,
        stages_per_rank=args.stages_per_rank,
        placement=args.placement,
        comm=comm,
        time_limit=args.time_limit,
    )
    written = write_schedule(plan.schedule, target) if target is not None else None
    if args.print_json:
        summary = plan.summary()
        summary["layers_file"] = args.layers
        summary["time_unit"] = meta.get("time_unit")
        if written is not None:
            summary["wrote"] = written
        print(json.dumps(summary, indent=1))
        return 0
    _print_plan(plan, args, meta, comm)
    if written is not None:
        print(f"wrote {written}")
        print(
            f"check it: pipetrain simulate {written} --costs '{plan.costs}'"
            if len(str(plan.costs)) < 2000
            else f"check it: pipetrain simulate {written} with plan.costs"
        )
    return 0


def _unit(meta: dict[str, Any]) -> str:
    unit = meta.get("time_unit")
    return f" {unit}" if unit else ""


def _print_plan(plan: PipelinePlan, args: argparse.Namespace, meta: dict[str, Any], comm: float) -> None:
    unit = _unit(meta)
    limit = (
        "none" if plan.memory_limit is None else f"{format_bytes(plan.memory_limit)} ({plan.memory_limit:.0f} bytes)"
    )
    print(
        f"layers: {args.layers} ({len(plan.layers)} layers)   ranks {plan.num_ranks}, microbatches "
        f"{plan.num_microbatches}, comm {comm:g}{unit}, memory limit {limit}"
    )
    layout = "V" if plan.placement == "v" else "loop"
    print(
        f"plan: {plan.schedule.name} on {len(plan.stage_layers)} stages ({plan.stages_per_rank} per rank, {layout} "
        f"placement), makespan {plan.makespan:.6g}{unit}, bubble {100 * plan.bubble:.1f}%  [{plan.how}; "
        f"{plan.search_seconds:.1f} s]"
    )
    # (f+b: the stage's work per microbatch with its backward in one pass; f+i+w: split, which costs more)
    print(
        f"  {'stage':>5} {'rank':>4}  {'layers':<34} {'f+b':>9} {'f+i+w':>9} {'held/mb':>11} {'static':>11}  recompute"
    )
    costs, n = plan.costs, len(plan.stage_layers)
    f, i, w, b = (costs.per_stage(name, n) for name in ("f", "i", "w", "b"))
    held, static = costs.per_stage("activation_bytes", n), costs.per_stage("static_bytes", n)
    for s, names in enumerate(plan.stage_layers):
        span = names[0] if len(names) == 1 else f"{names[0]} .. {names[-1]}"
        span = f"{span} ({len(names)})"
        print(
            f"  {s:>5} {plan.stage_to_rank[s]:>4}  {span:<34} {f[s] + b[s]:>9.4g} {f[s] + i[s] + w[s]:>9.4g} "
            f"{format_bytes(held[s]):>11} "
            f"{format_bytes(static[s]):>11}  {'yes' if s in plan.recompute else ''}"
        )
    terms = plan.step_terms()
    print(f"  makespan prices {', '.join(terms['prices'])}; leaves out {', '.join(terms['leaves_out'])}")
    peaks = "  ".join(f"r{r} {format_bytes(b)}" for r, b in sorted(plan.peak_memory_bytes.items()))
    print(f"peak memory per rank: {peaks}")
    lowered = max(plan.lowered_peak_memory_bytes().values(), default=0.0)
    print(f"  (lowered, with SEND/RECV as it runs: largest {format_bytes(lowered)})")
    _print_hand_splits(plan, args.top)
    print("exports:")
    print(f"  torchtitan module_fqns_per_model_part = {json.dumps(plan.module_fqns_per_model_part())}")
    try:
        print(f'  Megatron --pipeline-model-parallel-layout "{plan.megatron_layout()}"')
    except ScheduleError as exc:
        print(f"  Megatron --pipeline-model-parallel-layout: none ({exc})")


def _print_hand_splits(plan: PipelinePlan, top: int) -> None:
    rows = sorted(plan.hand_splits, key=lambda h: (not h.fits, h.makespan))
    shown = rows[: max(1, top)]
    shown += [h for h in rows if h.rule.startswith("torchtitan") and h not in shown]
    print(f"hand splits, each with its best named schedule that fits ({len(shown)} of {len(rows)}; --top for more):")
    print(f"  {'rule':<38} {'layout':<24} {'schedule':<22} {'makespan':>10} {'bubble':>7} {'peak':>11}  plan is")
    for h in shown:
        peak = format_bytes(max(h.peak_memory_bytes.values(), default=0.0))
        if h.fits:
            speed = f"{h.makespan / plan.makespan:.3f}x faster" if plan.makespan > 0 else ""
            name = h.schedule_name or ""
        else:
            speed = "(nothing named fits)"
            name = f"none ({h.closest} needs)"
        print(
            f"  {h.rule[:38]:<38} {h.label:<24} {name[:22]:<22} {h.makespan:>10.6g} {100 * h.bubble:>6.1f}% "
            f"{peak:>11}  {speed}"
        )
