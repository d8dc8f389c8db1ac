"""What ``pipetrain train`` leaves in ``--out``: the last step measured beside its simulation.

The simulation uses the schedule that ran and a cost model taken from the measurement itself
(each stage's median F, B, I and W seconds and the median message latency, as ``pipetrain
profile`` measures them), so the two pictures share a unit and differ only by what the cost
model leaves out: time spent sending, waits beyond the latency, per-action overhead.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from pipetrain.plan.costs import Costs
from pipetrain.plan.errors import ScheduleError
from pipetrain.plan.measure import costs_from_timelines
from pipetrain.plan.schedule import Schedule
from pipetrain.plan.timeline import Timeline

__all__ = ["bubble_fraction", "write_outputs"]

_COMPUTE = ("F", "B", "I", "W", "OVERLAP_F_B")


def bubble_fraction(timeline: Timeline) -> float:
    """Share of ranks × step time not spent in compute actions (0 = no bubble)."""
    span = timeline.makespan
    if span <= 0 or timeline.num_ranks == 0:
        return 0.0
    busy = sum(e.duration for e in timeline.events if e.kind in _COMPUTE)
    return max(0.0, 1.0 - busy / (span * timeline.num_ranks))


def _measured_costs(schedule: Schedule, measured: Timeline) -> Costs:
    """Each stage's median measured F/B/I/W seconds and the message latency of this step: what
    ``pipetrain profile`` measures over its steps (:func:`~pipetrain.plan.costs_from_timelines`)."""
    return costs_from_timelines([measured], schedule.num_stages)


def _simulate(schedule: Schedule, costs: Costs) -> Timeline:
    from pipetrain.plan.simulate import simulate

    result = simulate(schedule, costs)
    timeline: Timeline = result.timeline
    timeline.title = f"{schedule.name or 'schedule'}: simulated (measured F/B/I/W per stage and latency)"
    timeline.unit = "s"
    return timeline


def _draw(timelines: list[Timeline], png: Path) -> list[Path]:
    """PNG of the timelines stacked on one time axis; nothing when matplotlib is not installed."""
    from pipetrain.plan.render import render_timelines

    try:
        render_timelines(timelines, png)
    except ImportError:
        return []
    return [png]


def _trace(timeline: Timeline, path: Path) -> list[Path]:
    from pipetrain.plan.trace import write_chrome_trace

    write_chrome_trace(timeline, path)
    return [path]


def write_outputs(
    out: Path, schedule: Schedule, measured: Timeline | None, result: Any, cfg: Any, tokens_per_step: int
) -> list[str]:
    """Write timelines (JSON, PNG, Chrome trace) and ``summary.md`` / ``summary.json``; return the paths."""
    out.mkdir(parents=True, exist_ok=True)
    written: list[Path] = []
    summary: dict[str, Any] = {
        "schedule": schedule.name or cfg.schedule,
        "ranks": schedule.num_ranks,
        "stages": schedule.num_stages,
        "microbatches": schedule.num_microbatches,
        "steps": cfg.steps,
        "batch_size": cfg.batch_size,
        "model": cfg.model,
        "device": cfg.device,
        "first_loss": result.losses[0],
        "final_loss": result.losses[-1],
        "eval_loss": getattr(result, "eval_loss", None),
        "losses": result.losses,
        "grad_norms": getattr(result, "grad_norms", []),
        "tokens_per_s_last": tokens_per_step / result.step_times[-1],
        "tokens_per_step": tokens_per_step,
        "step_times_s": getattr(result, "step_times", []),
    }
    # What the run adds where it has it: the auto plan, the layout, the memory and time promises.
    for key, attribute in (("auto", "plan_summary"), ("plan", "plan"), ("memory", "memory"), ("time", "time")):
        value = getattr(result, attribute, None)
        if value:
            summary[key] = value
    # The schedule the last step trained with (JSON keeps its name): `--schedule FILE` trains it again.
    schedule.to_json(out / "schedule.json")
    written.append(out / "schedule.json")
    summary["schedule_file"] = str(out / "schedule.json")
    simulated = None
    if measured is not None:
        measured.title = f"{schedule.name or 'schedule'}: measured last step ({cfg.device})"
        measured.to_json(out / "measured_timeline.json")
        written.append(out / "measured_timeline.json")
        written += _draw([measured], out / "measured_timeline.png")
        written += _trace(measured, out / "measured_trace.json")
        try:
            costs: Costs | None = _measured_costs(schedule, measured)
        except ScheduleError as err:  # e.g. every F inside an OVERLAP_F_B: no plain F to time
            costs = None
            summary["costs"] = f"not measured: {err}"
        if costs is not None:
            # For `--from-profile` in plan, simulate and compare: plan for what this job measured.
            (out / "costs.txt").write_text(f"{costs}\n", encoding="utf-8")
            written.append(out / "costs.txt")
            summary["costs"] = str(costs)
            simulated = _simulate(schedule, costs)
        summary["measured_step_s"] = measured.makespan
        summary["measured_bubble"] = bubble_fraction(measured)
    if measured is not None and simulated is not None:
        simulated.to_json(out / "simulated_timeline.json")
        written.append(out / "simulated_timeline.json")
        written += _draw([simulated], out / "simulated_timeline.png")
        written += _trace(simulated, out / "simulated_trace.json")
        # The two on one time axis: the gap between them is what the cost model leaves out.
        written += _draw([measured, simulated], out / "timelines.png")
        summary["simulated_step_s"] = simulated.makespan
        summary["simulated_bubble"] = bubble_fraction(simulated)
    (out / "summary.json").write_text(json.dumps(summary, indent=1) + "\n", encoding="utf-8")
    (out / "summary.md").write_text(_summary_md(summary), encoding="utf-8")
    written += [out / "summary.json", out / "summary.md"]
    return [str(p) for p in written]


def _bytes(value: float) -> str:
    for unit, size in (("TiB", 2**40), ("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if abs(value) >= size:
            return f"{value / size:.2f} {unit}"
    return f"{value:.0f} B"


def _plan_md(plan: dict[str, Any]) -> list[str]:
    """The plan as a table: each stage's layers, rank and recompute; then the simulated step and peaks."""
    where = plan.get("stage_to_rank", {})
    recompute = set(plan.get("recompute", []))
    lines = ["| stage | rank | layers | recompute |", "|---|---|---|---|"]
    for s, names in enumerate(plan.get("stage_layers", [])):
        lines.append(f"| {s} | {where.get(str(s), '?')} | {', '.join(names)} | {'yes' if s in recompute else ''} |")
    limit = plan.get("memory_limit")
    peaks = plan.get("peak_memory_bytes", {})
    lines += [
        "",
        f"Schedule {plan.get('schedule')} ({plan.get('placement')} placement, {plan.get('stages_per_rank')} stage(s) "
        f"per rank): simulated step {plan.get('makespan', 0.0) * 1e3:.4g} ms, bubble {plan.get('bubble', 0.0):.1%}; "
        f"memory limit {_bytes(limit) if limit is not None else 'none'} ({plan.get('memory_limit_source', '')}).",
        "",
        "| rank | planned peak |",
        "|---|---|",
        *(f"| {r} | {_bytes(v)} |" for r, v in sorted(peaks.items(), key=lambda kv: int(kv[0]))),
        "",
    ]
    base = plan.get("baseline")
    if base and "makespan" in base:
        lines += [
            f"{base['schedule']} on the even cut, simulated with the same layer costs: "
            f"{base['makespan'] * 1e3:.4g} ms ({base['makespan'] / plan['makespan']:.3f}x the plan's step).",
            "",
        ]
    return lines


def _memory_md(memory: dict[str, Any]) -> list[str]:
    """Each rank's measured peak of one step beside the simulation's."""
    lines = [
        f"Memory of step {memory['step']}, measured ({memory['measure']}) beside the simulation's promise "
        "(the schedule that ran, on the layer profile's costs of its cut):",
        "",
        "| rank | measured in the step | promised in the step | promised peak | of which static |",
        "|---|---|---|---|---|",
    ]
    for rank, e in sorted(memory["ranks"].items(), key=lambda kv: int(kv[0])):
        measured = e.get("measured_peak_bytes")
        cells = [_bytes(measured) if measured is not None else "not measured"]
        for key in ("promised_peak_bytes", "promised_total_bytes", "static_bytes"):
            cells.append(_bytes(e[key]) if e.get(key) is not None else "-")
        lines.append(f"| {rank} | " + " | ".join(cells) + " |")
    lines += [
        "",
        "Measured: bytes allocated during the step above those held when it began (weights and Adam's state "
        "were held already; gradients are allocated in the step). Promised in the step: the simulated peak "
        "less the static bytes (weights, gradients, Adam's state) plus the gradients.",
        "",
    ]
    return lines


def _summary_md(s: dict[str, Any]) -> str:
    lines = [
        f"# pipetrain train: {s['schedule']}",
        "",
        f"{s['ranks']} ranks, {s['stages']} stages, {s['microbatches']} microbatches, batch {s['batch_size']}, "
        f"model {s['model']} on {s['device']}, {s['steps']} steps.",
        "",
        f"Loss {s['first_loss']:.4f} → {s['final_loss']:.4f}"
        + (f" (held-out {s['eval_loss']:.4f})" if s.get("eval_loss") is not None else "")
        + f"; last step {s['tokens_per_s_last']:,.0f} tokens/s.",
        "",
    ]
    if s.get("auto"):
        lines += [f"Planned by `--schedule auto`: {s['auto']}", ""]
    if s.get("plan"):
        lines += _plan_md(s["plan"])
    if s.get("memory"):
        lines += _memory_md(s["memory"])
    if s.get("time"):
        from pipetrain.train.loop import time_line

        lines += [time_line(s["time"]) + ".", ""]
    if s.get("schedule_file"):
        lines += [f"The last step's schedule: `pipetrain train --schedule {s['schedule_file']}` runs it again.", ""]
    if "measured_step_s" in s:
        lines += ["| last step | step time | bubble |", "|---|---|---|"]
        lines.append(f"| measured | {s['measured_step_s'] * 1e3:.1f} ms | {s['measured_bubble']:.1%} |")
        if "simulated_step_s" in s:
            lines.append(f"| simulated | {s['simulated_step_s'] * 1e3:.1f} ms | {s['simulated_bubble']:.1%} |")
            lines += [
                "",
                "The simulation runs the same schedule with costs.txt: each stage's median F/B/I/W time and "
                "the median message latency of this step; the gap to the measurement is what that model leaves "
                "out (time spent sending, waits beyond the latency, per-action overhead).",
            ]
    else:
        lines.append("(the runtime recorded no timeline for this step)")
    return "\n".join(lines) + "\n"
